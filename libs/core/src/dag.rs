//! A run's execution DAG (seed 001 "Execution Trace"), derived from its [`RunTrace`]: frame
//! nodes, planner attempts, step nodes, branch nodes, attempt (plugin execution) nodes and
//! result/failure nodes, with edges for parentage, dependencies, backtracking, retries and the
//! results attempts produced. Labels name what ran (a tool, a step id), never dynamic text;
//! inputs and outputs are in each node's `detail`, outputs by reference (their SHA-256, read
//! with `Runs.GetStepOutput`).
//!
//! A run is its root frame; a sub-goal step opens a child frame (a run of its own: its node
//! names the run, whose own DAG details it). A step's alternatives are branches inside its
//! frame. Nothing is ever erased: a failed branch, a retried attempt and a replaced step keep
//! their nodes.

use serde::Serialize;
use serde_json::{Value, json};

use crate::canonical::{canonical_json, sha256_hex};
use crate::trace::{Attempt, RunTrace, StepNode};

/// The id of a run's root frame.
pub const ROOT_FRAME: &str = "frame:root";

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Dag {
    pub run_id: String,
    pub root_frame: String,
    /// The run's status (the root frame's).
    pub status: String,
    pub nodes: Vec<Node>,
    pub edges: Vec<DagEdge>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Node {
    pub id: String,
    /// `frame`, `planner_attempt`, `step`, `branch`, `attempt`, `result` or `failure`.
    pub kind: &'static str,
    /// What ran or what the node is (a tool, a step id, a frame's purpose kind).
    pub label: String,
    /// The frame the node belongs to (a frame: itself).
    pub frame_id: String,
    /// A frame's parent frame (`None` for the root and for other nodes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_frame_id: Option<String>,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<i64>,
    /// Inputs and outputs (outputs by reference), decisions, errors.
    pub detail: Value,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DagEdge {
    pub from: String,
    pub to: String,
    /// `contains` (frame → its nodes), `opens` (sub-goal step → its child frame), `planned`
    /// (planner attempt → step), `depends_on`,
    /// `replanned_as`, `tries` (step → its first branch), `backtracked_to` (branch → next
    /// branch), `executes` (branch → attempt), `retried_as` (attempt → next attempt of the
    /// branch), `produced` (attempt → result or failure).
    pub kind: &'static str,
}

fn span(from: Option<i64>, to: Option<i64>) -> Option<i64> {
    Some(to? - from?).filter(|d| *d >= 0)
}

/// An output as the DAG shows it: by reference, never inline.
fn output_ref(a: &Attempt, step_id: &str) -> Value {
    match (&a.output_ref, &a.output) {
        (Some(r), _) => {
            json!({"sha256": r.get("sha256"), "bytes": r.get("bytes"), "read_with": format!("GetStepOutput {step_id}")})
        }
        (None, Some(out)) => {
            let text = canonical_json(out);
            json!({"sha256": sha256_hex(text.as_bytes()), "bytes": text.len(), "read_with": format!("GetStepOutput {step_id}")})
        }
        (None, None) => Value::Null,
    }
}

fn step_id_of(n: &StepNode) -> &str {
    &n.step_id
}

/// The DAG of `trace`; `purpose` is what the root frame is for (the goal, or "the submitted
/// plan").
pub fn of(trace: &RunTrace, purpose: &str) -> Dag {
    let mut nodes = Vec::new();
    let mut edges = Vec::new();
    let edge = |from: &str, to: &str, kind: &'static str| DagEdge { from: from.into(), to: to.into(), kind };
    nodes.push(Node {
        id: ROOT_FRAME.into(),
        kind: "frame",
        label: "root".into(),
        frame_id: ROOT_FRAME.into(),
        parent_frame_id: None,
        status: trace.status.clone(),
        duration_ms: span(trace.started_at_ms, trace.ended_at_ms),
        detail: json!({"purpose": purpose, "depth": 0, "reason": trace.reason}),
    });
    for round in &trace.plan_rounds {
        let n = round.get("round").and_then(Value::as_u64).unwrap_or_default();
        let id = format!("planner:{n}");
        nodes.push(Node {
            id: id.clone(),
            kind: "planner_attempt",
            label: format!("plan round {n}"),
            frame_id: ROOT_FRAME.into(),
            parent_frame_id: None,
            status: "ok".into(),
            duration_ms: None,
            detail: round.clone(),
        });
        edges.push(edge(ROOT_FRAME, &id, "contains"));
    }
    for s in &trace.steps {
        let sid = step_id_of(s);
        let step = format!("step:{sid}");
        nodes.push(Node {
            id: step.clone(),
            kind: "step",
            label: sid.to_string(),
            frame_id: ROOT_FRAME.into(),
            parent_frame_id: None,
            status: s.status.clone(),
            duration_ms: span(
                s.attempts.iter().find_map(|a| a.requested_at_ms),
                s.attempts.iter().rev().find_map(|a| a.ended_at_ms),
            ),
            detail: json!({"tool": s.tool, "params": s.input_params, "round": s.round,
                           "policy_events": s.policy_events.len(), "approval_events": s.approval_events}),
        });
        edges.push(edge(ROOT_FRAME, &step, "contains"));
        if trace.plan_rounds.iter().any(|r| r.get("round").and_then(Value::as_u64) == Some(s.round as u64)) {
            edges.push(edge(&format!("planner:{}", s.round), &step, "planned"));
        }
        // A sub-goal step opens a child frame (a run of its own, with a DAG of its own).
        if let Some(f) = &s.frame {
            let child = f.get("child_run_id").and_then(Value::as_str).unwrap_or_default();
            let id = format!("frame:{child}");
            let at = |k: &str| f.get(k).and_then(Value::as_i64);
            nodes.push(Node {
                id: id.clone(),
                kind: "frame",
                label: child.to_string(),
                frame_id: id.clone(),
                parent_frame_id: Some(ROOT_FRAME.into()),
                status: f.get("status").and_then(Value::as_str).unwrap_or("running").to_string(),
                duration_ms: span(at("opened_at_ms"), at("closed_at_ms")),
                detail: json!({"purpose": f.get("subgoal"), "depth": f.get("depth"), "run_id": child,
                               "reason": f.get("reason"), "read_with": format!("GetTrace {child}")}),
            });
            edges.push(edge(&step, &id, "opens"));
            continue;
        }
        // Branches: the step's own call, then each alternative it moved to.
        let mut branches: Vec<(u32, String, Value)> = vec![(0, s.tool.clone(), json!({"params": s.input_params}))];
        for b in &s.branches {
            let n = b.get("branch").and_then(Value::as_u64).unwrap_or_default() as u32;
            let tool = b.get("tool").and_then(Value::as_str).unwrap_or_default().to_string();
            branches.push((n, tool, json!({"after": b.get("after"), "failed_kind": b.get("failed_kind")})));
        }
        let last_branch = branches.len() - 1;
        for (i, (n, tool, detail)) in branches.iter().enumerate() {
            let id = format!("branch:{sid}:{n}");
            let attempts: Vec<&Attempt> = s.attempts.iter().filter(|a| a.branch == *n).collect();
            let status = match attempts.last() {
                _ if i < last_branch => "failed".to_string(),
                Some(a) if a.outcome == "ok" => "succeeded".into(),
                Some(_) | None => s.status.clone(),
            };
            nodes.push(Node {
                id: id.clone(),
                kind: "branch",
                label: tool.clone(),
                frame_id: ROOT_FRAME.into(),
                parent_frame_id: None,
                status,
                duration_ms: span(
                    attempts.iter().find_map(|a| a.requested_at_ms),
                    attempts.iter().rev().find_map(|a| a.ended_at_ms),
                ),
                detail: json!({"branch": n, "detail": detail}),
            });
            match i {
                0 => edges.push(edge(&step, &id, "tries")),
                _ => edges.push(edge(&format!("branch:{sid}:{}", branches[i - 1].0), &id, "backtracked_to")),
            }
            let mut previous: Option<String> = None;
            for a in attempts {
                let aid = format!("attempt:{sid}:{}", a.attempt);
                let mut detail = json!({"attempt": a.attempt, "decision": a.decision, "error": a.error,
                                        "retry": a.retry, "output": output_ref(a, sid)});
                if let Some(why) = &a.sanitized {
                    detail["sanitized"] = why.clone();
                }
                nodes.push(Node {
                    id: aid.clone(),
                    kind: "attempt",
                    label: if a.tool.is_empty() { tool.clone() } else { a.tool.clone() },
                    frame_id: ROOT_FRAME.into(),
                    parent_frame_id: None,
                    status: a.outcome.clone(),
                    duration_ms: span(a.requested_at_ms, a.ended_at_ms),
                    detail,
                });
                edges.push(edge(&id, &aid, "executes"));
                if let Some(p) = previous.replace(aid) {
                    edges.push(edge(&p, previous.as_deref().unwrap_or_default(), "retried_as"));
                }
            }
        }
        // What the step came to, produced by its last attempt.
        let outcome = match s.status.as_str() {
            "completed" => Some(("result", "completed")),
            "failed" | "denied" | "cancelled" => Some(("failure", s.status.as_str())),
            _ => None,
        };
        if let Some((kind, status)) = outcome {
            let id = format!("{kind}:{sid}");
            let last = s.attempts.last();
            let detail = match (kind, last) {
                ("result", Some(a)) => json!({"output": output_ref(a, sid), "sanitized": a.sanitized}),
                (_, a) => json!({"error": a.and_then(|a| a.error.clone())}),
            };
            nodes.push(Node {
                id: id.clone(),
                kind,
                label: sid.to_string(),
                frame_id: ROOT_FRAME.into(),
                parent_frame_id: None,
                status: status.into(),
                duration_ms: None,
                detail,
            });
            match last {
                Some(a) => edges.push(edge(&format!("attempt:{sid}:{}", a.attempt), &id, "produced")),
                None => edges.push(edge(&step, &id, "produced")),
            }
        }
    }
    for e in &trace.edges {
        edges.push(edge(&format!("step:{}", e.from), &format!("step:{}", e.to), e.kind));
    }
    Dag { run_id: trace.run_id.clone(), root_frame: ROOT_FRAME.into(), status: trace.status.clone(), nodes, edges }
}

impl Dag {
    /// The child frames this DAG opens and does not hold yet: `(frame node id, child run id)`.
    pub fn open_frames(&self) -> Vec<(String, String)> {
        self.nodes
            .iter()
            .filter(|n| n.kind == "frame" && n.id != self.root_frame)
            .filter(|n| !self.nodes.iter().any(|m| m.frame_id == n.id && m.id != n.id))
            .filter_map(|n| Some((n.id.clone(), n.detail.get("run_id")?.as_str()?.to_string())))
            .collect()
    }

    /// Nests `child` — the DAG of the run a frame node (`frame`) of this DAG stands for — inside
    /// that frame: its nodes join this DAG under ids prefixed by the child run's id, in the
    /// frame (`frame_id`), and its root frame is that frame node. Nested frames stay nested
    /// (their parent is the frame they were opened in).
    pub fn nest(&mut self, frame: &str, child: Dag) {
        let prefix = format!("{}/", child.run_id);
        let rename = |id: &str| if id == child.root_frame { frame.to_string() } else { format!("{prefix}{id}") };
        for mut n in child.nodes {
            if n.id == child.root_frame {
                continue;
            }
            n.id = rename(&n.id);
            n.frame_id = rename(&n.frame_id);
            n.parent_frame_id = n.parent_frame_id.as_deref().map(rename);
            self.nodes.push(n);
        }
        for e in child.edges {
            self.edges.push(DagEdge { from: rename(&e.from), to: rename(&e.to), kind: e.kind });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events;
    use crate::trace::{TraceEvent, build};

    #[test]
    fn branches_attempts_and_results_are_nodes_and_nothing_is_erased() {
        let plan = json!({"plan": {"steps": [
            {"id": "a", "tool": "flaky", "params": {"n": 1},
             "alternatives": [{"tool": "echo", "params": {"n": 2}}]},
        ]}});
        let evs = [
            (events::RUN_SUBMITTED, "", plan),
            (events::RUN_STARTED, "", json!({})),
            (events::POLICY_DECISION, "a", json!({"attempt": 1, "decision_id": "d1", "outcome": "allow"})),
            (events::TOOL_REQUESTED, "a", json!({"attempt": 1})),
            (events::TOOL_FAILED, "a", json!({"attempt": 1, "reason": "boom", "retry": {"next_attempt": 2}})),
            (events::TOOL_REQUESTED, "a", json!({"attempt": 2})),
            (events::TOOL_FAILED, "a", json!({"attempt": 2, "reason": "boom again"})),
            (events::STEP_BRANCHED, "a", json!({"branch": 1, "tool": "echo", "attempt": 3, "after": "boom again"})),
            (events::POLICY_DECISION, "a", json!({"attempt": 3, "decision_id": "d3", "outcome": "allow"})),
            (events::TOOL_REQUESTED, "a", json!({"attempt": 3})),
            (events::TOOL_COMPLETED, "a", json!({"attempt": 3, "output": {"n": 2}})),
            (events::RUN_COMPLETED, "", json!({})),
        ];
        let owned: Vec<TraceEvent<'_>> = evs
            .iter()
            .enumerate()
            .map(|(i, (t, s, p))| TraceEvent {
                seq: i as u64 + 1,
                event_type: t,
                step_id: s,
                payload: p,
                timestamp_ms: 1_000 + i as i64,
            })
            .collect();
        let dag = of(&build("r", &owned), "the submitted plan");
        let node = |id: &str| dag.nodes.iter().find(|n| n.id == id).unwrap_or_else(|| panic!("node {id}"));
        assert_eq!((node("branch:a:0").status.as_str(), node("branch:a:0").label.as_str()), ("failed", "flaky"));
        assert_eq!((node("branch:a:1").status.as_str(), node("branch:a:1").label.as_str()), ("succeeded", "echo"));
        assert_eq!(node("attempt:a:3").label, "echo");
        assert_eq!(node("attempt:a:1").status, "error", "the failed attempts stay");
        assert_eq!(node("result:a").detail["output"]["bytes"], 7, "the output by reference");
        let has =
            |from: &str, to: &str, kind: &str| dag.edges.iter().any(|e| e.from == from && e.to == to && e.kind == kind);
        assert!(has("frame:root", "step:a", "contains"));
        assert!(has("step:a", "branch:a:0", "tries"));
        assert!(has("branch:a:0", "branch:a:1", "backtracked_to"));
        assert!(has("branch:a:0", "attempt:a:1", "executes") && has("branch:a:1", "attempt:a:3", "executes"));
        assert!(has("attempt:a:1", "attempt:a:2", "retried_as"));
        assert!(has("attempt:a:3", "result:a", "produced"));
        assert_eq!(node("frame:root").duration_ms, Some(10));
    }

    #[test]
    fn a_child_frames_dag_nests_inside_its_frame_node() {
        let parent_plan = json!({"plan": {"steps": [{"id": "research", "subgoal": "find"}]}});
        let child_plan = json!({"plan": {"steps": [{"id": "fetch", "tool": "echo"}]}});
        let events_of = |evs: &[(&'static str, &'static str, Value)]| -> RunTrace {
            let owned = TraceEvent::numbered(evs);
            build("r", &owned)
        };
        let parent = events_of(&[
            (events::RUN_SUBMITTED, "", parent_plan),
            (events::FRAME_OPENED, "research", json!({"child_run_id": "c1", "subgoal": "find", "depth": 1})),
            (events::FRAME_CLOSED, "research", json!({"child_run_id": "c1", "status": "completed"})),
        ]);
        let mut child = of(
            &events_of(&[
                (events::RUN_SUBMITTED, "", child_plan),
                (events::TOOL_COMPLETED, "fetch", json!({"output": {}})),
            ]),
            "find",
        );
        child.run_id = "c1".into();
        let mut dag = of(&parent, "the submitted plan");
        assert_eq!(dag.open_frames(), [("frame:c1".to_string(), "c1".to_string())]);
        dag.nest("frame:c1", child);
        assert!(dag.open_frames().is_empty(), "nested once");
        let fetch = dag.nodes.iter().find(|n| n.id == "c1/step:fetch").expect("the child's step");
        assert_eq!(fetch.frame_id, "frame:c1");
        assert!(dag.edges.iter().any(|e| e.from == "frame:c1" && e.to == "c1/step:fetch" && e.kind == "contains"));
        assert!(dag.edges.iter().any(|e| e.from == "step:research" && e.to == "frame:c1" && e.kind == "opens"));
    }
}
