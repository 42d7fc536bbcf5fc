"""The clients against a real mesh: every operation of the issue, sync and async."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import payload
from mesh import TENANT, Gate, Mesh
from warden_sdk import (
    AsyncClient,
    Client,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    status_name,
)
from warden_sdk.v1 import common_pb2, policy_pb2, runs_pb2

RS = common_pb2.RunStatus


def test_submit_is_idempotent_per_key_and_wait_returns_the_settled_run(client: Client) -> None:
    plan = {"steps": [{"id": "a", "tool": "echo", "params": {"n": 1}}]}
    first = client.submit(plan, idempotency_key="sdk-submit-once")
    again = client.submit(json.dumps(plan), idempotency_key="sdk-submit-once")
    assert again.run_id == first.run_id and again.deduplicated and not first.deduplicated
    run = client.wait(first.run_id, timeout=30)
    assert status_name(run.status) == "completed" and run.tenant == TENANT
    assert json.loads(run.steps[0].output_json) == {"n": 1}
    assert client.get_run(first.run_id).last_seq == run.last_seq
    listed = client.list_runs([RS.RUN_STATUS_COMPLETED], page_size=1000)
    assert first.run_id in {r.run_id for r in listed.runs}


def test_a_bad_plan_is_refused_naming_the_field_and_a_goal_needs_a_model(client: Client) -> None:
    with pytest.raises(InvalidArgument) as e:
        client.submit({"steps": [{"id": "b", "tool": "echo", "params": {}, "depends_on": ["nope"]}]})
    assert any(v.field.startswith("plan_json.steps") for v in e.value.field_violations), e.value
    # The test mesh configures no model: a goal run says how to configure one.
    with pytest.raises(FailedPrecondition) as g:
        client.submit(goal="book a flight")
    assert "[planner.model]" in str(g.value)
    with pytest.raises(ValueError):
        client.submit()
    with pytest.raises(NotFound):
        client.get_run("no-such-run")


def test_events_from_a_seq_and_followed_to_the_end(client: Client, tmp_path: Path) -> None:
    gate = Gate(tmp_path)
    submitted = client.submit(
        {"steps": [{"id": "s", "tool": "py.slow", "params": {"ms": 300, "gate": str(gate.path)}}]}
    )
    gate.release()
    followed = list(client.events(submitted.run_id, follow=True))
    assert followed[-1].event_type == "run_completed", [e.event_type for e in followed]
    assert [e.seq for e in followed] == list(range(1, len(followed) + 1))
    later = list(client.events(submitted.run_id, since_seq=3))
    assert [e.seq for e in later] == list(range(4, len(followed) + 1))


def test_trace_and_receipts(client: Client) -> None:
    sub = client.submit(
        {
            "steps": [
                {"id": "a", "tool": "py.add", "params": {"a": 1, "b": 2}},
                {"id": "b", "tool": "echo", "params": {"x": "{{a.output}}"}, "depends_on": ["a"]},
            ]
        }
    )
    client.wait(sub.run_id, timeout=30)
    trace = client.trace(sub.run_id)
    assert trace["run_id"] == sub.run_id
    steps = {s["step_id"]: s for s in trace["steps"]}
    assert steps["a"]["attempts"][0]["outcome"] and {"from": "a", "to": "b"}.items() <= trace["edges"][0].items()
    assert [r.step_id for r in client.receipts(sub.run_id)] == ["a", "b"]
    (only_b,) = client.receipts(sub.run_id, step_id="b")
    assert (only_b.status, only_b.action_type) == ("ok", "echo")


def test_cancel_follows_the_declared_policy(client: Client, tmp_path: Path) -> None:
    gate = Gate(tmp_path)
    sub = client.submit(
        {
            "steps": [
                {"id": "working", "tool": "py.slow", "params": {"ms": 2000, "gate": str(gate.path)}},
                {"id": "next", "tool": "echo", "params": {}, "depends_on": ["working"]},
            ]
        },
        cancel_policy="immediate",
    )
    for e in client.events(sub.run_id, follow=True):
        if e.event_type == "tool_requested":
            break
    client.cancel(sub.run_id, reason="changed my mind")
    gate.release()  # the tool was working when the cancel landed; now it finishes
    run = client.wait(sub.run_id, timeout=30)
    assert status_name(run.status) == "cancelled", run
    steps = {s.id: s for s in run.steps}
    assert steps["working"].status == runs_pb2.STEP_STATUS_COMPLETED, "a tool already working is not interrupted"
    assert steps["next"].status == runs_pb2.STEP_STATUS_CANCELLED
    assert client.cancel(sub.run_id) == RS.RUN_STATUS_CANCELLED, "cancelling again changes nothing"
    assert {r.step_id: r.status for r in client.receipts(sub.run_id)}["next"] == "cancelled"


def test_a_paused_run_settles_its_step_in_flight_and_goes_on_when_resumed(client: Client, tmp_path: Path) -> None:
    gate = Gate(tmp_path)
    sub = client.submit(
        {
            "steps": [
                {"id": "working", "tool": "py.slow", "params": {"ms": 2000, "gate": str(gate.path)}},
                {"id": "next", "tool": "echo", "params": {"n": 1}, "depends_on": ["working"]},
            ]
        }
    )
    for e in client.events(sub.run_id, follow=True):
        if e.event_type == "tool_requested":
            break
    assert client.pause(sub.run_id, reason="hold on") == RS.RUN_STATUS_ACTIVE
    gate.release()  # the step in flight settles; nothing new starts
    run = client.wait(sub.run_id, timeout=30)
    assert status_name(run.status) == "paused", run
    steps = {s.id: s for s in run.steps}
    assert steps["working"].status == runs_pb2.STEP_STATUS_COMPLETED
    assert steps["next"].status == runs_pb2.STEP_STATUS_PENDING
    assert client.pause(sub.run_id) == RS.RUN_STATUS_PAUSED, "pausing again changes nothing"
    assert client.resume(sub.run_id, reason="go") == RS.RUN_STATUS_PENDING
    done = client.wait(sub.run_id, timeout=30)
    assert status_name(done.status) == "completed", done
    with pytest.raises(FailedPrecondition):
        client.resume(sub.run_id)


def test_an_unknown_outcome_is_reconciled_by_an_operator(client: Client, tmp_path: Path) -> None:
    gate = Gate(tmp_path)
    # py.hang outlives its declared 1 s timeout and is not idempotent: the executor cannot
    # know whether it acted, so the run waits for an operator.
    sub = client.submit(
        {
            "steps": [
                {"id": "h", "tool": "py.hang", "params": {"ms": 1500, "gate": str(gate.path)}},
                {"id": "after", "tool": "echo", "params": {"got": "{{h.output.slept_ms}}"}, "depends_on": ["h"]},
            ]
        }
    )
    stuck = client.wait(sub.run_id, timeout=30)
    gate.release()  # the host's call ends now, long after the executor gave up on it
    assert status_name(stuck.status) == "requires_reconciliation", stuck
    with pytest.raises(FailedPrecondition):
        client.cancel(sub.run_id)
    client.reconcile(sub.run_id, "h", outcome="completed", output={"slept_ms": 1500}, operator="alice")
    run = client.wait(sub.run_id, timeout=30)
    assert status_name(run.status) == "completed", run
    assert json.loads({s.id: s for s in run.steps}["after"].output_json) == {"got": 1500}
    completed = [e for e in client.events(sub.run_id) if e.event_type == "tool_completed" and e.step_id == "h"]
    assert payload(completed[0])["reconciled_by"] == "alice"


def _pending_for(client: Client, run_id: str) -> policy_pb2.Approval:
    """The run's pending approval. Callers wait for the run to block first, and the approval
    exists before the decision that blocks the run is answered."""
    for a in client.approvals("pending"):
        if a.run_id == run_id:
            return a
    raise AssertionError(f"no pending approval for {run_id}")


def test_approvals_list_approve_and_deny(mesh: Mesh, client: Client) -> None:
    sub = client.submit({"steps": [{"id": "pay", "tool": "py.gated", "params": {"amount": 5}}]})
    assert status_name(client.wait(sub.run_id, timeout=30).status) == "blocked"
    approval = _pending_for(client, sub.run_id)
    assert (approval.tool, approval.step_id) == ("py.gated", "pay")
    assert client.get_approval(approval.approval_id).state == policy_pb2.APPROVAL_STATE_PENDING
    resolved = client.approve(approval.approval_id, approver="alice", reason="ok")
    assert (resolved.state, resolved.approver) == (policy_pb2.APPROVAL_STATE_APPROVED, "alice")
    assert client.approve(approval.approval_id, approver="alice").state == policy_pb2.APPROVAL_STATE_APPROVED
    run = client.wait(sub.run_id, timeout=30, until={RS.RUN_STATUS_COMPLETED, RS.RUN_STATUS_FAILED})
    assert json.loads(run.steps[0].output_json) == {"paid": 5}

    denied = client.submit({"steps": [{"id": "pay", "tool": "py.gated", "params": {"amount": 7}}]})
    client.wait(denied.run_id, timeout=30)
    client.deny(_pending_for(client, denied.run_id).approval_id, approver="bob", reason="no")
    run = client.wait(denied.run_id, timeout=30, until={RS.RUN_STATUS_COMPLETED, RS.RUN_STATUS_FAILED})
    assert status_name(run.status) == "failed" and run.steps[0].status == runs_pb2.STEP_STATUS_DENIED
    ran = [e for e in mesh.effects() if e["tool"] == "py.gated" and e["run_id"] in (sub.run_id, denied.run_id)]
    assert [e["run_id"] for e in ran] == [sub.run_id], "only the approved call ran"


async def test_watch_approvals_streams_each_change(aclient: AsyncClient) -> None:
    seen: asyncio.Queue[policy_pb2.Approval] = asyncio.Queue()

    async def watch() -> None:
        async for a in aclient.watch_approvals():
            await seen.put(a)

    watcher = asyncio.create_task(watch())
    try:
        sub = await aclient.submit({"steps": [{"id": "pay", "tool": "py.gated", "params": {"amount": 9}}]})

        async def next_for(state: int) -> policy_pb2.Approval:
            while True:
                a = await asyncio.wait_for(seen.get(), timeout=20)
                if a.run_id == sub.run_id and a.state == state:
                    return a

        pending = await next_for(policy_pb2.APPROVAL_STATE_PENDING)
        await aclient.approve(pending.approval_id, approver="carol")
        approved = await next_for(policy_pb2.APPROVAL_STATE_APPROVED)
        assert approved.approver == "carol"
        run = await aclient.wait(sub.run_id, timeout=30, until={RS.RUN_STATUS_COMPLETED})
        assert json.loads(run.steps[0].output_json) == {"paid": 9}
    finally:
        watcher.cancel()
        with pytest.raises(asyncio.CancelledError):
            await watcher


def test_capabilities_issue_list_attach_and_revoke(client: Client) -> None:
    cap = client.issue_capability(["py.*"], ttl_seconds=120)
    assert cap.handle.startswith("wcap_") and cap.capability_id
    assert client.get_capability(cap.capability_id).handle == "", "a handle is shown once"
    assert cap.capability_id in {c.capability_id for c in client.capabilities()}
    sub = client.submit(
        {"steps": [{"id": "a", "tool": "py.add", "params": {"a": 1, "b": 1}}]}, capability_handles=[cap.handle]
    )
    assert status_name(client.wait(sub.run_id, timeout=30).status) == "completed"
    assert client.attach_capability(sub.run_id, cap.handle, validate_only=True).capability_id == cap.capability_id
    assert client.revoke_capability(cap.capability_id, reason="done").revoked
    with pytest.raises(FailedPrecondition, match=r"capability_handles\[0\]"):
        client.submit({"steps": [{"id": "a", "tool": "echo", "params": {}}]}, capability_handles=[cap.handle])


def test_verify_a_run_by_the_ledger_and_locally_against_the_pinned_key(client: Client) -> None:
    sub = client.submit({"steps": [{"id": "a", "tool": "py.add", "params": {"a": 4, "b": 4}}]})
    run = client.wait(sub.run_id, timeout=30)
    server = client.verify_run(sub.run_id)
    assert server.valid and server.events == run.last_seq
    (key,) = client.ledger_keys()
    report = client.verify_run_locally(sub.run_id, key=key.public_key.hex())
    assert (report.run_id, report.events, report.receipts, report.key_id) == (sub.run_id, run.last_seq, 1, key.key_id)
    assert client.signed_head(sub.run_id).hash == server.head_hash
    assert any(k.current for k in client.verification_keys())


async def test_the_async_client_does_the_same(aclient: AsyncClient, tmp_path: Path) -> None:
    gate = Gate(tmp_path)
    sub = await aclient.submit(
        {"steps": [{"id": "a", "tool": "py.slow", "params": {"ms": 200, "gate": str(gate.path)}}]}
    )
    await asyncio.to_thread(gate.release)
    types = [e.event_type async for e in aclient.events(sub.run_id, follow=True)]
    assert types[0] == "run_submitted" and types[-1] == "run_completed"
    run = await aclient.wait(sub.run_id, timeout=30)
    assert json.loads(run.steps[0].output_json) == {"slept_ms": 200}
    trace: dict[str, Any] = await aclient.trace(sub.run_id)
    assert trace["steps"][0]["tool"] == "py.slow"
    (receipt,) = await aclient.receipts(sub.run_id)
    assert receipt.status == "ok"
    assert (await aclient.verify_run(sub.run_id)).valid
    assert (await aclient.verify_run_locally(sub.run_id)).events == run.last_seq
    assert "py.slow" in {t.name for t in await aclient.tools()}
    with pytest.raises(InvalidArgument):
        await aclient.submit("[]")
