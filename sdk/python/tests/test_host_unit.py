"""The tool host framework without a mesh: declarations, verification before every call,
durable replay, refusals, and failures as outcomes. Keys come from a LocalAuthority, so
each call takes the same verification path a real one does."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from pydantic import BaseModel, Field

from warden_sdk import InvokeRefused, ToolContext, ToolFailure, ToolHost, tool
from warden_sdk.errors import from_rpc_error
from warden_sdk.testing import LocalAuthority
from warden_sdk.v1 import common_pb2, toolhost_pb2, toolhost_pb2_grpc

CALLS: list[str] = []
LOCK = threading.Lock()


def ran(name: str) -> None:
    with LOCK:
        CALLS.append(name)


@pytest.fixture(autouse=True)
def _reset() -> None:
    CALLS.clear()
    GATE.clear()


@tool(name="math.add", effect="read_only", idempotent=True, timeout_sec=3)
def add(a: int, b: int = 0) -> int:
    """Adds two integers.

    Longer text that is not part of the description."""
    ran("add")
    return a + b


@tool(name="mail.send", effect="consequential", retry="standard", retry_on=(ConnectionError,))
def send(to: str, ctx: ToolContext) -> dict[str, str]:
    """Sends mail."""
    ran("send")
    if to == "down@example.com":
        raise ConnectionError("smtp unreachable")
    if to == "bad@example.com":
        raise ValueError(f"no mailbox {to}")
    if to == "quota@example.com":
        raise ToolFailure("quota exceeded", code="quota", retryable=True)
    return {"id": f"msg-{ctx.idempotency_key}", "tenant": ctx.tenant}


#: Holds `slow.echo` until a test opens it: the tool works exactly as long as the test wants.
GATE: dict[str, asyncio.Event] = {}


def gate() -> asyncio.Event:
    return GATE.setdefault("slow", asyncio.Event())


@tool(name="slow.echo", idempotent=True)
async def slow_echo(text: str, ms: int = 300) -> dict[str, str]:
    """Echoes once released (an async tool that takes its time)."""
    ran("slow")
    await gate().wait()
    return {"text": text}


class Order(BaseModel):
    sku: str = Field(min_length=1)
    quantity: int = Field(ge=1)


class Quote(BaseModel):
    sku: str
    total_cents: int


@tool(name="shop.quote", effect="read_only")
def quote(order: Order) -> Quote:
    ran("quote")
    return Quote(sku=order.sku, total_cents=order.quantity * 250)


@tool(name="bad.output")
def bad_output() -> int:
    ran("bad_output")
    return "not a number"  # type: ignore[return-value]


TOOLS = [add, send, slow_echo, quote, bad_output]


@pytest.fixture
def authority() -> LocalAuthority:
    return LocalAuthority()


@pytest.fixture
def host(authority: LocalAuthority, tmp_path: Path) -> ToolHost:
    return authority.host(TOOLS, state_path=tmp_path / "tools.db")


def output(resp: toolhost_pb2.InvokeResponse) -> Any:
    assert resp.WhichOneof("outcome") == "output_json", resp
    return json.loads(resp.output_json)


# --- declarations -----------------------------------------------------------------------------


def test_declarations_come_from_type_hints_docstrings_and_the_decorator() -> None:
    spec = add.spec()
    assert (spec.name, spec.description, spec.timeout_sec, spec.version) == ("math.add", "Adds two integers.", 3, "1")
    assert spec.read_only and spec.idempotent and not spec.consequential
    assert spec.retry_policy == common_pb2.RETRY_POLICY_NONE
    schema = json.loads(spec.input_schema_json)
    assert schema["type"] == "object" and schema["required"] == ["a"]
    assert schema["properties"]["a"]["type"] == "integer" and schema["properties"]["b"]["default"] == 0
    assert schema["additionalProperties"] is False
    assert add.output_schema == {"type": "integer"}
    s = send.spec()
    assert s.consequential and not s.read_only and not s.idempotent
    assert s.retry_policy == common_pb2.RETRY_POLICY_STANDARD
    assert "ctx" not in json.loads(s.input_schema_json)["properties"], "the context is not an argument"


def test_a_pydantic_model_is_the_whole_input_and_output_schema() -> None:
    schema = json.loads(quote.spec().input_schema_json)
    assert set(schema["properties"]) == {"sku", "quantity"}
    assert schema["properties"]["quantity"]["minimum"] == 1
    assert quote.output_schema is not None and set(quote.output_schema["properties"]) == {"sku", "total_cents"}


def test_bad_declarations_are_refused_at_import() -> None:
    with pytest.raises(ValueError, match="tool name"):
        tool(name="bad name")(lambda: None)
    with pytest.raises(TypeError, match="named parameter"):

        @tool
        def variadic(*args: int) -> None: ...

    with pytest.raises(ValueError, match="effect"):
        tool(name="x", effect="sometimes")(lambda: None)
    with pytest.raises(ValueError, match="declared twice"):
        ToolHost([add, add], state_path=":memory:")


# --- calls ------------------------------------------------------------------------------------


async def test_a_verified_call_runs_once_and_a_repeat_is_replayed(host: ToolHost, authority: LocalAuthority) -> None:
    req = authority.request("math.add", {"a": 2, "b": 3})
    first = await host.invoke(req)
    assert output(first) == 5 and not first.replayed
    again = await host.invoke(req)
    assert again.replayed and again.output_json == first.output_json
    assert CALLS == ["add"]


async def test_outcomes_survive_a_restart_of_the_host(authority: LocalAuthority, tmp_path: Path) -> None:
    host = authority.host(TOOLS, state_path=tmp_path / "t.db")
    req = authority.request("mail.send", {"to": "ops@example.com"})
    first = await host.invoke(req)
    # A new host over the same file: nothing in memory survives.
    again = await authority.host(TOOLS, state_path=tmp_path / "t.db").invoke(req)
    assert again.replayed and again.output_json == first.output_json
    assert CALLS == ["send"], "the mail went out once"


async def test_a_key_reused_for_another_call_is_refused_not_answered_with_the_first_outcome(
    host: ToolHost, authority: LocalAuthority
) -> None:
    await host.invoke(authority.request("math.add", {"a": 1}, idempotency_key="k1"))
    for req in (
        authority.request("math.add", {"a": 2}, idempotency_key="k1"),
        authority.request("slow.echo", {"text": "x"}, idempotency_key="k1"),
    ):
        with pytest.raises(InvokeRefused) as e:
            await host.invoke(req)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert CALLS == ["add"]


async def test_concurrent_calls_with_one_key_run_the_tool_once(host: ToolHost, authority: LocalAuthority) -> None:
    req = authority.request("slow.echo", {"text": "hi", "ms": 100})
    calls = [asyncio.ensure_future(host.invoke(req)) for _ in range(8)]
    gate().set()  # every call was issued while the first one worked
    answers = await asyncio.gather(*calls)
    assert sum(not a.replayed for a in answers) == 1
    assert len({a.output_json for a in answers}) == 1
    assert CALLS == ["slow"]
    assert len(host._in_flight) == 0, "memory is held only while calls run"


async def test_one_key_in_two_tenants_is_two_calls(host: ToolHost, authority: LocalAuthority) -> None:
    a = await host.invoke(authority.request("mail.send", {"to": "x@example.com"}, tenant="a", idempotency_key="k"))
    b = await host.invoke(authority.request("mail.send", {"to": "x@example.com"}, tenant="b", idempotency_key="k"))
    assert not a.replayed and not b.replayed
    assert output(a)["tenant"] == "a" and output(b)["tenant"] == "b"


async def test_a_raising_tool_is_a_recorded_failure_with_type_and_message_never_a_traceback(
    host: ToolHost, authority: LocalAuthority
) -> None:
    req = authority.request("mail.send", {"to": "bad@example.com"})
    resp = await host.invoke(req)
    assert resp.WhichOneof("outcome") == "error"
    assert (resp.error.code, resp.error.message, resp.error.retryable) == (
        "ValueError",
        "ValueError: no mailbox bad@example.com",
        False,
    )
    assert "Traceback" not in resp.error.message and "File " not in resp.error.message
    again = await host.invoke(req)
    assert again.replayed and again.error == resp.error, "a failure is an outcome, replayed like any other"
    assert CALLS == ["send"]


async def test_retryable_failures_are_declared_not_guessed(host: ToolHost, authority: LocalAuthority) -> None:
    down = await host.invoke(authority.request("mail.send", {"to": "down@example.com"}, idempotency_key="k1"))
    assert (down.error.code, down.error.retryable) == ("ConnectionError", True), "listed in retry_on"
    quota = await host.invoke(authority.request("mail.send", {"to": "quota@example.com"}, idempotency_key="k2"))
    assert (quota.error.code, quota.error.message, quota.error.retryable) == ("quota", "quota exceeded", True)


async def test_arguments_are_validated_before_the_function_runs(host: ToolHost, authority: LocalAuthority) -> None:
    for i, args in enumerate([{"a": "x"}, {"b": 1}, {"a": 1, "c": 2}, [1, 2]]):
        resp = await host.invoke(authority.request("math.add", args, idempotency_key=f"k{i}"))
        assert resp.error.code == "invalid_arguments", args
    bad_order = await host.invoke(authority.request("shop.quote", {"sku": "", "quantity": 0}, idempotency_key="q0"))
    assert bad_order.error.code == "invalid_arguments" and "quantity" in bad_order.error.message
    assert CALLS == []
    ok = await host.invoke(authority.request("shop.quote", {"sku": "A", "quantity": 2}, idempotency_key="q1"))
    assert output(ok) == {"sku": "A", "total_cents": 500}


async def test_outputs_are_validated_against_the_return_annotation(host: ToolHost, authority: LocalAuthority) -> None:
    resp = await host.invoke(authority.request("bad.output", {}))
    assert resp.error.code == "invalid_output"


# --- refusals: the function never runs --------------------------------------------------------


async def test_a_call_started_but_never_recorded_is_in_doubt_and_not_run_again(
    authority: LocalAuthority, tmp_path: Path
) -> None:
    host = authority.host(TOOLS, state_path=tmp_path / "t.db")
    req = authority.request("mail.send", {"to": "ops@example.com"})
    # What a host that stopped mid-call leaves behind: the call marked started, no outcome.
    assert await host.store.mark_started(req.tenant, req.idempotency_key, 1)
    e = await refused(host, req)
    assert e.code == grpc.StatusCode.UNKNOWN and e.message.startswith("in doubt"), e
    assert CALLS == [], "a call that may have acted is never run again"
    assert all(t.spec().detects_in_doubt for t in host.tools.values())
    # An idempotent tool is not marked: running it again is harmless.
    assert output(await host.invoke(authority.request("math.add", {"a": 1}))) == 1


async def refused(host: ToolHost, req: toolhost_pb2.InvokeRequest) -> InvokeRefused:
    with pytest.raises(InvokeRefused) as e:
        await host.invoke(req)
    return e.value


async def test_k01_unproven_calls_are_refused_before_the_function_runs(
    host: ToolHost, authority: LocalAuthority, tmp_path: Path
) -> None:
    no_ack = authority.request("mail.send", {"to": "a@example.com"}, acknowledged=False)
    e = await refused(host, no_ack)
    assert e.code == grpc.StatusCode.PERMISSION_DENIED
    assert e.message == "refused: no ledger acknowledgement that the request is recorded: authorization is missing"

    other_args = authority.request("mail.send", {"to": "a@example.com"})
    other_args.args_json = json.dumps({"to": "b@example.com"})
    e = await refused(host, other_args)
    assert (e.code, e.message) == (
        grpc.StatusCode.PERMISSION_DENIED,
        "refused: authorization is for another call: args_sha256 does not match",
    )

    stranger = LocalAuthority()
    e = await refused(host, stranger.request("mail.send", {"to": "a@example.com"}))
    assert e.code == grpc.StatusCode.PERMISSION_DENIED and "unknown key" in e.message

    ack_of_attempt_2 = authority.request("mail.send", {"to": "a@example.com"}, attempt=2)
    attempt_1 = authority.request("mail.send", {"to": "a@example.com"})
    attempt_1.request_ack.CopyFrom(ack_of_attempt_2.request_ack)
    e = await refused(host, attempt_1)
    assert e.message.endswith("attempt does not match")

    expired = authority.request("mail.send", {"to": "a@example.com"}, expires_in_ms=-1)
    e = await refused(host, expired)
    assert "expired" in e.message

    later = authority.host(TOOLS, state_path=tmp_path / "later.db", clock=lambda: 2**62)
    e = await refused(later, authority.request("mail.send", {"to": "a@example.com"}))
    assert "expired" in e.message

    # A consequential tool's call decided under a milder class, or without its declaration
    # (the policy would not have asked for a commitment), is refused.
    milder = authority.request("mail.send", {"to": "a@example.com"}, effect="write")
    assert (await refused(host, milder)).message.endswith("effect does not match")
    blind = authority.request("mail.send", {"to": "a@example.com"}, declared=False)
    assert (await refused(host, blind)).message.endswith("and the tool is consequential")
    assert CALLS == [], "no refused call reached the function"
    # A tool needing no commitment still takes a call that names no declaration.
    await host.invoke(authority.request("math.add", {"a": 1, "b": 2}, declared=False))


async def test_a_replay_still_needs_both_proofs(host: ToolHost, authority: LocalAuthority) -> None:
    req = authority.request("math.add", {"a": 1})
    await host.invoke(req)
    unacked = toolhost_pb2.InvokeRequest()
    unacked.CopyFrom(req)
    unacked.ClearField("request_ack")
    assert (await refused(host, unacked)).code == grpc.StatusCode.PERMISSION_DENIED


async def test_malformed_requests_name_the_field(host: ToolHost, authority: LocalAuthority) -> None:
    for field, value in [("tenant", ""), ("run_id", "a b"), ("idempotency_key", "-k"), ("step_id", "a.b")]:
        req = authority.request("math.add", {"a": 1})
        setattr(req, field, value)
        e = await refused(host, req)
        assert (e.code, e.field) == (grpc.StatusCode.INVALID_ARGUMENT, field), field
    req = authority.request("math.add", {"a": 1})
    req.args_json = "{"
    e = await refused(host, req)
    assert (e.code, e.field) == (grpc.StatusCode.INVALID_ARGUMENT, "args_json")
    e = await refused(host, authority.request("no.such.tool", {}))
    assert e.code == grpc.StatusCode.NOT_FOUND


# --- over gRPC --------------------------------------------------------------------------------


async def test_served_over_grpc_with_rich_errors_health_and_hang_up_safety(
    host: ToolHost, authority: LocalAuthority
) -> None:
    endpoint = await host.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(endpoint.removeprefix("http://")) as ch:
            stub: Any = toolhost_pb2_grpc.ToolHostStub(ch)
            listed = await stub.ListTools(common_pb2.ListToolsRequest())
            assert {t.name for t in listed.tools} == {"math.add", "mail.send", "slow.echo", "shop.quote", "bad.output"}

            bad = authority.request("math.add", {"a": 1})
            bad.run_id = "no spaces"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Invoke(bad)
            err = from_rpc_error(e.value)
            assert err.code == grpc.StatusCode.INVALID_ARGUMENT
            assert [(v.field, v.description) for v in err.field_violations] == [
                ("run_id", "must start with a letter or digit and contain only letters, digits, '-', '_', ':' or '.'")
            ]
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Invoke(authority.request("math.add", {"a": 1}, acknowledged=False))
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

            # A caller that hangs up does not stop the tool between its effect and the
            # recording of its outcome: asking again gets the recorded outcome.
            slow = authority.request("slow.echo", {"text": "later", "ms": 400})
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Invoke(slow, timeout=0.1)  # the tool is held: the caller hangs up
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            gate().set()
            answer = await stub.Invoke(slow, timeout=5)
            assert json.loads(answer.output_json) == {"text": "later"}
            assert CALLS == ["slow"]

            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health: Any = health_pb2_grpc.HealthStub(ch)
            status = await health.Check(health_pb2.HealthCheckRequest(service="warden.v1.ToolHost"))
            assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await host.stop()


def test_a_declaration_digest_is_the_one_rust_computes() -> None:
    from warden_sdk.host import declaration_sha256
    from warden_sdk.v1 import common_pb2

    spec = common_pb2.ToolSpec(
        name="email.send", version="1", consequential=True, input_schema_json='{"type": "object"}'
    )
    # The same value `warden_grpc::catalog` asserts for the same declaration.
    assert declaration_sha256(spec) == "3b851c447c6f3f4718ab4a76878086db2caebf412ce5a235f7286352ac730acd"
    downgraded = common_pb2.ToolSpec()
    downgraded.CopyFrom(spec)
    downgraded.effect = common_pb2.EFFECT_READ_ONLY
    assert declaration_sha256(downgraded) != declaration_sha256(spec)
