// The execution DAG of a run, drawn as SVG from its trace (Runs.GetTrace): the run's frame,
// a goal run's planning rounds (each with the model calls it made) before the steps, one node
// per step (never overwritten) placed in columns by dependency depth, each step's attempts
// inside it with the decision each ran under, and the plan's edges. Every frame, planning
// round, step and attempt is focusable and opens its detail (Enter or Space, or a click).
"use strict";

(function () {
  const NS = "http://www.w3.org/2000/svg";
  const W = 220;          // step width
  const HEAD = 46;        // step header height
  const ROW = 26;         // one attempt row
  const GAP_X = 70;
  const GAP_Y = 26;
  const PAD = 28;

  function s(tag, attrs, ...children) {
    const el = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== undefined && v !== null) el.setAttribute(k, String(v));
    }
    for (const c of children) {
      if (c !== null && c !== undefined) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }

  function clip(text, n) {
    text = String(text || "");
    return text.length > n ? text.slice(0, n - 1) + "…" : text;
  }

  /// Depth of each step: 0 without dependencies, else one more than its deepest dependency.
  function depths(steps, edges) {
    const parents = new Map(steps.map((st) => [st.step_id, []]));
    for (const e of edges) if (parents.has(e.to)) parents.get(e.to).push(e.from);
    const depth = new Map();
    const visit = (id, seen) => {
      if (depth.has(id)) return depth.get(id);
      if (seen.has(id)) return 0; // a cycle cannot be recorded, but never loop on one
      seen.add(id);
      const ps = (parents.get(id) || []).filter((p) => parents.has(p));
      const d = ps.length ? 1 + Math.max(...ps.map((p) => visit(p, seen))) : 0;
      depth.set(id, d);
      return d;
    };
    for (const st of steps) visit(st.step_id, new Set());
    return depth;
  }

  /// A goal run's planning rounds: one per `plan_created` (in `plan_rounds`), each with the
  /// model calls recorded before it and after the round before; calls after the last round are
  /// a round still planning (or one that ended the run), with `round` null. Each group has its
  /// node key (`plan:N`), its calls and the indexes in `trace.steps` of the steps it planned
  /// (rounds append their steps in order, after an explicit plan's).
  function rounds(trace) {
    const rs = ((trace && trace.plan_rounds) || []).slice().sort((a, b) => a.seq - b.seq);
    const calls = ((trace && trace.llm_calls) || []).slice().sort((a, b) => a.seq - b.seq);
    const steps = (trace && trace.steps) || [];
    const groups = rs.map((r, i) => ({ key: `plan:${i}`, index: i, round: r, calls: [], steps: [] }));
    const open = { key: `plan:${rs.length}`, index: rs.length, round: null, calls: [], steps: [] };
    for (const c of calls) {
      const g = groups.find((x) => x.round.seq > c.seq);
      (g || open).calls.push(c);
    }
    let at = Math.max(0, steps.length - rs.reduce((n, r) => n + (Number(r.steps) || 0), 0));
    for (const g of groups) {
      for (let k = 0; k < (Number(g.round.steps) || 0) && at < steps.length; k++) g.steps.push(at++);
    }
    if (open.calls.length) groups.push(open);
    return groups;
  }

  /// Sums of a group's calls: tokens in and out, cost, and how many were answered from the record.
  function totals(calls) {
    return calls.reduce((t, c) => ({
      input: t.input + (Number(c.input_tokens) || 0),
      output: t.output + (Number(c.output_tokens) || 0),
      cost: t.cost + (Number(c.cost) || 0),
      replayed: t.replayed + (Number(c.replayed) || 0),
    }), { input: 0, output: 0, cost: 0, replayed: 0 });
  }

  /// A cost as recorded, without float noise (0.00054, not 0.0005399999999999999).
  function money(n) {
    return String(Number((Number(n) || 0).toPrecision(12)));
  }

  /// The state a planning round is drawn in.
  function roundStatus(g, runStatus) {
    if (!g.round) {
      const last = g.calls[g.calls.length - 1];
      if (["failed", "cancelled"].includes(runStatus)) return "failed";
      return last && last.outcome === "failed" ? "blocked" : "running";
    }
    return g.round.source === "fallback" ? "blocked" : "completed";
  }

  function focusable(el, label, key, onSelect) {
    el.setAttribute("tabindex", "0");
    el.setAttribute("role", "button");
    el.setAttribute("aria-label", label);
    el.setAttribute("data-node", key);
    el.addEventListener("click", (ev) => { ev.stopPropagation(); onSelect(key); });
    el.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); ev.stopPropagation(); onSelect(key); }
    });
    return el;
  }

  /// Draws `trace` into `container` (replacing what was there); `selected` is the key of the
  /// node whose detail is open; `onSelect(key)` is called with `frame`, `step:ID` or
  /// `attempt:ID:N`.
  function draw(container, trace, selected, onSelect) {
    const steps = (trace && trace.steps) || [];
    const edges = (trace && trace.edges) || [];
    const plans = rounds(trace);
    const depth = depths(steps, edges);
    // Planning rounds take the first column; the steps follow.
    const shift = plans.length ? 1 : 0;
    const columns = plans.length ? [[]] : [];
    for (const st of steps) {
      const d = (depth.get(st.step_id) || 0) + shift;
      (columns[d] = columns[d] || []).push(st);
    }
    const pos = new Map();
    const planPos = new Map();
    let height = 0;
    columns.forEach((col, c) => {
      let y = PAD + 22;
      if (c === 0 && shift) {
        for (const g of plans) {
          const h = HEAD + Math.max(1, g.calls.length) * ROW + 8;
          planPos.set(g.key, { x: PAD, y, h });
          y += h + GAP_Y;
        }
      }
      for (const st of col || []) {
        const h = HEAD + Math.max(1, (st.attempts || []).length) * ROW + 8;
        pos.set(st.step_id, { x: PAD + c * (W + GAP_X), y, h });
        y += h + GAP_Y;
      }
      height = Math.max(height, y);
    });
    const width = PAD * 2 + Math.max(1, columns.length) * (W + GAP_X) - GAP_X;
    height = Math.max(height + PAD - GAP_Y, 140);

    const svg = s("svg", {
      class: "dag", width, height, viewBox: `0 0 ${width} ${height}`, role: "group",
      "aria-label": `Execution graph: ${plans.length ? `${plans.length} planning ${plans.length === 1 ? "round" : "rounds"}, ` : ""}${steps.length} steps`,
    });
    svg.append(s("defs", {}, s("marker", {
      id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse",
    }, s("path", { d: "M0 0 10 5 0 10z", class: "arrow" }))));

    const frame = focusable(s("g", { class: "frame-node" }), `Frame root: run ${trace.status || ""}`, "frame", onSelect);
    frame.append(s("rect", { class: "frame", x: 8, y: 8, width: width - 16, height: height - 16, rx: 10 }));
    frame.append(s("text", { class: "frame-label", x: 20, y: 26 }, `frame: root · run ${trace.status || "…"}`));
    if (selected === "frame") frame.setAttribute("aria-pressed", "true");
    svg.append(frame);

    const edge = (a, b, name) => {
      const x1 = a.x + W, y1 = a.y + HEAD / 2, x2 = b.x, y2 = b.y + HEAD / 2;
      const mid = (x1 + x2) / 2;
      svg.append(s("path", {
        class: "edge", d: `M${x1} ${y1} C${mid} ${y1} ${mid} ${y2} ${x2} ${y2}`, "marker-end": "url(#arrow)",
        "data-edge": name,
      }));
    };
    for (const e of edges) {
      const a = pos.get(e.from);
      const b = pos.get(e.to);
      if (a && b) edge(a, b, `${e.from}->${e.to}`);
    }
    // Each planning round points at the steps it planned that wait on nothing.
    const dependent = new Set(edges.filter((e) => pos.has(e.from)).map((e) => e.to));
    for (const g of plans) {
      for (const i of g.steps) {
        const st = steps[i];
        if (st && !dependent.has(st.step_id) && pos.has(st.step_id)) edge(planPos.get(g.key), pos.get(st.step_id), `${g.key}->${st.step_id}`);
      }
    }

    for (const g of plans) {
      const p = planPos.get(g.key);
      const status = roundStatus(g, trace.status);
      const ended = ["completed", "failed", "cancelled", "empty_plan"].includes(trace.status);
      const source = g.round ? g.round.source || "model" : ended ? "no plan" : "planning…";
      const t = totals(g.calls);
      const what = !g.round ? `${g.calls.length} ${g.calls.length === 1 ? "call" : "calls"}`
        : g.round.direct_response ? "direct response" : `${g.round.steps} ${g.round.steps === 1 ? "step" : "steps"}`;
      const gg = s("g", { class: `node plan ${status}`, transform: `translate(${p.x} ${p.y})` });
      const head = focusable(s("g", {}),
        `Planning${plans.length > 1 ? ` round ${g.index}` : ""}: ${source}, ${what}, ${g.calls.length} model ${g.calls.length === 1 ? "call" : "calls"}, ${t.input} input and ${t.output} output tokens, cost ${money(t.cost)}`,
        g.key, onSelect);
      head.append(s("rect", { class: "box", width: W, height: p.h, rx: 8 }));
      head.append(s("text", { class: "title", x: 12, y: 20 }, plans.length > 1 ? `plan · round ${g.index}` : "plan"));
      head.append(s("text", { class: "sub", x: 12, y: 37 }, clip(`${source} · ${what}`, 32)));
      if (selected === g.key) head.setAttribute("aria-pressed", "true");
      gg.append(head);
      if (!g.calls.length) gg.append(s("text", { class: "sub", x: 14, y: HEAD + 16 }, "no model call"));
      g.calls.forEach((c, i) => {
        const row = s("g", { class: `call ${c.outcome || "pending"}`, transform: `translate(10 ${HEAD + i * ROW})` });
        row.append(s("rect", { width: W - 20, height: ROW - 4, rx: 5 }));
        const tokens = c.outcome === "pending" ? "asking…" : `${c.input_tokens}+${c.output_tokens} tok · ${money(c.cost)}`;
        row.append(s("text", { x: 10, y: 15 }, clip(`${c.outcome}${c.replayed ? " ↺" : ""} · ${tokens}`, 30)));
        gg.append(row);
      });
      svg.append(gg);
    }

    for (const st of steps) {
      const p = pos.get(st.step_id);
      const status = st.status || "pending";
      const key = `step:${st.step_id}`;
      const g = s("g", { class: `node ${status}`, transform: `translate(${p.x} ${p.y})` });
      const head = focusable(s("g", {}), `Step ${st.step_id}, tool ${st.tool}, ${status}`, key, onSelect);
      head.append(s("rect", { class: "box", width: W, height: p.h, rx: 8 }));
      head.append(s("text", { class: "title", x: 12, y: 20 }, clip(st.step_id, 24)));
      head.append(s("text", { class: "sub", x: 12, y: 37 }, clip(`${st.tool} · ${status}`, 32)));
      if (selected === key) head.setAttribute("aria-pressed", "true");
      g.append(head);
      const attempts = st.attempts && st.attempts.length ? st.attempts : [];
      if (!attempts.length) {
        g.append(s("text", { class: "sub", x: 14, y: HEAD + 16 }, "not started"));
      }
      attempts.forEach((at, i) => {
        const akey = `attempt:${st.step_id}:${at.attempt}`;
        const outcome = at.outcome || "pending";
        const decision = (at.decision && at.decision.outcome) || lastDecision(st) || "none";
        const ag = focusable(
          s("g", { class: `attempt ${outcome}`, transform: `translate(10 ${HEAD + i * ROW})` }),
          `Attempt ${at.attempt} of ${st.step_id}: ${outcome}, decision ${decision}`, akey, onSelect);
        ag.append(s("rect", { width: W - 20, height: ROW - 4, rx: 5 }));
        ag.append(s("path", { class: `decision ${decision}`, d: "M12 3 20 11 12 19 4 11z" }));
        ag.append(s("text", { x: 28, y: 15 }, clip(`#${at.attempt} ${outcome}${at.decision ? " · " + at.decision.rule_id : ""}`, 28)));
        if (selected === akey) ag.setAttribute("aria-pressed", "true");
        g.append(ag);
      });
      svg.append(g);
    }
    container.replaceChildren(svg);
    const again = selected && svg.querySelector(`[data-node="${CSS.escape(selected)}"]`);
    return again || null;
  }

  /// The outcome of a step's last recorded decision (for an attempt still waiting on one).
  function lastDecision(st) {
    const evs = st.policy_events || [];
    return evs.length ? evs[evs.length - 1].outcome : null;
  }

  window.WardenDag = { draw, depths, rounds, totals, money };
})();
