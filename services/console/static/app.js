// The Warden console. Plain JavaScript, no build step, no inline code (the page's
// Content-Security-Policy allows only this origin's scripts).
//
// The bearer token lives in sessionStorage only (gone when the tab closes) and is sent as
// `Authorization: Bearer` by fetch; nothing is ever put in a cookie or a URL. Live views read
// Server-Sent Events through fetch and a stream reader, since EventSource cannot send headers.
"use strict";

(function () {
  const main = document.getElementById("main");
  const banner = document.getElementById("banner");
  const POLL_MS = 5000;        // the runs list refreshes this often while it is shown
  const RETRY_MS = 3000;       // a broken live stream is opened again after this long
  const FILL_MS = 250;         // an approval's arguments waiting for an outcome are asked again after this long…
  const FILL_TRIES = 40;       // …this many times at most

  // ---- session -----------------------------------------------------------------------------
  const session = {
    get token() { return sessionStorage.getItem("warden.token") || ""; },
    get tenant() { return sessionStorage.getItem("warden.tenant") || ""; },
    set(token, tenant) {
      sessionStorage.setItem("warden.token", token);
      sessionStorage.setItem("warden.tenant", tenant);
    },
    clear() {
      sessionStorage.removeItem("warden.token");
      sessionStorage.removeItem("warden.tenant");
    },
  };

  // ---- DOM helpers -------------------------------------------------------------------------
  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
      else if (k === "class") el.className = v;
      else if (v === true) el.setAttribute(k, "");
      else el.setAttribute(k, String(v));
    }
    append(el, children);
    return el;
  }
  function append(el, children) {
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }
  const badge = (status) => h("span", { class: `badge s-${status}` }, status || "—");
  const json = (v) => h("pre", {}, v === undefined ? "" : JSON.stringify(v, null, 2));
  const time = (ms) => {
    if (!ms) return "—";
    const d = new Date(Number(ms));
    return h("time", { datetime: d.toISOString(), title: d.toISOString() }, d.toLocaleString());
  };
  const facts = (pairs, cls) => h("dl", { class: cls ? `facts ${cls}` : "facts" }, pairs.filter(Boolean).map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  function state(kind, title, text) {
    return h("div", { class: `state ${kind}`, role: kind === "error" ? "alert" : "status" }, h("strong", {}, title), text || "");
  }
  function setBanner(text, warn) {
    banner.hidden = !text;
    banner.className = warn ? "banner warn" : "banner";
    banner.textContent = text || "";
  }

  // ---- the API -----------------------------------------------------------------------------
  class ApiError extends Error {
    constructor(status, code, message, field) {
      super(message);
      this.status = status;
      this.code = code;
      this.field = field;
    }
  }

  async function api(path, opts = {}) {
    const headers = { Authorization: `Bearer ${session.token}`, Accept: "application/json" };
    if (opts.body !== undefined) headers["Content-Type"] = "application/json";
    let res;
    try {
      res = await fetch(path, {
        method: opts.method || "GET",
        headers,
        body: opts.body === undefined ? undefined : JSON.stringify(opts.body),
        cache: "no-store",
        credentials: "omit",
      });
    } catch (e) {
      throw noteFailure(new ApiError(0, "unreachable", "The console cannot be reached.", null));
    }
    if (res.ok) {
      setBanner("");
      return opts.raw ? res : res.json();
    }
    throw noteFailure(await errorOf(res));
  }

  async function errorOf(res) {
    let body = {};
    try { body = await res.json(); } catch (e) { /* not JSON */ }
    const e = body.error || { code: `http_${res.status}`, message: res.statusText || "request failed" };
    return new ApiError(res.status, e.code, e.message, e.field);
  }

  /// Errors that concern the whole session: a refused token signs out, an unreachable mesh
  /// shows a banner until a request succeeds again.
  function noteFailure(err) {
    if (err.status === 401) {
      session.clear();
      signIn("The mesh refused this token. Sign in with another.");
    } else if (err.status === 503 || err.status === 504 || err.status === 0) {
      setBanner(`The mesh is unreachable (${bare(err.message)}). Retrying…`);
    }
    return err;
  }

  /// A message without the API's own "the mesh is unreachable" prefix (the page says it).
  const bare = (message) => String(message || "").replace(/^the mesh is unreachable: /i, "");

  function describe(err) {
    if (err.status === 403) return state("error", "This token may not see this.", err.message);
    if (err.status === 404) return state("error", "Not found.", err.message);
    if (err.status === 503 || err.status === 504 || err.status === 0) return state("error", "The mesh is unreachable.", bare(err.message));
    return state("error", "Something went wrong.", `${err.message}${err.field ? ` (field: ${err.field})` : ""}`);
  }

  /// Server-Sent Events from `path`, read with fetch so the token goes in a header.
  function stream(path, onEvent, onEnd) {
    const ctrl = new AbortController();
    (async () => {
      let res;
      try {
        res = await fetch(path, {
          headers: { Authorization: `Bearer ${session.token}`, Accept: "text/event-stream" },
          cache: "no-store",
          credentials: "omit",
          signal: ctrl.signal,
        });
        if (!res.ok) {
          onEnd(noteFailure(await errorOf(res)));
          return;
        }
        setBanner("");
        const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += value;
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const block = buf.slice(0, cut);
            buf = buf.slice(cut + 2);
            let name = "message";
            const data = [];
            for (const line of block.split("\n")) {
              if (line.startsWith("event:")) name = line.slice(6).trim();
              else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
            }
            if (!data.length) continue;
            let parsed;
            try { parsed = JSON.parse(data.join("\n")); } catch (e) { continue; }
            onEvent(name, parsed);
          }
        }
        onEnd(null);
      } catch (e) {
        if (e.name !== "AbortError") onEnd(noteFailure(new ApiError(0, "unreachable", "The live stream broke.", null)));
      }
    })();
    return () => ctrl.abort();
  }

  const q = (params) => {
    const u = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") u.set(k, v);
    const s = u.toString();
    return s ? `?${s}` : "";
  };
  const enc = encodeURIComponent;

  // ---- routing -----------------------------------------------------------------------------
  let cleanup = () => {};
  function route() {
    const hash = location.hash || "#/runs";
    if (!hash.startsWith("#/")) return; // not a view
    cleanup();
    cleanup = () => {};
    if (!session.token) return signIn("");
    document.getElementById("nav").hidden = false;
    document.getElementById("who").hidden = false;
    document.getElementById("who-tenant").textContent = `tenant ${session.tenant}`;
    // `#/runs/ID?tenant=T`: a run of another tenant than the session's (operators list them all).
    const [path, query] = hash.slice(2).split("?");
    const parts = path.split("/").map(decodeURIComponent);
    const tenant = new URLSearchParams(query || "").get("tenant") || session.tenant;
    for (const a of document.querySelectorAll("nav a")) {
      if (a.dataset.nav === parts[0]) a.setAttribute("aria-current", "page");
      else a.removeAttribute("aria-current");
    }
    main.replaceChildren();
    let view;
    if (parts[0] === "runs" && parts[1] && parts[2] === "receipts") view = receiptsView(parts[1], tenant);
    else if (parts[0] === "runs" && parts[1]) view = runView(parts[1], tenant);
    else if (parts[0] === "approvals") view = approvalsView();
    else if (parts[0] === "capabilities") view = capabilitiesView();
    else view = runsView();
    cleanup = view || (() => {});
  }

  function signIn(message) {
    cleanup();
    cleanup = () => {};
    document.getElementById("nav").hidden = true;
    document.getElementById("who").hidden = true;
    const token = h("input", { id: "token", type: "password", autocomplete: "off", required: true, spellcheck: "false" });
    const tenant = h("input", { id: "tenant", type: "text", value: session.tenant || "default", required: true, spellcheck: "false" });
    const error = h("p", { id: "signin-error", class: "error", role: "alert" }, message || "");
    const button = h("button", { id: "sign-in", type: "submit" }, "Sign in");
    const form = h("form", { "aria-labelledby": "signin-title" },
      h("label", {}, "Bearer token (the same token as the API)", token),
      h("label", {}, "Tenant", tenant),
      button, error,
      h("p", { class: "muted" }, "The token stays in this tab only (session storage) and is sent with each request; the mesh decides what it may see."));
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const t = token.value.trim();
      const tn = tenant.value.trim();
      if (!t || !tn) { error.textContent = "Give a token and a tenant."; return; }
      button.disabled = true;
      error.textContent = "";
      session.set(t, tn);
      try {
        await api(`/api/runs${q({ tenant: tn, page_size: 1 })}`);
        if (!location.hash.startsWith("#/")) location.hash = "#/runs";
        route();
      } catch (e) {
        if (e.status !== 401) {
          session.clear();
          error.textContent = e.status === 403 ? `This token may not act for tenant '${tn}': ${e.message}`
            : [0, 503, 504].includes(e.status) ? `The mesh is unreachable (${bare(e.message)}).` : e.message;
        } else {
          document.getElementById("signin-error").textContent = "The mesh refused this token.";
        }
        button.disabled = false;
      }
    });
    main.replaceChildren(h("section", { class: "panel signin" }, h("h1", { id: "signin-title" }, "Sign in to Warden"), form));
    token.focus();
  }

  // ---- runs --------------------------------------------------------------------------------
  const RUN_STATUSES = ["pending", "active", "paused", "blocked", "requires_reconciliation", "completed", "failed", "cancelled", "empty_plan"];

  function runsView() {
    const filters = { tenant: session.tenant, status: "", agent: "" };
    let tokens = [""]; // page tokens of the pages visited (for "previous")
    const tenant = h("input", { id: "filter-tenant", value: filters.tenant, placeholder: "(all tenants: operators)" });
    const status = h("select", { id: "filter-status" }, h("option", { value: "" }, "any"), RUN_STATUSES.map((s) => h("option", { value: s }, s)));
    const agent = h("input", { id: "filter-agent", placeholder: "any" });
    const body = h("div", {}, state("", "Loading runs…"));
    const pager = h("div", { class: "actions" });
    const form = h("form", { class: "row panel", role: "search" },
      h("label", {}, "Tenant", tenant), h("label", {}, "Status", status), h("label", {}, "Agent", agent),
      h("button", { type: "submit" }, "Filter"));
    form.addEventListener("submit", (ev) => {
      ev.preventDefault();
      Object.assign(filters, { tenant: tenant.value.trim(), status: status.value, agent: agent.value.trim() });
      tokens = [""];
      load();
    });
    main.append(h("h1", {}, "Runs"), form, body, pager, h("p", { class: "muted" }, `Refreshes every ${POLL_MS / 1000} s.`));
    let alive = true;
    async function load() {
      const token = tokens[tokens.length - 1];
      try {
        const page = await api(`/api/runs${q({ ...filters, page_size: 25, page_token: token })}`);
        if (!alive) return;
        body.replaceChildren(runsTable(page.runs, filters));
        pager.replaceChildren(
          tokens.length > 1 ? h("button", { class: "secondary", type: "button", onclick: () => { tokens.pop(); load(); } }, "← Newer") : null,
          page.next_page_token ? h("button", { class: "secondary", type: "button", onclick: () => { tokens.push(page.next_page_token); load(); } }, "Older →") : null);
      } catch (e) {
        if (alive && e.status !== 401) body.replaceChildren(describe(e));
      }
    }
    load();
    const timer = setInterval(() => { if (!document.hidden) load(); }, POLL_MS);
    return () => { alive = false; clearInterval(timer); };
  }

  function runsTable(runs, filters) {
    if (!runs.length) {
      const any = filters.status || filters.agent;
      return state("", any ? "No runs match these filters." : "No runs yet.",
        any ? "Change the filters, or wait: the list refreshes by itself." : "Submit one with `warden run submit --plan …`; it appears here.");
    }
    return h("div", { class: "table-wrap" }, h("table", { id: "runs-table" },
      h("thead", {}, h("tr", {}, h("th", {}, "Run"), h("th", {}, "Status"), h("th", { class: "wide" }, "Tenant"), h("th", { class: "wide" }, "Agent"),
        h("th", {}, "Steps"), h("th", { class: "wide" }, "Created"), h("th", {}, "Updated"))),
      h("tbody", {}, runs.map((r) => h("tr", { "data-run-id": r.run_id },
        h("td", {}, h("a", { href: runLink(r.run_id, r.tenant), class: "mono" }, r.run_id.slice(0, 13) + "…")),
        h("td", {}, badge(r.status), r.reason ? h("div", { class: "muted" }, r.reason.slice(0, 80)) : null),
        h("td", { class: "wide" }, r.tenant),
        h("td", { class: "wide" }, r.agent || h("span", { class: "muted" }, "—")),
        h("td", {}, r.steps ? `${r.steps.completed}/${r.steps.total}` : "—"),
        h("td", { class: "wide" }, time(r.created_at_ms)),
        h("td", {}, time(r.updated_at_ms)))))));
  }

  // ---- one run: status, progress, plan, the DAG, node detail, live events -------------------
  /// `#/runs/ID`, with `?tenant=` when the run is not the session tenant's.
  const runLink = (runId, tenant, tail) =>
    `#/runs/${enc(runId)}${tail || ""}${tenant && tenant !== session.tenant ? `?tenant=${enc(tenant)}` : ""}`;

  function runView(runId, tenant) {
    let data = null;
    let selected = "frame";
    let lastSeq = 0;
    let stop = () => {};
    let alive = true;
    let refreshing = null;
    let again = false;

    const head = h("div", { class: "panel" }, state("", "Loading the run…"));
    const dag = h("div", { class: "dag-wrap", id: "dag" });
    const detail = h("aside", { class: "panel detail", id: "node-detail", "aria-live": "polite" });
    const events = h("ol", { class: "events", id: "live-events" });
    const verifyOut = h("p", { id: "verify-result", role: "status" });
    main.append(
      h("nav", { class: "muted crumbs", "aria-label": "Breadcrumb" }, h("a", { href: "#/runs" }, "Runs"), " / ", h("span", { class: "mono" }, runId)),
      h("h1", {}, "Run ", h("span", { class: "mono break" }, runId)),
      head,
      h("div", { class: "actions" },
        h("button", { id: "verify", type: "button", onclick: () => verifyRun(tenant, runId, verifyOut) }, "Verify this run"),
        h("button", { id: "export", type: "button", class: "secondary", onclick: () => exportRun(tenant, runId, verifyOut) }, "Export"),
        h("a", { href: runLink(runId, tenant, "/receipts") }, "Receipts")),
      verifyOut,
      h("h2", {}, "Execution graph"),
      h("p", { class: "muted" }, "Tab to the frame, a planning round, a step or an attempt and press Enter to open its detail."),
      h("div", { class: "run-layout" }, dag, detail),
      h("h2", {}, "Plan"), h("div", { id: "plan" }),
      h("h2", {}, "Live events"), events);

    function select(key) {
      selected = key;
      redraw(true);
      renderDetail();
    }

    function redraw(keepFocus) {
      if (!data) return;
      // A redraw (live updates) keeps the keyboard where it was: on the node that had focus,
      // not the selected one — a user tabbing through the graph is never moved.
      const active = dag.contains(document.activeElement) ? document.activeElement.getAttribute("data-node") : null;
      const el = window.WardenDag.draw(dag, data.trace || {}, selected, select);
      const same = active && dag.querySelector(`[data-node="${CSS.escape(active)}"]`);
      if (same) same.focus();
      else if (el && (active || keepFocus)) el.focus();
    }

    function renderDetail() {
      if (!data) return;
      detail.replaceChildren(nodeDetail(data, selected));
    }

    function renderHead() {
      const r = data.run;
      const p = data.progress || {};
      // A goal run's goal, as recorded by its `run_submitted` (redacted at submission).
      const goal = (data.ledger && data.ledger.goal) || "";
      head.replaceChildren(facts([
        ["Status", h("span", { id: "run-status" }, badge(r.status))],
        r.reason ? ["Reason", r.reason] : null,
        (r.waiting_for || []).length ? ["Waiting for", h("span", { id: "run-waiting" }, `${r.waiting_for.join(", ")} (an outage, within the outage grace)`)] : null,
        ["Tenant", r.tenant],
        ["Agent", r.agent || "—"],
        goal ? ["Goal", h("span", { id: "run-goal", class: "break" }, goal)] : null,
        ["Progress", h("span", {}, h("progress", { max: 100, value: p.percent || 0, "aria-label": "progress" }), ` ${p.percent || 0}%`,
          p.current_stage ? ` · now: ${p.current_stage}` : "")],
        ["Created", time(r.created_at_ms)],
        ["Updated", time(r.updated_at_ms)],
        ["Events", String(r.last_seq)],
        r.direct_response ? ["Direct response", r.direct_response] : null,
      ], "summary"));
      document.getElementById("plan").replaceChildren(json(data.plan));
    }

    async function refresh() {
      if (refreshing) { again = true; return refreshing; }
      refreshing = (async () => {
        try {
          const d = await api(`/api/runs/${enc(runId)}${q({ tenant })}`);
          if (!alive) return;
          data = d;
          renderHead();
          redraw(false);
          renderDetail();
        } catch (e) {
          if (alive && e.status !== 401 && !data) head.replaceChildren(describe(e));
        }
      })();
      await refreshing;
      refreshing = null;
      if (again && alive) { again = false; refresh(); }
    }

    function follow() {
      stop = stream(`/api/runs/${enc(runId)}/events${q({ tenant, since_seq: lastSeq })}`, (name, ev) => {
        if (name === "ledger") {
          lastSeq = Math.max(lastSeq, ev.seq);
          events.prepend(h("li", {}, time(ev.timestamp_ms), ` #${ev.seq} `, h("strong", {}, ev.event_type), ev.step_id ? ` · ${ev.step_id}` : ""));
          while (events.children.length > 50) events.lastChild.remove();
          refresh();
        } else if (name === "error") {
          setBanner(`Live updates stopped: ${ev.message}`, true);
        }
      }, (err) => {
        if (!alive) return;
        refresh();
        // The stream ends when the run ends; a broken one (mesh restarting) is opened again.
        const ended = data && ["completed", "failed", "cancelled", "empty_plan"].includes(data.run.status);
        if (err && err.status !== 401 && err.status !== 403 && err.status !== 404) setTimeout(() => { if (alive) follow(); }, RETRY_MS);
        else if (!err && !ended) setTimeout(() => { if (alive) follow(); }, RETRY_MS);
      });
    }

    refresh().then(() => { if (alive) follow(); });
    return () => { alive = false; stop(); };
  }

  function nodeDetail(data, key) {
    const trace = data.trace || {};
    if (!key || key === "frame") {
      const calls = trace.llm_calls || [];
      const t = window.WardenDag.totals(calls);
      return h("div", {}, h("h2", {}, "Frame: root"),
        facts([["Run status", badge(trace.status)], ["Reason", trace.reason || "—"], ["Started", time(trace.started_at_ms)],
          ["Ended", time(trace.ended_at_ms)], ["Steps", String((trace.steps || []).length)],
          calls.length ? ["Model calls", `${calls.length} · ${t.input} in · ${t.output} out tokens · cost ${window.WardenDag.money(t.cost)}`] : null]),
        h("h3", {}, "Run events"), h("ol", { class: "events" }, (trace.run_events || []).map((e) => h("li", {}, `#${e.seq} ${e.event_type} `, time(e.timestamp_ms)))));
    }
    const [kind, stepId, n] = key.split(":");
    if (kind === "plan") return planDetail(data, key);
    const st = (trace.steps || []).find((x) => x.step_id === stepId);
    if (!st) return state("", "This node is not in the trace yet.");
    const args = (data.args || {})[stepId] || {};
    if (kind === "step") {
      return h("div", {}, h("h2", {}, `Step ${st.step_id}`),
        facts([["Tool", h("code", {}, st.tool)], ["Status", badge(st.status)], ["Attempts", String((st.attempts || []).length)]]),
        h("h3", {}, "Arguments"),
        args.args !== undefined && args.args !== null ? [json(args.args), h("p", { class: "muted break" }, `sha256 ${args.args_sha256}`)]
          : h("p", { class: "muted" }, args.note || "Not resolvable yet."),
        h("h3", {}, "Plan parameters"), json(st.input_params),
        h("h3", {}, "Decisions"), decisionsList(st.policy_events || []),
        (st.approval_events || []).length ? [h("h3", {}, "Approval"), json(st.approval_events)] : null);
    }
    const at = (st.attempts || []).find((a) => String(a.attempt) === n);
    if (!at) return state("", "This attempt is not recorded yet.");
    const receipt = (data.receipts || []).find((r) => r.step_id === stepId && String(r.attempt) === n);
    const d = at.decision;
    return h("div", {}, h("h2", {}, `Attempt ${at.attempt} of ${st.step_id}`),
      facts([["Outcome", badge(at.outcome)], ["Requested", time(at.requested_at_ms)], ["Ended", time(at.ended_at_ms)],
        at.error ? ["Error", at.error] : null, at.reconciled_by ? ["Reconciled by", at.reconciled_by] : null]),
      h("h3", {}, "Decision"),
      d ? facts([["Outcome", badge(d.outcome)], ["Rule", h("code", {}, d.rule_id)], ["Reason", d.reason], ["Decision id", h("span", { class: "mono break" }, d.decision_id)], ["Ledger seq", String(d.seq)]])
        : h("p", { class: "muted" }, "No decision recorded for this attempt yet."),
      h("h3", {}, "Arguments"),
      args.args !== undefined && args.args !== null ? json(args.args) : h("p", { class: "muted" }, args.note || "—"),
      h("h3", {}, "Output"), at.output !== undefined ? json(at.output) : h("p", { class: "muted" }, "No output."),
      at.retry ? [h("h3", {}, "Retry"), json(at.retry)] : null,
      h("h3", {}, "Receipt"),
      receipt ? facts([["Receipt", h("span", { class: "mono break" }, receipt.receipt_id)], ["Status", badge(receipt.status)],
        ["Action", receipt.action_type], ["Capability", receipt.capability_id || "—"], ["Seq", String(receipt.seq)],
        ["Hash", h("span", { class: "mono break" }, receipt.hash)]])
        : h("p", { class: "muted" }, "No receipt yet (one is written when the call ends)."));
  }

  /// A planning round of a goal run (`plan:N`): where its plan came from and every model call
  /// it made, with tokens, cost, latency, the answer's validation error and its replays.
  function planDetail(data, key) {
    const trace = data.trace || {};
    const dag = window.WardenDag;
    const groups = dag.rounds(trace);
    const g = groups.find((x) => x.key === key);
    if (!g) return state("", "This planning round is not in the trace yet.");
    const r = g.round;
    const t = dag.totals(g.calls);
    const planned = g.steps.map((i) => (trace.steps || [])[i]).filter(Boolean).map((st) => st.step_id);
    return h("div", {}, h("h2", {}, groups.length > 1 ? `Planning round ${g.index}` : "Planning"),
      r ? facts([
        ["Source", h("span", { class: `badge src-${r.source}` }, r.source || "—")],
        ["Plan", r.direct_response ? "a direct response, no steps" : `${r.steps} ${r.steps === 1 ? "step" : "steps"}${planned.length ? `: ${planned.join(", ")}` : ""}`],
        r.reason ? ["Reason", r.reason] : null,
        ["Ledger seq", String(r.seq)],
      ]) : facts([["Source", ["completed", "failed", "cancelled", "empty_plan"].includes(trace.status)
        ? h("span", { class: "badge s-failed" }, "no plan recorded") : h("span", { class: "badge s-running" }, "planning…")],
        ["Run status", badge(trace.status)], trace.reason ? ["Reason", trace.reason] : null]),
      h("h3", {}, "Model calls"),
      g.calls.length ? [
        h("p", { class: "muted", id: "plan-totals" }, `${g.calls.length} ${g.calls.length === 1 ? "call" : "calls"} · ${t.input} in · ${t.output} out tokens · cost ${dag.money(t.cost)}`),
        h("ol", { class: "calls" }, g.calls.map((c) => h("li", { class: "call", "data-call-seq": c.seq },
          facts([
            ["Call", h("code", { class: "break" }, c.step_key)],
            ["Model", `${c.provider} / ${c.model}`],
            ["Outcome", badge(c.outcome)],
            ["Tokens", c.outcome === "pending" ? "—" : `${c.input_tokens} in · ${c.output_tokens} out`],
            ["Cost", c.outcome === "pending" ? "—" : dag.money(c.cost)],
            ["Latency", c.outcome === "pending" ? "—" : `${c.latency_ms} ms`],
            c.validation_error ? ["Validation error", h("span", { class: "error" }, c.validation_error)] : null,
            c.error ? ["Error", h("span", { class: "error" }, c.error)] : null,
            ["Replayed", c.replayed ? `${c.replayed} ${c.replayed === 1 ? "time" : "times"}${c.replayed_with_drift ? ", with drift" : ""}` : "never"],
            ["Ledger seq", String(c.seq)],
          ]))))]
        : h("p", { class: "muted" }, r && r.source === "replay" ? "Answered from the record: no model was asked."
          : "No model call was recorded for this round."));
  }

  function decisionsList(evs) {
    if (!evs.length) return h("p", { class: "muted" }, "None yet.");
    return h("ul", {}, evs.map((d) => h("li", {}, badge(d.outcome), " ", h("code", {}, d.rule_id), ` — ${d.reason}`)));
  }

  async function verifyRun(tenant, runId, out) {
    out.replaceChildren("Verifying…");
    try {
      const v = await api(`/api/runs/${enc(runId)}/verify${q({ tenant })}`);
      out.replaceChildren(v.valid
        ? h("span", { class: "badge s-valid" }, `valid — ${v.events} events, head ${String(v.head_hash).slice(0, 16)}…`)
        : h("span", { class: "badge s-invalid" }, `invalid — first bad seq ${v.first_bad_seq}: ${v.reason}`));
    } catch (e) {
      out.replaceChildren(h("span", { class: "error" }, `Not verified: ${e.message}`));
    }
  }

  async function exportRun(tenant, runId, out) {
    try {
      const res = await api(`/api/runs/${enc(runId)}/export${q({ tenant })}`, { raw: true });
      const blob = await res.blob();
      const url = URL.createObjectURL(blob);
      const a = h("a", { href: url, download: `run-${runId}.jsonl` });
      document.body.append(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
      out.replaceChildren(`Exported run-${runId}.jsonl — check it offline with \`warden ledger verify-file\`.`);
    } catch (e) {
      out.replaceChildren(h("span", { class: "error" }, `Not exported: ${e.message}`));
    }
  }

  // ---- receipts ----------------------------------------------------------------------------
  function receiptsView(runId, tenant) {
    const out = h("p", { id: "verify-result", role: "status" });
    const body = h("div", {}, state("", "Loading receipts…"));
    main.append(
      h("nav", { class: "muted crumbs", "aria-label": "Breadcrumb" }, h("a", { href: "#/runs" }, "Runs"), " / ",
        h("a", { href: runLink(runId, tenant), class: "mono" }, runId), " / receipts"),
      h("h1", {}, "Receipts"),
      h("div", { class: "actions" },
        h("button", { id: "verify", type: "button", onclick: () => verifyRun(tenant, runId, out) }, "Verify this run"),
        h("button", { id: "export", type: "button", class: "secondary", onclick: () => exportRun(tenant, runId, out) }, "Export")),
      out, body);
    (async () => {
      try {
        const page = await api(`/api/runs/${enc(runId)}/receipts${q({ tenant })}`);
        body.replaceChildren(!page.receipts.length ? state("", "No receipts yet.", "One is written for each tool call outcome.")
          : h("div", { class: "table-wrap" }, h("table", { id: "receipts-table" },
            h("thead", {}, h("tr", {}, h("th", {}, "Seq"), h("th", {}, "Step"), h("th", {}, "Attempt"), h("th", {}, "Status"),
              h("th", { class: "wide" }, "Action"), h("th", { class: "wide" }, "Decision"), h("th", {}, "Time"), h("th", { class: "wide" }, "Hash"))),
            h("tbody", {}, page.receipts.map((r) => h("tr", {},
              h("td", {}, String(r.seq)), h("td", {}, r.step_id), h("td", {}, String(r.attempt)), h("td", {}, badge(r.status)),
              h("td", { class: "wide" }, r.action_type), h("td", { class: "wide mono" }, String(r.policy_decision).slice(0, 18)),
              h("td", {}, time(r.timestamp_ms)), h("td", { class: "wide mono" }, String(r.hash).slice(0, 16) + "…")))))));
      } catch (e) {
        if (e.status !== 401) body.replaceChildren(describe(e));
      }
    })();
  }

  // ---- the approval inbox ------------------------------------------------------------------
  function approvalsView() {
    const tenant = session.tenant;
    const approvals = new Map();
    let show = "pending";
    let alive = true;
    let stop = () => {};
    const list = h("div", { class: "cards", id: "approvals" }, state("", "Loading approvals…"));
    const filter = h("select", { id: "approval-filter" }, ["pending", "all"].map((s) => h("option", { value: s }, s)));
    filter.addEventListener("change", () => { show = filter.value; render(); });
    const live = h("p", { class: "muted", id: "inbox-live" }, "Connecting…");
    main.append(h("h1", {}, "Approval inbox"), h("div", { class: "row" }, h("label", {}, "Show", filter), live), list);

    function render() {
      const items = [...approvals.values()].filter((a) => show === "all" || a.state === "pending")
        .sort((a, b) => b.created_at_ms - a.created_at_ms);
      if (!items.length) {
        list.replaceChildren(state("", show === "pending" ? "No approvals are waiting." : "No approvals yet.",
          "Calls that need a person appear here as soon as they are asked."));
        return;
      }
      // Keep cards a person is typing in: only add, replace changed ones and drop gone ones.
      const keep = new Set(items.map((a) => a.approval_id));
      for (const card of [...list.children]) if (!keep.has(card.dataset.approvalId)) card.remove();
      let prev = null;
      for (const a of items) {
        let card = list.querySelector(`[data-approval-id="${CSS.escape(a.approval_id)}"]`);
        const version = `${a.state}|${a.bound ? (a.bound.args ? "args" : a.bound.note || "") : ""}|${a.approver}`;
        if (!card || card.dataset.version !== version) {
          const fresh = approvalCard(a, version);
          if (card) {
            // A reason being typed survives the redraw, and so does the keyboard focus.
            const typed = card.querySelector("textarea.reason");
            const kept = fresh.querySelector("textarea.reason");
            const focused = card.contains(document.activeElement);
            if (typed && kept) kept.value = typed.value;
            card.replaceWith(fresh);
            if (focused && kept) kept.focus();
          } else {
            list.append(fresh);
          }
          card = fresh;
        }
        if (prev ? prev.nextSibling !== card : list.firstChild !== card) {
          if (prev) prev.after(card); else list.prepend(card);
        }
        prev = card;
      }
    }

    function approvalCard(a, version) {
      const reason = h("textarea", { class: "reason", id: `reason-${a.approval_id}`, "aria-label": `Reason for ${a.approval_id}` });
      const approver = h("input", { class: "approver", placeholder: "your token's person", "aria-label": "Resolve as (operators only)" });
      const msg = h("p", { class: "error", role: "alert" });
      const act = async (verb, btn) => {
        msg.textContent = "";
        btn.disabled = true;
        try {
          const done = await api(`/api/approvals/${enc(a.approval_id)}/${verb}`, {
            method: "POST", body: { tenant, reason: reason.value, approver: approver.value.trim() || undefined },
          });
          approvals.set(done.approval_id, { ...a, ...done });
          render();
        } catch (e) {
          msg.textContent = `${e.message}${e.field ? ` (${e.field})` : ""}`;
          btn.disabled = false;
          if (e.field === "reason") reason.focus();
        }
      };
      const pending = a.state === "pending";
      const bound = a.bound || {};
      const approve = h("button", { type: "button", class: "approve" }, "Approve");
      const deny = h("button", { type: "button", class: "deny danger" }, "Deny");
      approve.addEventListener("click", () => act("approve", approve));
      deny.addEventListener("click", () => act("deny", deny));
      return h("article", { class: `card ${a.state}`, "data-approval-id": a.approval_id, "data-version": version, "aria-labelledby": `t-${a.approval_id}` },
        h("header", {}, h("h2", { id: `t-${a.approval_id}` }, h("code", {}, a.tool), ` in step ${a.step_id}`), badge(a.state),
          h("a", { href: `#/runs/${enc(a.run_id)}`, class: "mono" }, `run ${a.run_id.slice(0, 13)}…`)),
        facts([
          ["Arguments", pending ? (bound.args ? [json(bound.args), bound.digest_matches ? h("span", { class: "badge s-ok" }, "✓ these arguments hash to the digest") : null]
            : h("span", { class: "muted" }, bound.note || "Loading…")) : h("span", { class: "muted" }, "resolved")],
          ["Digest", h("span", { class: "mono break" }, `sha256 ${a.args_sha256}`)],
          ["May approve", (a.approvers || []).length ? a.approvers.join(", ") : "any tenant token or operator"],
          ["Asked", time(a.created_at_ms)],
          pending ? ["Expires", time(a.expires_at_ms)] : ["Resolved by", `${a.approver || "—"}${a.reason ? ` — ${a.reason}` : ""}`],
          ["Approval", h("span", { class: "mono" }, a.approval_id)],
        ]),
        pending ? [h("label", {}, "Reason (recorded with the decision)", reason),
          h("details", {}, h("summary", {}, "Operator: resolve as someone"), approver),
          h("div", { class: "actions" }, approve, deny), msg] : null);
    }

    // A call is decided a moment before the outcome it is built from is recorded: while the
    // view says it is waiting for that, ask again (a few times, then the digest alone stays).
    async function fill(a, tries = 0) {
      try {
        const full = await api(`/api/approvals/${enc(a.approval_id)}${q({ tenant })}`);
        if (!alive) return;
        const now = approvals.get(a.approval_id);
        if (now && now.state === "pending") approvals.set(a.approval_id, { ...now, bound: full.bound });
        render();
        if (full.bound && full.bound.waiting && full.state === "pending" && tries < FILL_TRIES) {
          setTimeout(() => { if (alive) fill(a, tries + 1); }, FILL_MS);
        }
      } catch (e) {
        // A failed ask (the mesh busy, a blip) is tried again within the same budget; the
        // card shows the digest meanwhile.
        const refused = e && (e.status === 401 || e.status === 403);
        if (alive && !refused && tries < FILL_TRIES) setTimeout(() => { if (alive) fill(a, tries + 1); }, FILL_MS);
      }
    }

    function watch() {
      stop = stream(`/api/approvals/watch${q({ tenant })}`, (name, a) => {
        if (name === "approval") {
          const had = approvals.get(a.approval_id);
          approvals.set(a.approval_id, { ...a, bound: had && had.bound });
          if (a.state === "pending" && !(had && had.bound)) fill(a);
          live.textContent = "Live: updates as approvals are asked and resolved.";
          render();
        } else if (name === "error") {
          live.textContent = `Live updates stopped: ${a.message}`;
        }
      }, (err) => {
        if (!alive) return;
        if (err && (err.status === 401 || err.status === 403)) { list.replaceChildren(describe(err)); return; }
        live.textContent = "Reconnecting…";
        setTimeout(() => { if (alive) watch(); }, RETRY_MS);
      });
    }

    (async () => {
      try {
        const page = await api(`/api/approvals${q({ tenant, state: "pending", page_size: 200 })}`);
        for (const a of page.approvals) approvals.set(a.approval_id, a);
        render();
        // Listed while the outcome its arguments are built from was still being recorded: the
        // live stream will not fill it (it is known already), so it is asked again from here.
        for (const a of page.approvals) {
          if (a.state === "pending" && a.bound && a.bound.waiting) fill(a);
        }
      } catch (e) {
        if (e.status !== 401) list.replaceChildren(describe(e));
      }
      if (alive) watch();
    })();
    return () => { alive = false; stop(); };
  }

  // ---- capabilities ------------------------------------------------------------------------
  function capabilitiesView() {
    const tenant = session.tenant;
    const body = h("div", {}, state("", "Loading capabilities…"));
    const issued = h("div", { id: "issued", role: "status" });
    const split = (s) => s.split(",").map((x) => x.trim()).filter(Boolean);
    const tools = h("input", { id: "cap-tools", placeholder: "kv.*, echo", required: true });
    const actions = h("input", { id: "cap-actions", placeholder: "optional" });
    const resources = h("input", { id: "cap-resources", placeholder: "optional, e.g. docs/*" });
    const ttl = h("input", { id: "cap-ttl", type: "number", min: 1, value: 3600 });
    const run = h("input", { id: "cap-run", placeholder: "optional run id" });
    const msg = h("p", { class: "error", role: "alert" });
    const form = h("form", { class: "panel" }, h("h2", {}, "Issue a capability"),
      h("p", { class: "muted" }, "Within your token's authority: the mesh refuses scopes you may not delegate."),
      h("div", { class: "row" }, h("label", {}, "Tool patterns", tools), h("label", {}, "Action patterns", actions),
        h("label", {}, "Resource patterns", resources), h("label", {}, "Lifetime (s)", ttl), h("label", {}, "Bound to run", run),
        h("button", { type: "submit" }, "Issue")), msg, issued);
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      msg.textContent = "";
      try {
        const cap = await api("/api/capabilities", { method: "POST", body: {
          tenant, tool_patterns: split(tools.value), action_patterns: split(actions.value),
          resource_patterns: split(resources.value), ttl_seconds: Number(ttl.value), run_id: run.value.trim() || undefined,
        } });
        issued.replaceChildren(h("div", { class: "handle" }, h("strong", {}, "Handle (shown once — keep it now): "),
          h("code", { class: "break", id: "cap-handle" }, cap.handle)));
        load();
      } catch (e) {
        msg.textContent = `${e.message}${e.field ? ` (${e.field})` : ""}`;
      }
    });
    main.append(h("h1", {}, "Capabilities"), form, body);
    let alive = true;
    async function load() {
      try {
        const page = await api(`/api/capabilities${q({ tenant, page_size: 200 })}`);
        if (alive) body.replaceChildren(capsTable(page.capabilities, load));
      } catch (e) {
        if (alive && e.status !== 401) body.replaceChildren(describe(e));
      }
    }
    load();
    return () => { alive = false; };
  }

  function capsTable(caps, reload) {
    if (!caps.length) return state("", "No capabilities.", "Issue one above; it is listed here by its public id (never its handle).");
    return h("div", { class: "table-wrap" }, h("table", { id: "caps-table" },
      h("thead", {}, h("tr", {}, h("th", {}, "Capability"), h("th", {}, "Tools"), h("th", { class: "wide" }, "Actions / resources"),
        h("th", {}, "Expires"), h("th", {}, "State"), h("th", {}, ""))),
      h("tbody", {}, caps.map((c) => {
        const reason = h("input", { "aria-label": `Reason to revoke ${c.capability_id}`, placeholder: "reason" });
        const msg = h("span", { class: "error", role: "alert" });
        const revoke = h("button", { type: "button", class: "danger" }, "Revoke");
        revoke.addEventListener("click", async () => {
          revoke.disabled = true;
          try {
            await api(`/api/capabilities/${enc(c.capability_id)}/revoke`, { method: "POST", body: { tenant: c.tenant, reason: reason.value } });
            reload();
          } catch (e) { msg.textContent = e.message; revoke.disabled = false; }
        });
        return h("tr", { "data-capability-id": c.capability_id },
          h("td", { class: "mono break" }, c.capability_id, c.run_id ? h("div", { class: "muted" }, `run ${c.run_id}`) : null),
          h("td", {}, c.tool_patterns.join(", ")),
          h("td", { class: "wide" }, [...c.action_patterns, ...c.resource_patterns].join(", ") || "—"),
          h("td", {}, time(c.expires_at_ms)),
          h("td", {}, c.revoked ? [badge("revoked"), c.revoke_reason ? h("div", { class: "muted" }, c.revoke_reason) : null]
            : c.expires_at_ms < Date.now() ? badge("expired") : badge("active")),
          h("td", {}, c.revoked ? null : h("div", { class: "actions" }, reason, revoke, msg)));
      }))));
  }

  // ---- start -------------------------------------------------------------------------------
  document.getElementById("skip").addEventListener("click", (ev) => { ev.preventDefault(); main.focus(); });
  document.getElementById("sign-out").addEventListener("click", () => {
    session.clear();
    setBanner("");
    signIn("Signed out.");
  });
  document.getElementById("zone").textContent =
    `Times in your zone (${Intl.DateTimeFormat().resolvedOptions().timeZone || "local"}).`;
  window.addEventListener("hashchange", route);
  route();
})();
