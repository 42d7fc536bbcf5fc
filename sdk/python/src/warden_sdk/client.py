"""Clients for a Warden mesh: :class:`AsyncClient` (``grpc.aio``) and :class:`Client` (blocking).

Both speak the same contract with the same method names; pick by the program around them.
They take the endpoints the CLI takes, from the same environment variables
(``WARDEN_ENDPOINT``, ``WARDEN_LEDGER_ENDPOINT``, ``WARDEN_POLICY_ENDPOINT``,
``WARDEN_TENANT``, ``WARDEN_TOKEN``; and ``WARDEN_PLANNER_ENDPOINT`` for the tool catalog):
``warden dev`` serves everything on one endpoint, the production shape has the executor
(runs), the ledger, the policy service and the planner apart.

Results are the contract's own messages (:mod:`warden_sdk.v1`, fully typed), except where
the contract carries JSON as text: :meth:`AsyncClient.trace` returns the parsed trace.
Refusals raise :class:`~warden_sdk.errors.WardenError` subclasses with the field violations
the services attach.

Verification comes in two strengths: :meth:`AsyncClient.verify_run` asks the ledger to
recompute its chain; :meth:`AsyncClient.verify_run_locally` trusts the ledger for nothing
but its public key — it downloads the run as an export and checks chain, receipts and signed
head here, with the algorithm of ``warden ledger verify-file``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, TypeVar

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from grpc import aio

from .canonical import JsonError, parse_json
from .chain import ChainedEvent, EventBody, Head, Receipt
from .errors import from_rpc_error
from .export import FORMAT, ExportReport, export_line, read_export_lines, verify_export
from .v1 import (
    common_pb2,
    ledger_pb2,
    ledger_pb2_grpc,
    planner_pb2_grpc,
    policy_pb2,
    policy_pb2_grpc,
    runs_pb2,
    runs_pb2_grpc,
)

__all__ = [
    "AsyncClient",
    "Client",
    "SETTLED",
    "TERMINAL",
    "status_name",
    "channel_target",
]

RS = common_pb2.RunStatus

TERMINAL = frozenset({RS.RUN_STATUS_COMPLETED, RS.RUN_STATUS_FAILED, RS.RUN_STATUS_CANCELLED, RS.RUN_STATUS_EMPTY_PLAN})
"""Statuses a run never leaves."""

SETTLED = TERMINAL | {RS.RUN_STATUS_BLOCKED, RS.RUN_STATUS_REQUIRES_RECONCILIATION, RS.RUN_STATUS_PAUSED}
"""Statuses in which a run waits for nobody but a person: terminal, blocked on an approval,
waiting for an operator to reconcile an unknown outcome, or paused until someone resumes it
(what ``run submit --wait`` stops at)."""

MAX_MESSAGE_BYTES = 64 << 20
"""Largest message the clients accept: traces and receipt pages of long runs are big."""

DEFAULT_TIMEOUT = 30.0

_CANCEL_POLICIES = {
    "immediate": common_pb2.CANCEL_POLICY_IMMEDIATE,
    "after_tool_call": common_pb2.CANCEL_POLICY_AFTER_TOOL_CALL,
    "after_token": common_pb2.CANCEL_POLICY_AFTER_TOKEN,
}

_APPROVAL_STATES = {
    "pending": policy_pb2.APPROVAL_STATE_PENDING,
    "approved": policy_pb2.APPROVAL_STATE_APPROVED,
    "denied": policy_pb2.APPROVAL_STATE_DENIED,
    "expired": policy_pb2.APPROVAL_STATE_EXPIRED,
}


def status_name(status: int) -> str:
    """``RUN_STATUS_COMPLETED`` → ``"completed"`` (the CLI's names)."""
    try:
        return RS.Name(status).removeprefix("RUN_STATUS_").lower()  # type: ignore[arg-type]
    except ValueError:
        return f"unknown({status})"


def channel_target(endpoint: str) -> tuple[str, bool]:
    """``http://h:p`` → (``h:p``, insecure); ``https://h:p`` → (``h:p``, TLS)."""
    if endpoint.startswith("https://"):
        return endpoint[len("https://") :].rstrip("/"), True
    if endpoint.startswith("http://"):
        return endpoint[len("http://") :].rstrip("/"), False
    return endpoint.rstrip("/"), False


_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def _plan_text(plan: Mapping[str, Any] | str) -> str:
    return plan if isinstance(plan, str) else json.dumps(plan, separators=(",", ":"), ensure_ascii=False)


def _cancel_policy(policy: str | int | None) -> int:
    if policy is None:
        return common_pb2.CANCEL_POLICY_UNSPECIFIED
    if isinstance(policy, int):
        return policy
    try:
        return _CANCEL_POLICIES[policy]
    except KeyError:
        raise ValueError(f"cancel_policy must be one of {sorted(_CANCEL_POLICIES)}, not {policy!r}") from None


def _approval_state(state: str | int | None) -> int:
    if state is None:
        return policy_pb2.APPROVAL_STATE_UNSPECIFIED
    if isinstance(state, int):
        return state
    try:
        return _APPROVAL_STATES[state]
    except KeyError:
        raise ValueError(f"state must be one of {sorted(_APPROVAL_STATES)}, not {state!r}") from None


def _submit_request(
    tenant: str,
    plan: Mapping[str, Any] | str | None,
    goal: str | None,
    idempotency_key: str | None,
    cancel_policy: str | int | None,
    agent: str | None,
    capability_handles: Sequence[str],
) -> runs_pb2.SubmitRunRequest:
    if (plan is None) == (goal is None):
        raise ValueError("give exactly one of plan and goal")
    return runs_pb2.SubmitRunRequest(
        tenant=tenant,
        plan_json=_plan_text(plan) if plan is not None else "",
        goal=goal or "",
        idempotency_key=idempotency_key or "",
        cancel_policy=_cancel_policy(cancel_policy),  # type: ignore[arg-type]
        agent=agent or "",
        capability_handles=list(capability_handles),
    )


def _reconcile_request(
    tenant: str, run_id: str, step_id: str, outcome: str, output: Any, operator: str
) -> runs_pb2.ReconcileStepRequest:
    if outcome not in ("completed", "failed"):
        raise ValueError("outcome must be 'completed' or 'failed'")
    return runs_pb2.ReconcileStepRequest(
        tenant=tenant,
        run_id=run_id,
        step_id=step_id,
        outcome=outcome,
        output_json="" if output is None else json.dumps(output, separators=(",", ":"), ensure_ascii=False),
        operator=operator,
    )


def _event_from_proto(e: common_pb2.Event) -> ChainedEvent:
    """As ``warden_grpc::convert::event_from_proto``: unparsable payload text stays a string."""
    try:
        payload: Any = parse_json(e.payload_json)
    except JsonError:
        payload = e.payload_json
    body = EventBody(
        run_id=e.run_id,
        seq=e.seq,
        event_type=e.event_type,
        payload=payload,
        step_id=e.step_id,
        epoch=e.epoch,
        idempotency_key=e.idempotency_key,
        timestamp_ms=e.timestamp_ms,
    )
    return ChainedEvent(body, e.prev_hash, e.hash)


def _receipt_from_proto(r: ledger_pb2.Receipt) -> Receipt:
    return Receipt(
        receipt_id=r.receipt_id,
        run_id=r.run_id,
        step_id=r.step_id,
        attempt=r.attempt,
        seq=r.seq,
        trace_id=r.trace_id,
        span_id=r.span_id,
        job_id=r.job_id,
        tx_id=r.tx_id,
        capability_id=r.capability_id,
        policy_decision=r.policy_decision,
        action_type=r.action_type,
        timestamp_ms=r.timestamp_ms,
        status=r.status,
        reason=r.reason,
        event_hash=r.event_hash,
        hash=r.hash,
    )


def _export_lines(
    run: ledger_pb2.LedgerRun,
    head: ledger_pb2.SignedHead,
    events: Iterable[common_pb2.Event],
    receipts: Iterable[ledger_pb2.Receipt],
) -> list[str]:
    """The lines ``warden run export`` writes: events and receipts cut at the signed head, so
    the file is a consistent snapshot even while the run moves."""
    lines = [
        export_line(
            {
                "format": FORMAT,
                "run_id": run.run_id,
                "tenant": run.tenant,
                "status": status_name(run.status),
                "exported_at_ms": int(time.time() * 1000),
            }
        )
    ]
    for e in events:
        if e.seq > head.seq:
            break
        lines.append(export_line(_event_from_proto(e)))
    lines.extend(export_line(_receipt_from_proto(r)) for r in receipts if r.seq <= head.seq)
    lines.append(
        export_line(
            Head(run_id=head.run_id, seq=head.seq, hash=head.hash),
            signature=head.signature.hex(),
            key_id=head.key_id,
            public_key=head.public_key.hex(),
        )
    )
    return lines


def _pinned(key: str | bytes | Ed25519PublicKey | None) -> Ed25519PublicKey | bytes | None:
    if isinstance(key, str):
        from .export import parse_public_key_hex

        return parse_public_key_hex(key)
    return key


_T = TypeVar("_T")


class _Settings:
    def __init__(
        self,
        endpoint: str | None,
        tenant: str | None,
        token: str | None,
        ledger_endpoint: str | None,
        policy_endpoint: str | None,
        planner_endpoint: str | None,
        timeout: float,
    ) -> None:
        self.endpoint = endpoint or os.environ.get("WARDEN_ENDPOINT") or "http://127.0.0.1:7100"
        self.planner_endpoint = planner_endpoint or os.environ.get("WARDEN_PLANNER_ENDPOINT") or self.endpoint
        self.ledger_endpoint = ledger_endpoint or os.environ.get("WARDEN_LEDGER_ENDPOINT") or self.endpoint
        self.policy_endpoint = policy_endpoint or os.environ.get("WARDEN_POLICY_ENDPOINT") or self.endpoint
        self.tenant = tenant or os.environ.get("WARDEN_TENANT") or "default"
        token = token if token is not None else os.environ.get("WARDEN_TOKEN")
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.timeout = timeout


class AsyncClient:
    """A Warden client for ``asyncio`` programs.

    >>> async with AsyncClient("http://127.0.0.1:7100", tenant="acme") as warden:
    ...     run = await warden.submit(plan={"steps": [...]})
    ...     done = await warden.wait(run.run_id)

    ``tenant`` is the tenant every request names (a tenant-scoped ``token`` must match it).
    Channels open lazily; close them with ``await client.close()`` or ``async with``.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        tenant: str | None = None,
        token: str | None = None,
        ledger_endpoint: str | None = None,
        policy_endpoint: str | None = None,
        planner_endpoint: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self._s = _Settings(endpoint, tenant, token, ledger_endpoint, policy_endpoint, planner_endpoint, timeout)
        self._channels: dict[str, aio.Channel] = {}

    @property
    def tenant(self) -> str:
        return self._s.tenant

    def _channel(self, endpoint: str) -> aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            target, tls = channel_target(endpoint)
            ch = (
                aio.secure_channel(target, grpc.ssl_channel_credentials(), options=_OPTIONS)
                if tls
                else aio.insecure_channel(target, options=_OPTIONS)
            )
            self._channels[endpoint] = ch
        return ch

    @property
    def _runs(self) -> runs_pb2_grpc.RunsAsyncStub:
        return runs_pb2_grpc.RunsStub(self._channel(self._s.endpoint))

    @property
    def _ledger(self) -> ledger_pb2_grpc.LedgerAsyncStub:
        return ledger_pb2_grpc.LedgerStub(self._channel(self._s.ledger_endpoint))

    @property
    def _policy(self) -> policy_pb2_grpc.PolicyAsyncStub:
        return policy_pb2_grpc.PolicyStub(self._channel(self._s.policy_endpoint))

    @property
    def _caps(self) -> policy_pb2_grpc.CapabilitiesAsyncStub:
        return policy_pb2_grpc.CapabilitiesStub(self._channel(self._s.policy_endpoint))

    @property
    def _approvals(self) -> policy_pb2_grpc.ApprovalsAsyncStub:
        return policy_pb2_grpc.ApprovalsStub(self._channel(self._s.policy_endpoint))

    @property
    def _planner(self) -> planner_pb2_grpc.PlannerAsyncStub:
        return planner_pb2_grpc.PlannerStub(self._channel(self._s.planner_endpoint))

    async def _call(self, fn: Callable[..., Awaitable[_T]], request: Any) -> _T:
        try:
            return await fn(request, timeout=self._s.timeout, metadata=self._s.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def _stream(self, fn: Callable[..., Any], request: Any) -> AsyncIterator[Any]:
        try:
            async for item in fn(request, metadata=self._s.metadata):
                yield item
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def close(self) -> None:
        """Closes every channel the client opened."""
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close(None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- runs -----------------------------------------------------------------------------

    async def submit(
        self,
        plan: Mapping[str, Any] | str | None = None,
        *,
        goal: str | None = None,
        idempotency_key: str | None = None,
        cancel_policy: str | int | None = None,
        agent: str | None = None,
        capability_handles: Sequence[str] = (),
    ) -> runs_pb2.SubmitRunResponse:
        """Submits a run from an explicit ``plan`` (a dict or JSON text) or a ``goal``.

        The plan is validated before anything is written; a bad one raises
        :class:`~warden_sdk.errors.InvalidArgument` naming the step. ``idempotency_key``
        makes a retried submission return the first run (``deduplicated``).
        """
        req = _submit_request(self.tenant, plan, goal, idempotency_key, cancel_policy, agent, capability_handles)
        return await self._call(self._runs.SubmitRun, req)

    async def get_run(self, run_id: str) -> runs_pb2.Run:
        return await self._call(self._runs.GetRun, runs_pb2.GetRunRequest(tenant=self.tenant, run_id=run_id))

    async def list_runs(
        self, statuses: Iterable[int] = (), *, page_size: int = 0, page_token: str = ""
    ) -> runs_pb2.ListRunsResponse:
        req = runs_pb2.ListRunsRequest(
            tenant=self.tenant,
            statuses=list(statuses),  # type: ignore[arg-type]
            page_size=page_size,
            page_token=page_token,
        )
        return await self._call(self._runs.ListRuns, req)

    async def wait(self, run_id: str, *, timeout: float | None = None, until: Iterable[int] = SETTLED) -> runs_pb2.Run:
        """Waits until the run is in one of ``until`` (default :data:`SETTLED`) and returns it.

        Polls ``GetRun`` with a backoff from 20 to 250 ms, as the CLI's ``--wait`` does.
        Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        wanted = frozenset(until)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while True:
            run = await self.get_run(run_id)
            if run.status in wanted:
                return run
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} is still {status_name(run.status)} after {timeout}s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)

    async def events(self, run_id: str, *, since_seq: int = 0, follow: bool = False) -> AsyncIterator[common_pb2.Event]:
        """The run's events after ``since_seq``; with ``follow``, new ones as they are
        recorded until the run ends (``warden run tail --follow``)."""
        req = ledger_pb2.StreamEventsRequest(tenant=self.tenant, run_id=run_id, since_seq=since_seq, follow=follow)
        async for e in self._stream(self._ledger.StreamEvents, req):
            yield e

    async def trace(self, run_id: str) -> dict[str, Any]:
        """The run's execution trace (steps, attempts, decisions, edges) as parsed JSON."""
        t = await self._call(self._runs.GetTrace, runs_pb2.GetRunRequest(tenant=self.tenant, run_id=run_id))
        parsed: dict[str, Any] = json.loads(t.trace_json)
        return parsed

    async def receipts(self, run_id: str, *, step_id: str = "") -> list[ledger_pb2.Receipt]:
        """Every receipt of the run (or of one step), in ledger order, across pages."""
        out: list[ledger_pb2.Receipt] = []
        after = 0
        while True:
            req = ledger_pb2.ListReceiptsRequest(
                tenant=self.tenant, run_id=run_id, step_id=step_id, page_size=5000, after_seq=after
            )
            page = await self._call(self._ledger.ListReceipts, req)
            out.extend(page.receipts)
            if page.next_after_seq == 0:
                return out
            after = page.next_after_seq

    async def cancel(self, run_id: str, *, reason: str = "") -> int:
        """Asks for the run to be cancelled under its declared cancel policy; returns the
        status it has now (cancellation completes asynchronously: :meth:`wait` for it)."""
        req = runs_pb2.CancelRunRequest(tenant=self.tenant, run_id=run_id, reason=reason)
        return (await self._call(self._runs.CancelRun, req)).status

    async def step_output(self, run_id: str, step_id: str) -> Any:
        """A completed step's output, whether recorded inline or stored by reference (an
        output over the executor's ``inline_output_max_bytes``)."""
        req = runs_pb2.GetStepOutputRequest(tenant=self.tenant, run_id=run_id, step_id=step_id)
        return json.loads((await self._call(self._runs.GetStepOutput, req)).output_json)

    async def pause(self, run_id: str, *, reason: str = "") -> int:
        """Asks for the run to be paused: nothing new starts, the steps in flight settle, then
        it is ``paused`` and holds no executor. Returns the status it has now (:meth:`wait`
        returns once the pause took effect)."""
        req = runs_pb2.PauseRunRequest(tenant=self.tenant, run_id=run_id, reason=reason)
        return (await self._call(self._runs.PauseRun, req)).status

    async def resume(self, run_id: str, *, reason: str = "") -> int:
        """Resumes a paused run; it goes on from where it stopped. Returns ``pending``."""
        req = runs_pb2.ResumeRunRequest(tenant=self.tenant, run_id=run_id, reason=reason)
        return (await self._call(self._runs.ResumeRun, req)).status

    async def reconcile(
        self, run_id: str, step_id: str, *, outcome: str, operator: str, output: Any = None
    ) -> runs_pb2.Run:
        """Records the outcome an operator established for a call whose outcome is unknown
        (``completed`` with ``output``, or ``failed``); the run then goes on."""
        req = _reconcile_request(self.tenant, run_id, step_id, outcome, output, operator)
        return await self._call(self._runs.ReconcileStep, req)

    async def tools(self) -> list[common_pb2.ToolSpec]:
        """The tool catalog: every tool host's declared tools, as the planner sees them."""
        resp = await self._call(self._planner.ListTools, common_pb2.ListToolsRequest(tenant=self.tenant))
        return list(resp.tools)

    # --- approvals ------------------------------------------------------------------------

    async def approvals(self, state: str | int | None = None) -> list[policy_pb2.Approval]:
        """The tenant's approvals (optionally in one state: ``"pending"``, …), across pages."""
        out: list[policy_pb2.Approval] = []
        token = ""
        while True:
            req = policy_pb2.ListApprovalsRequest(
                tenant=self.tenant,
                state=_approval_state(state),  # type: ignore[arg-type]
                page_size=500,
                page_token=token,
            )
            page = await self._call(self._approvals.List, req)
            out.extend(page.approvals)
            if not page.next_page_token:
                return out
            token = page.next_page_token

    async def get_approval(self, approval_id: str) -> policy_pb2.Approval:
        req = policy_pb2.GetApprovalRequest(tenant=self.tenant, approval_id=approval_id)
        return await self._call(self._approvals.Get, req)

    async def approve(self, approval_id: str, *, approver: str = "", reason: str = "") -> policy_pb2.Approval:
        """Approves a pending call (idempotent); the blocked run resumes."""
        req = policy_pb2.ResolveApprovalRequest(
            tenant=self.tenant, approval_id=approval_id, approver=approver, reason=reason
        )
        return await self._call(self._approvals.Approve, req)

    async def deny(self, approval_id: str, *, approver: str = "", reason: str = "") -> policy_pb2.Approval:
        """Denies a pending call (``human_denied``, never retried)."""
        req = policy_pb2.ResolveApprovalRequest(
            tenant=self.tenant, approval_id=approval_id, approver=approver, reason=reason
        )
        return await self._call(self._approvals.Deny, req)

    async def watch_approvals(self) -> AsyncIterator[policy_pb2.Approval]:
        """The tenant's approvals as they are, then each change, until cancelled."""
        req = policy_pb2.WatchApprovalsRequest(tenant=self.tenant)
        async for a in self._stream(self._approvals.Watch, req):
            yield a

    # --- capabilities ---------------------------------------------------------------------

    async def issue_capability(
        self,
        tool_patterns: Sequence[str],
        *,
        action_patterns: Sequence[str] = (),
        resource_patterns: Sequence[str] = (),
        ttl_seconds: int = 3600,
        run_id: str = "",
    ) -> policy_pb2.Capability:
        """Issues a capability; its secret ``handle`` is in this answer only."""
        req = policy_pb2.IssueCapabilityRequest(
            tenant=self.tenant,
            tool_patterns=list(tool_patterns),
            action_patterns=list(action_patterns),
            resource_patterns=list(resource_patterns),
            ttl_seconds=ttl_seconds,
            run_id=run_id,
        )
        return await self._call(self._caps.Issue, req)

    async def revoke_capability(self, capability_id: str, *, reason: str = "") -> policy_pb2.Capability:
        req = policy_pb2.RevokeCapabilityRequest(tenant=self.tenant, capability_id=capability_id, reason=reason)
        return await self._call(self._caps.Revoke, req)

    async def get_capability(self, capability_id: str) -> policy_pb2.Capability:
        req = policy_pb2.GetCapabilityRequest(tenant=self.tenant, capability_id=capability_id)
        return await self._call(self._caps.Get, req)

    async def capabilities(self) -> list[policy_pb2.Capability]:
        """The tenant's capabilities (public ids, never handles), across pages."""
        out: list[policy_pb2.Capability] = []
        token = ""
        while True:
            req = policy_pb2.ListCapabilitiesRequest(tenant=self.tenant, page_size=500, page_token=token)
            page = await self._call(self._caps.List, req)
            out.extend(page.capabilities)
            if not page.next_page_token:
                return out
            token = page.next_page_token

    async def attach_capability(
        self, run_id: str, handle: str, *, validate_only: bool = False
    ) -> policy_pb2.Capability:
        """Attaches a capability (by its handle) to a run, whose calls may then use it."""
        req = policy_pb2.AttachCapabilityRequest(
            tenant=self.tenant, run_id=run_id, capability_handle=handle, validate_only=validate_only
        )
        return await self._call(self._caps.Attach, req)

    # --- the ledger and verification ------------------------------------------------------

    async def verify_run(self, run_id: str) -> ledger_pb2.VerifyRunResponse:
        """Asks the ledger to recompute the run's chain (``valid`` or the first bad seq)."""
        req = ledger_pb2.VerifyRunRequest(tenant=self.tenant, run_id=run_id)
        return await self._call(self._ledger.VerifyRun, req)

    async def signed_head(self, run_id: str) -> ledger_pb2.SignedHead:
        req = ledger_pb2.GetSignedHeadRequest(tenant=self.tenant, run_id=run_id)
        return await self._call(self._ledger.GetSignedHead, req)

    async def ledger_keys(self) -> list[ledger_pb2.LedgerKey]:
        """The ledger's public keys (they sign chain heads and request acknowledgements)."""
        return list((await self._call(self._ledger.GetLedgerKeys, ledger_pb2.GetLedgerKeysRequest())).keys)

    async def verification_keys(self) -> list[policy_pb2.VerificationKey]:
        """The policy's public keys (they sign authorizations), current and previous."""
        req = policy_pb2.GetVerificationKeysRequest()
        return list((await self._call(self._policy.GetVerificationKeys, req)).keys)

    async def export_lines(self, run_id: str) -> list[str]:
        """The run as the lines of a ``warden run export`` file (without newlines)."""
        head = await self.signed_head(run_id)
        run = await self._call(self._ledger.GetRun, ledger_pb2.GetLedgerRunRequest(tenant=self.tenant, run_id=run_id))
        events = [e async for e in self.events(run_id)]
        receipts = await self.receipts(run_id)
        return _export_lines(run, head, events, receipts)

    async def export_run(self, run_id: str, out: IO[str] | str | os.PathLike[str]) -> int:
        """Writes the run's export (a file any auditor can check offline); returns its lines."""
        lines = await self.export_lines(run_id)
        _write_lines(out, lines)
        return len(lines)

    async def verify_run_locally(
        self, run_id: str, *, key: str | bytes | Ed25519PublicKey | None = None
    ) -> ExportReport:
        """Downloads the run and verifies chain, receipts and signed head here.

        ``key`` pins the ledger key to trust (hex, raw bytes or a key); without it the key
        the ledger embeds is used and its id reported. Raises
        :class:`~warden_sdk.export.ExportError` naming the first bad line and seq.
        """
        lines = await self.export_lines(run_id)
        return verify_export(read_export_lines("\n".join(lines).encode("utf-8")), _pinned(key))


