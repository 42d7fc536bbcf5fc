"""The Python tool host in a real mesh: the executor reaches it through the tool catalog, the
policy's authorizations and the ledger's acknowledgements it verifies are the real ones, and
every refusal is proven by the function never running (``hostapp.py`` logs each run of a
function body to the effects file)."""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from conftest import payload
from mesh import TENANT, Mesh
from warden_sdk import Client, InvokeRefused, ToolHost
from warden_sdk.auth import CallIdentity, decision_id
from warden_sdk.client import TERMINAL
from warden_sdk.errors import from_rpc_error
from warden_sdk.v1 import common_pb2, runs_pb2, toolhost_pb2, toolhost_pb2_grpc


def run_plan(client: Client, steps: list[dict[str, Any]], **kw: Any) -> Any:
    submitted = client.submit({"steps": steps}, **kw)
    return client.wait(submitted.run_id, timeout=30)


def effects_of(mesh: Mesh, run_id: str) -> list[dict[str, Any]]:
    return [e for e in mesh.effects() if e["run_id"] == run_id]


def captured_request(mesh: Mesh, run_id: str, step_id: str) -> toolhost_pb2.InvokeRequest:
    (line,) = [e for e in effects_of(mesh, run_id) if e["step_id"] == step_id]
    return toolhost_pb2.InvokeRequest.FromString(bytes.fromhex(line["request"]))


def invoke(mesh: Mesh, req: toolhost_pb2.InvokeRequest) -> toolhost_pb2.InvokeResponse:
    with grpc.insecure_channel(mesh.pyhost.endpoint.removeprefix("http://")) as ch:
        return toolhost_pb2_grpc.ToolHostStub(ch).Invoke(req, timeout=10)


def refused(mesh: Mesh, req: toolhost_pb2.InvokeRequest) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        invoke(mesh, req)
    err = from_rpc_error(e.value)
    return err.code, err.message


def copy(req: toolhost_pb2.InvokeRequest) -> toolhost_pb2.InvokeRequest:
    out = toolhost_pb2.InvokeRequest()
    out.CopyFrom(req)
    return out


def test_a_plan_calling_python_tools_completes_with_receipts(mesh: Mesh, client: Client) -> None:
    run = run_plan(
        client,
        [
            {"id": "sum", "tool": "py.add", "params": {"a": 2, "b": 3}},
            {"id": "price", "tool": "py.quote", "params": {"sku": "A-1", "quantity": 4}},
            {"id": "show", "tool": "echo", "params": {"sum": "{{sum.output}}"}, "depends_on": ["sum"]},
        ],
    )
    assert run.status == common_pb2.RUN_STATUS_COMPLETED, run
    outputs = {s.id: json.loads(s.output_json) for s in run.steps}
    assert outputs == {"sum": 5, "price": {"sku": "A-1", "total_cents": 1000}, "show": {"sum": 5}}
    receipts = {r.step_id: r for r in client.receipts(run.run_id)}
    assert set(receipts) == {"sum", "price", "show"}
    assert (receipts["sum"].status, receipts["sum"].action_type) == ("ok", "py.add")
    events = list(client.events(run.run_id))
    decisions = [e for e in events if e.event_type == "policy_decision" and e.step_id == "sum"]
    assert receipts["sum"].policy_decision == payload(decisions[0])["decision_id"]
    # The decision id policy computed is the one the SDK computes for the same call.
    p = payload(decisions[0])
    call = CallIdentity(TENANT, run.run_id, "sum", 1, "py.add", p["args_sha256"], p["idempotency_key"])
    # A first step is usually decided while its run is being created: its record then names
    # the plan it was decided against, and so does its id.
    gate = f"|plan:{p['plan_sha256'][:16]}" if "plan_sha256" in p else ""
    assert decision_id(call, p["capability_id"] + gate) == p["decision_id"]
    assert [e["tool"] for e in effects_of(mesh, run.run_id)] == ["py.add"], "the function ran once"
    assert client.verify_run(run.run_id).valid


