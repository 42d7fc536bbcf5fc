"""The Python tool host the end-to-end tests run as its own process (so it can be killed and
restarted): ``python hostapp.py LISTEN``, with ``WARDEN_POLICY_ENDPOINT``,
``WARDEN_LEDGER_ENDPOINT``, ``WARDEN_TOOLS_STATE`` and ``HOSTAPP_EFFECTS`` set.

Every tool appends a line to the effects file *when its function body runs*, so a test can
prove that a refused or replayed call never reached the function.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

from pydantic import BaseModel, Field

from warden_sdk import ToolContext, ToolFailure, ToolHost

host = ToolHost()


def effect(tool: str, ctx: ToolContext, **extra: object) -> None:
    line = {
        "tool": tool,
        "tenant": ctx.tenant,
        "run_id": ctx.run_id,
        "step_id": ctx.step_id,
        "attempt": ctx.attempt,
        "idempotency_key": ctx.idempotency_key,
        **extra,
    }
    with open(os.environ["HOSTAPP_EFFECTS"], "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())


@host.tool(name="py.add", effect="read_only", idempotent=True)
def add(a: int, b: int, ctx: ToolContext) -> int:
    """Adds two integers."""
    effect("py.add", ctx)
    return a + b


@host.tool(name="py.capture", idempotent=True)
def capture(note: str, ctx: ToolContext) -> dict[str, object]:
    """Records the verified request it was called with (the tests replay it directly)."""
    effect("py.capture", ctx, request=ctx.request.SerializeToString().hex())
    return {"note": note, "decision_id": ctx.decision_id, "ack_seq": ctx.request_ack.seq}


@host.tool(name="py.explode")
def explode(message: str, ctx: ToolContext) -> dict[str, object]:
    """Always raises ValueError(message)."""
    effect("py.explode", ctx)
    raise ValueError(message)


@host.tool(name="py.gated", effect="external")
def gated(amount: int, ctx: ToolContext) -> dict[str, int]:
    """A call policy holds for a human's approval."""
    effect("py.gated", ctx)
    return {"paid": amount}


def wait_for_release(gate: str) -> None:
    """Blocks until the test opens the FIFO ``gate`` for writing (see ``mesh.Gate``): the tool
    works exactly as long as the test wants, with no timing guessed on either side."""
    with open(gate, encoding="utf-8") as f:
        f.read()


@host.tool(name="py.slow", effect="read_only", idempotent=True, timeout_sec=30)
async def slow(ms: int, gate: str, ctx: ToolContext) -> dict[str, int]:
    """Works until the test releases ``gate`` (asynchronously); answers ``ms`` as given."""
    effect("py.slow", ctx)
    await asyncio.to_thread(wait_for_release, gate)
    return {"slept_ms": ms}


@host.tool(name="py.hang", timeout_sec=1)
def hang(ms: int, gate: str, ctx: ToolContext) -> dict[str, int]:
    """Works until the test releases ``gate`` — past its declared 1 s timeout, so its outcome
    is unknown to the executor."""
    effect("py.hang", ctx)
    wait_for_release(gate)
    return {"slept_ms": ms}


@host.tool(name="py.flaky", retry="standard", idempotent=True)
def flaky(succeed_on_attempt: int, ctx: ToolContext) -> dict[str, int]:
    """Fails retryably until attempt ``succeed_on_attempt``."""
    effect("py.flaky", ctx)
    if ctx.attempt < succeed_on_attempt:
        raise ToolFailure(f"attempt {ctx.attempt} failed", code="transient", retryable=True)
    return {"succeeded_on_attempt": ctx.attempt}


class Order(BaseModel):
    sku: str = Field(min_length=1)
    quantity: int = Field(ge=1, le=100)


class Quote(BaseModel):
    sku: str
    total_cents: int


@host.tool(name="py.quote", effect="read_only", idempotent=True)
def quote(order: Order) -> Quote:
    """Prices an order (a Pydantic model in, a Pydantic model out)."""
    return Quote(sku=order.sku, total_cents=order.quantity * 250)


if __name__ == "__main__":
    host.serve(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:0")