def _write_lines(out: IO[str] | str | os.PathLike[str], lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if isinstance(out, (str, os.PathLike)):
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        out.write(text)


class Client:
    """A blocking Warden client; the same methods as :class:`AsyncClient`.

    >>> with Client("http://127.0.0.1:7100", tenant="acme") as warden:
    ...     run = warden.submit(plan={"steps": [...]})
    ...     done = warden.wait(run.run_id)

    Streams (:meth:`events`, :meth:`watch_approvals`) are ordinary iterators; break out of
    them to stop.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        tenant: str | None = None,
        token: str | None = None,
        ledger_endpoint: str | None = None,
        policy_endpoint: str | None = None,
        planner_endpoint: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        self._s = _Settings(endpoint, tenant, token, ledger_endpoint, policy_endpoint, planner_endpoint, timeout)
        self._channels: dict[str, grpc.Channel] = {}

    @property
    def tenant(self) -> str:
        return self._s.tenant

    def _channel(self, endpoint: str) -> grpc.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            target, tls = channel_target(endpoint)
            ch = (
                grpc.secure_channel(target, grpc.ssl_channel_credentials(), options=_OPTIONS)
                if tls
                else grpc.insecure_channel(target, options=_OPTIONS)
            )
            self._channels[endpoint] = ch
        return ch

    @property
    def _runs(self) -> runs_pb2_grpc.RunsStub:
        return runs_pb2_grpc.RunsStub(self._channel(self._s.endpoint))

    @property
    def _ledger(self) -> ledger_pb2_grpc.LedgerStub:
        return ledger_pb2_grpc.LedgerStub(self._channel(self._s.ledger_endpoint))

    @property
    def _policy(self) -> policy_pb2_grpc.PolicyStub:
        return policy_pb2_grpc.PolicyStub(self._channel(self._s.policy_endpoint))

    @property
    def _caps(self) -> policy_pb2_grpc.CapabilitiesStub:
        return policy_pb2_grpc.CapabilitiesStub(self._channel(self._s.policy_endpoint))

    @property
    def _approvals(self) -> policy_pb2_grpc.ApprovalsStub:
        return policy_pb2_grpc.ApprovalsStub(self._channel(self._s.policy_endpoint))

    @property
    def _planner(self) -> planner_pb2_grpc.PlannerStub:
        return planner_pb2_grpc.PlannerStub(self._channel(self._s.planner_endpoint))

    def _call(self, fn: Callable[..., _T], request: Any) -> _T:
        try:
            return fn(request, timeout=self._s.timeout, metadata=self._s.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def _stream(self, fn: Callable[..., Any], request: Any) -> Iterator[Any]:
        call = fn(request, metadata=self._s.metadata)
        try:
            yield from call
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    def close(self) -> None:
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- runs -----------------------------------------------------------------------------

    def submit(
        self,
        plan: Mapping[str, Any] | str | None = None,
        *,
        goal: str | None = None,
        idempotency_key: str | None = None,
        cancel_policy: str | int | None = None,
        agent: str | None = None,
        capability_handles: Sequence[str] = (),
    ) -> runs_pb2.SubmitRunResponse:
        """See :meth:`AsyncClient.submit`."""
        req = _submit_request(self.tenant, plan, goal, idempotency_key, cancel_policy, agent, capability_handles)
        return self._call(self._runs.SubmitRun, req)

    def get_run(self, run_id: str) -> runs_pb2.Run:
        return self._call(self._runs.GetRun, runs_pb2.GetRunRequest(tenant=self.tenant, run_id=run_id))

    def list_runs(
        self, statuses: Iterable[int] = (), *, page_size: int = 0, page_token: str = ""
    ) -> runs_pb2.ListRunsResponse:
        req = runs_pb2.ListRunsRequest(
            tenant=self.tenant,
            statuses=list(statuses),  # type: ignore[arg-type]
            page_size=page_size,
            page_token=page_token,
        )
        return self._call(self._runs.ListRuns, req)

    def wait(self, run_id: str, *, timeout: float | None = None, until: Iterable[int] = SETTLED) -> runs_pb2.Run:
        """See :meth:`AsyncClient.wait`."""
        wanted = frozenset(until)
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while True:
            run = self.get_run(run_id)
            if run.status in wanted:
                return run
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} is still {status_name(run.status)} after {timeout}s")
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def events(self, run_id: str, *, since_seq: int = 0, follow: bool = False) -> Iterator[common_pb2.Event]:
        """See :meth:`AsyncClient.events`."""
        req = ledger_pb2.StreamEventsRequest(tenant=self.tenant, run_id=run_id, since_seq=since_seq, follow=follow)
        return self._stream(self._ledger.StreamEvents, req)

    def trace(self, run_id: str) -> dict[str, Any]:
        t = self._call(self._runs.GetTrace, runs_pb2.GetRunRequest(tenant=self.tenant, run_id=run_id))
        parsed: dict[str, Any] = json.loads(t.trace_json)
        return parsed

    def receipts(self, run_id: str, *, step_id: str = "") -> list[ledger_pb2.Receipt]:
        out: list[ledger_pb2.Receipt] = []
        after = 0
        while True:
            req = ledger_pb2.ListReceiptsRequest(
                tenant=self.tenant, run_id=run_id, step_id=step_id, page_size=5000, after_seq=after
            )
            page = self._call(self._ledger.ListReceipts, req)
            out.extend(page.receipts)
            if page.next_after_seq == 0:
                return out
            after = page.next_after_seq

    def cancel(self, run_id: str, *, reason: str = "") -> int:
        req = runs_pb2.CancelRunRequest(tenant=self.tenant, run_id=run_id, reason=reason)
        return self._call(self._runs.CancelRun, req).status

    def step_output(self, run_id: str, step_id: str) -> Any:
        req = runs_pb2.GetStepOutputRequest(tenant=self.tenant, run_id=run_id, step_id=step_id)
        return json.loads(self._call(self._runs.GetStepOutput, req).output_json)

    def pause(self, run_id: str, *, reason: str = "") -> int:
        req = runs_pb2.PauseRunRequest(tenant=self.tenant, run_id=run_id, reason=reason)
        return self._call(self._runs.PauseRun, req).status

    def resume(self, run_id: str, *, reason: str = "") -> int:
        req = runs_pb2.ResumeRunRequest(tenant=self.tenant, run_id=run_id, reason=reason)
        return self._call(self._runs.ResumeRun, req).status

    def reconcile(self, run_id: str, step_id: str, *, outcome: str, operator: str, output: Any = None) -> runs_pb2.Run:
        req = _reconcile_request(self.tenant, run_id, step_id, outcome, output, operator)
        return self._call(self._runs.ReconcileStep, req)

    def tools(self) -> list[common_pb2.ToolSpec]:
        return list(self._call(self._planner.ListTools, common_pb2.ListToolsRequest(tenant=self.tenant)).tools)

    # --- approvals ------------------------------------------------------------------------

    def approvals(self, state: str | int | None = None) -> list[policy_pb2.Approval]:
        out: list[policy_pb2.Approval] = []
        token = ""
        while True:
            req = policy_pb2.ListApprovalsRequest(
                tenant=self.tenant,
                state=_approval_state(state),  # type: ignore[arg-type]
                page_size=500,
                page_token=token,
            )
            page = self._call(self._approvals.List, req)
            out.extend(page.approvals)
            if not page.next_page_token:
                return out
            token = page.next_page_token

    def get_approval(self, approval_id: str) -> policy_pb2.Approval:
        return self._call(
            self._approvals.Get, policy_pb2.GetApprovalRequest(tenant=self.tenant, approval_id=approval_id)
        )

    def approve(self, approval_id: str, *, approver: str = "", reason: str = "") -> policy_pb2.Approval:
        req = policy_pb2.ResolveApprovalRequest(
            tenant=self.tenant, approval_id=approval_id, approver=approver, reason=reason
        )
        return self._call(self._approvals.Approve, req)

    def deny(self, approval_id: str, *, approver: str = "", reason: str = "") -> policy_pb2.Approval:
        req = policy_pb2.ResolveApprovalRequest(
            tenant=self.tenant, approval_id=approval_id, approver=approver, reason=reason
        )
        return self._call(self._approvals.Deny, req)

    def watch_approvals(self) -> Iterator[policy_pb2.Approval]:
        return self._stream(self._approvals.Watch, policy_pb2.WatchApprovalsRequest(tenant=self.tenant))

    # --- capabilities ---------------------------------------------------------------------

    def issue_capability(
        self,
        tool_patterns: Sequence[str],
        *,
        action_patterns: Sequence[str] = (),
        resource_patterns: Sequence[str] = (),
        ttl_seconds: int = 3600,
        run_id: str = "",
    ) -> policy_pb2.Capability:
        req = policy_pb2.IssueCapabilityRequest(
            tenant=self.tenant,
            tool_patterns=list(tool_patterns),
            action_patterns=list(action_patterns),
            resource_patterns=list(resource_patterns),
            ttl_seconds=ttl_seconds,
            run_id=run_id,
        )
        return self._call(self._caps.Issue, req)

    def revoke_capability(self, capability_id: str, *, reason: str = "") -> policy_pb2.Capability:
        req = policy_pb2.RevokeCapabilityRequest(tenant=self.tenant, capability_id=capability_id, reason=reason)
        return self._call(self._caps.Revoke, req)

    def get_capability(self, capability_id: str) -> policy_pb2.Capability:
        return self._call(
            self._caps.Get, policy_pb2.GetCapabilityRequest(tenant=self.tenant, capability_id=capability_id)
        )

    def capabilities(self) -> list[policy_pb2.Capability]:
        out: list[policy_pb2.Capability] = []
        token = ""
        while True:
            req = policy_pb2.ListCapabilitiesRequest(tenant=self.tenant, page_size=500, page_token=token)
            page = self._call(self._caps.List, req)
            out.extend(page.capabilities)
            if not page.next_page_token:
                return out
            token = page.next_page_token

    def attach_capability(self, run_id: str, handle: str, *, validate_only: bool = False) -> policy_pb2.Capability:
        req = policy_pb2.AttachCapabilityRequest(
            tenant=self.tenant, run_id=run_id, capability_handle=handle, validate_only=validate_only
        )
        return self._call(self._caps.Attach, req)

    # --- the ledger and verification ------------------------------------------------------

    def verify_run(self, run_id: str) -> ledger_pb2.VerifyRunResponse:
        return self._call(self._ledger.VerifyRun, ledger_pb2.VerifyRunRequest(tenant=self.tenant, run_id=run_id))

    def signed_head(self, run_id: str) -> ledger_pb2.SignedHead:
        req = ledger_pb2.GetSignedHeadRequest(tenant=self.tenant, run_id=run_id)
        return self._call(self._ledger.GetSignedHead, req)

    def ledger_keys(self) -> list[ledger_pb2.LedgerKey]:
        return list(self._call(self._ledger.GetLedgerKeys, ledger_pb2.GetLedgerKeysRequest()).keys)

    def verification_keys(self) -> list[policy_pb2.VerificationKey]:
        return list(self._call(self._policy.GetVerificationKeys, policy_pb2.GetVerificationKeysRequest()).keys)

    def export_lines(self, run_id: str) -> list[str]:
        head = self.signed_head(run_id)
        run = self._call(self._ledger.GetRun, ledger_pb2.GetLedgerRunRequest(tenant=self.tenant, run_id=run_id))
        events = list(self.events(run_id))
        return _export_lines(run, head, events, self.receipts(run_id))

    def export_run(self, run_id: str, out: IO[str] | str | os.PathLike[str]) -> int:
        lines = self.export_lines(run_id)
        _write_lines(out, lines)
        return len(lines)

    def verify_run_locally(self, run_id: str, *, key: str | bytes | Ed25519PublicKey | None = None) -> ExportReport:
        lines = self.export_lines(run_id)
        return verify_export(read_export_lines("\n".join(lines).encode("utf-8")), _pinned(key))