def test_direct_invokes_without_both_proofs_are_refused_and_never_run(mesh: Mesh, client: Client) -> None:
    run = run_plan(
        client,
        [
            {"id": "c1", "tool": "py.capture", "params": {"note": "one"}},
            {"id": "c2", "tool": "py.capture", "params": {"note": "two"}},
        ],
    )
    assert run.status == common_pb2.RUN_STATUS_COMPLETED, run
    real = captured_request(mesh, run.run_id, "c1")
    other = captured_request(mesh, run.run_id, "c2")
    assert real.HasField("authorization") and real.HasField("request_ack")
    before = len(mesh.effects())

    no_ack = copy(real)
    no_ack.ClearField("request_ack")
    code, msg = refused(mesh, no_ack)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "no ledger acknowledgement" in msg

    anothers_ack = copy(real)
    anothers_ack.request_ack.CopyFrom(other.request_ack)
    code, msg = refused(mesh, anothers_ack)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "does not match" in msg

    other_args = copy(real)
    other_args.args_json = json.dumps({"note": "three"})
    assert refused(mesh, other_args) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "refused: authorization is for another call: args_sha256 does not match",
    )

    forger = Ed25519PrivateKey.generate()
    forged = copy(real)
    forged.authorization.signature = forger.sign(real.authorization.claims_json)
    assert refused(mesh, forged) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "refused: authorization signature does not verify",
    )

    altered = copy(real)
    altered.authorization.claims_json = real.authorization.claims_json.replace(b'"attempt":1', b'"attempt":2')
    altered.attempt = 2
    assert refused(mesh, altered)[0] == grpc.StatusCode.PERMISSION_DENIED

    other_tenant = copy(real)
    other_tenant.tenant = "globex"
    assert refused(mesh, other_tenant) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "refused: authorization is for another call: tenant does not match",
    )

    bad_id = copy(real)
    bad_id.step_id = "c1.x"
    code, _ = refused(mesh, bad_id)
    assert code == grpc.StatusCode.INVALID_ARGUMENT

    assert len(mesh.effects()) == before, "no refused call reached a function"

    # The genuine request, sent again, is answered with the recorded outcome.
    again = invoke(mesh, real)
    assert again.replayed
    assert json.loads(again.output_json) == json.loads(next(s for s in run.steps if s.id == "c1").output_json)
    assert len(mesh.effects()) == before


async def test_an_expired_authorization_is_refused(mesh: Mesh, client: Client, tmp_path: Any) -> None:
    import hostapp

    run = run_plan(client, [{"id": "c", "tool": "py.capture", "params": {"note": "late"}}])
    real = captured_request(mesh, run.run_id, "c")
    claims = json.loads(real.authorization.claims_json)
    # The same tools, verifying against the mesh's real keys, two hours later.
    later = ToolHost(
        hostapp.host.tools.values(),
        policy_endpoint=mesh.policy.endpoint,
        ledger_endpoint=mesh.ledger.endpoint,
        state_path=tmp_path / "later.db",
        clock=lambda: int(time.time() * 1000) + 2 * 3600 * 1000,
    )
    with pytest.raises(InvokeRefused) as e:
        await later.invoke(real)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert str(e.value).startswith(f"refused: authorization expired at {claims['expires_at_ms']}")
    await later.stop()


def test_a_raising_tool_is_a_recorded_failure_with_type_and_message(mesh: Mesh, client: Client) -> None:
    run = run_plan(client, [{"id": "x", "tool": "py.explode", "params": {"message": "boom 42"}}])
    assert run.status == common_pb2.RUN_STATUS_FAILED
    (step,) = run.steps
    assert (step.status, step.error) == (runs_pb2.STEP_STATUS_FAILED, "ValueError: boom 42")
    events = list(client.events(run.run_id))
    (failed,) = [e for e in events if e.event_type == "tool_failed"]
    p = payload(failed)
    assert (p["kind"], p["code"], p["reason"], p["retryable"]) == (
        "tool_error",
        "ValueError",
        "ValueError: boom 42",
        False,
    )
    (receipt,) = client.receipts(run.run_id)
    assert (receipt.status, receipt.reason) == ("error", "ValueError: boom 42")
    everything = "".join(e.payload_json for e in events) + json.dumps(client.trace(run.run_id))
    assert "Traceback" not in everything and "hostapp.py" not in everything, "the host's traceback stays in the host"
    assert "Traceback" in mesh.pyhost.log.read_text(), "…where it is logged"


def test_retryable_failures_are_retried_under_the_declared_policy(mesh: Mesh, client: Client) -> None:
    run = run_plan(client, [{"id": "f", "tool": "py.flaky", "params": {"succeed_on_attempt": 2}}])
    assert run.status == common_pb2.RUN_STATUS_COMPLETED, run
    assert run.steps[0].attempts == 2
    assert [e["attempt"] for e in effects_of(mesh, run.run_id)] == [1, 2]
    assert [r.status for r in client.receipts(run.run_id)] == ["error", "ok"]


def test_a_restarted_host_replays_the_first_outcome(mesh: Mesh, client: Client) -> None:
    run = run_plan(client, [{"id": "c", "tool": "py.capture", "params": {"note": "durable"}}])
    assert run.status == common_pb2.RUN_STATUS_COMPLETED
    real = captured_request(mesh, run.run_id, "c")
    first_output = json.loads(run.steps[0].output_json)
    mesh.restart_pyhost()
    again = invoke(mesh, real)
    assert again.replayed, "the outcome was recorded before it was answered, and survived the restart"
    assert json.loads(again.output_json) == first_output
    assert len(effects_of(mesh, run.run_id)) == 1, "the function ran once"
    # The executor reaches the restarted host for new runs too.
    after = run_plan(client, [{"id": "s", "tool": "py.add", "params": {"a": 1, "b": 1}}])
    assert after.status == common_pb2.RUN_STATUS_COMPLETED and after.steps[0].output_json == "2"
    assert after.status in TERMINAL
