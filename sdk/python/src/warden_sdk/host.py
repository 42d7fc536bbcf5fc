"""A framework for Warden tool hosts in Python.

Declare tools as plain (sync or async) functions; the host serves ``warden.v1.ToolHost`` and
does everything the contract demands around them, so a tool author cannot forget any of it:

* **Two proofs before the function runs.** Every ``Invoke`` must carry the policy's signed
  authorization for exactly this call (tenant, run, step, attempt, tool, SHA-256 of the RFC
  8785 arguments, idempotency key, unexpired; keys from ``Policy.GetVerificationKeys``) and
  the ledger's signed acknowledgement that the call's request is recorded (keys from
  ``Ledger.GetLedgerKeys``). Otherwise the answer is ``PERMISSION_DENIED`` and the function
  never runs — there is no code path that calls it unverified.
* **At most one effect per idempotency key.** The first outcome of each (tenant, key) is
  committed to SQLite before it is answered; a repeated call — concurrent, retried, or after
  the host restarted — gets it back with ``replayed=true``. A key reused for another tool or
  other arguments is ``FAILED_PRECONDITION``, never someone else's outcome.
* **Declarations from the code.** Input JSON Schema from the type hints (or a Pydantic
  model), validated before the call; output schema from the return annotation, validated
  after it; timeout, retry policy, effect class and idempotence declared on the decorator.
* **Failures are outcomes.** A raising tool is a recorded ``ToolError`` naming the exception
  type and message — the host's traceback stays in the host's log, never in the ledger.

This mirrors ``services/tools/src/lib.rs``, the Rust reference host, check for check.

Example::

    host = ToolHost(policy_endpoint="http://127.0.0.1:7100", ledger_endpoint="http://127.0.0.1:7100")

    @host.tool(effect="read_only", idempotent=True)
    def add(a: int, b: int) -> int:
        "Adds two integers."
        return a + b

    host.serve("127.0.0.1:7300")
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import functools
import inspect
import json
import logging
import os
import signal
import time
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, create_model

from .auth import (
    AckedCall,
    AuthError,
    AuthorizationClaims,
    CallIdentity,
    RequestAckClaims,
    public_key_from_bytes,
    verify_authorization,
    verify_request_ack,
)
from .canonical import JsonError, args_digest, canonical_json, parse_json, sha256_hex
from .client import channel_target
from .errors import DETAILS_KEY
from .ids import check_id, check_step_id, check_tool_name
from .store import Outcome, OutcomeStore, RecordedOutcome, StateError
from .v1 import common_pb2, ledger_pb2, ledger_pb2_grpc, policy_pb2, policy_pb2_grpc, toolhost_pb2, toolhost_pb2_grpc

__all__ = [
    "ToolHost",
    "ToolDefinition",
    "ToolContext",
    "ToolFailure",
    "InvokeRefused",
    "RetryPolicy",
    "Effect",
    "tool",
]

log = logging.getLogger("warden_sdk.host")

MAX_MESSAGE_BYTES = 8 << 20
"""Largest request a host takes (the Rust services' limit)."""

MAX_ERROR_MESSAGE = 2000
"""Longest error message recorded for a failed call: the ledger keeps it forever."""


class RetryPolicy(enum.Enum):
    """How often the executor tries a call whose failure the tool reports retryable."""

    NONE = common_pb2.RETRY_POLICY_NONE  # 1 attempt
    STANDARD = common_pb2.RETRY_POLICY_STANDARD  # 3 attempts
    AGGRESSIVE = common_pb2.RETRY_POLICY_AGGRESSIVE  # 5 attempts


class Effect(enum.Enum):
    """What a tool does to the world, as policy sees it (``ToolSpec.effect``)."""

    READ_ONLY = "read_only"
    """Reads only; no external side effect (Maple's "safe")."""
    WRITE = "write"
    """Changes state the tool owns (declared ``mutating``)."""
    EXTERNAL = "external"
    """Acts on the outside world (sends, calls out)."""
    CONSEQUENTIAL = "consequential"
    """Has side effects Maple calls consequential: every call needs an explicit commitment
    (a capability), whatever the policy's own ``consequential_tools`` says."""


_EFFECTS = {
    Effect.READ_ONLY: common_pb2.EFFECT_READ_ONLY,
    Effect.WRITE: common_pb2.EFFECT_MUTATING,
    Effect.EXTERNAL: common_pb2.EFFECT_EXTERNAL,
    Effect.CONSEQUENTIAL: common_pb2.EFFECT_CONSEQUENTIAL,
}


def effect_name(spec: common_pb2.ToolSpec) -> str:
    """A tool's effect class as authorizations name it (mirrors ``warden_grpc::catalog::effect_name``)."""
    named = {
        common_pb2.EFFECT_READ_ONLY: "read_only",
        common_pb2.EFFECT_MUTATING: "mutating",
        common_pb2.EFFECT_EXTERNAL: "external",
        common_pb2.EFFECT_CONSEQUENTIAL: "consequential",
    }
    return named.get(spec.effect) or (
        "consequential" if spec.consequential else "read_only" if spec.read_only else "mutating"
    )


def declaration_sha256(spec: common_pb2.ToolSpec) -> str:
    """The SHA-256 of a tool's declaration as authorizations bind it (mirrors
    ``warden_grpc::catalog::declaration_sha256``): RFC 8785 JSON of its name, version, effect
    class, risk level, idempotency and parsed input and output schemas."""

    def schema(text: str) -> Any:
        try:
            return parse_json(text) if text else None
        except JsonError:
            return None

    effect = effect_name(spec)
    risk = {
        common_pb2.RISK_LEVEL_LOW: "low",
        common_pb2.RISK_LEVEL_MEDIUM: "medium",
        common_pb2.RISK_LEVEL_HIGH: "high",
    }
    declaration = {
        "name": spec.name,
        "version": spec.version,
        "effect": effect,
        "risk_level": risk.get(spec.risk_level, "unspecified"),
        "idempotent": spec.idempotent,
        "input_schema": schema(spec.input_schema_json),
        "output_schema": schema(spec.output_schema_json),
    }
    return sha256_hex(canonical_json(declaration))


class ToolFailure(Exception):
    """Raise from a tool to fail the call with your own ``code`` (and say whether the
    executor may retry it). Any other exception fails the call too, with its type name as
    the code and never retryable unless the tool lists it in ``retry_on``."""

    def __init__(self, message: str, *, code: str = "tool_error", retryable: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable


@dataclass(frozen=True)
class ToolContext:
    """What a tool may know about its call beyond the arguments. Declare a parameter of
    this type to receive it; it is not part of the input schema. Everything here has been
    verified: ``tenant`` is bound into the signed authorization, so state keyed by it cannot
    be reached from another tenant's call."""

    tenant: str
    run_id: str
    step_id: str
    attempt: int
    tool: str
    idempotency_key: str
    authorization: AuthorizationClaims
    request_ack: RequestAckClaims
    request: toolhost_pb2.InvokeRequest

    @property
    def decision_id(self) -> str:
        return self.authorization.decision_id

    @property
    def capability_id(self) -> str:
        return self.authorization.capability_id


_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class ToolDefinition:
    """A declared tool: its function and everything derived from it."""

    name: str
    description: str
    function: Callable[..., Any]
    args_model: type[BaseModel]
    arg_names: tuple[str, ...]
    """The function's argument parameters (not the context), in order."""
    whole_model: bool
    """The function takes one Pydantic model holding every argument (not keyword args)."""
    context_param: str | None
    output_adapter: TypeAdapter[Any] | None
    timeout_sec: int
    retry: RetryPolicy
    effect: Effect
    idempotent: bool
    version: str
    retry_on: tuple[type[BaseException], ...]

    @functools.cached_property
    def input_schema(self) -> dict[str, Any]:
        """The JSON Schema of the arguments object (declared in ``ListTools``)."""
        return self.args_model.model_json_schema()

    @functools.cached_property
    def output_schema(self) -> dict[str, Any] | None:
        """The JSON Schema of the output (``None`` without a return annotation), declared as
        ``ToolSpec.output_schema_json``: the host validates outputs against it, and so does the
        executor before it records one."""
        return self.output_adapter.json_schema(mode="serialization") if self.output_adapter else None

    def spec(self) -> common_pb2.ToolSpec:
        return common_pb2.ToolSpec(
            name=self.name,
            description=self.description,
            input_schema_json=json.dumps(self.input_schema, sort_keys=True, separators=(",", ":")),
            timeout_sec=self.timeout_sec,
            idempotent=self.idempotent,
            consequential=self.effect is Effect.CONSEQUENTIAL,
            read_only=self.effect is Effect.READ_ONLY,
            version=self.version,
            retry_policy=self.retry.value,
            # Calls of tools that are not idempotent are marked started before they act.
            detects_in_doubt=True,
            effect=_EFFECTS[self.effect],
            output_schema_json=(
                json.dumps(self.output_schema, sort_keys=True, separators=(",", ":")) if self.output_schema else ""
            ),
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the function directly (for unit tests of the tool's own logic)."""
        return self.function(*args, **kwargs)


def _description(fn: Callable[..., Any]) -> str:
    doc = inspect.getdoc(fn) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def _coerce(value: Any, enum_type: type[enum.Enum], what: str) -> Any:
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        try:
            return enum_type[value.upper()]
        except KeyError:
            pass
    names = ", ".join(m.name.lower() for m in enum_type)
    raise ValueError(f"{what} must be one of {names}, not {value!r}")


def _define(
    fn: Callable[..., Any],
    *,
    name: str | None,
    description: str | None,
    timeout_sec: int,
    retry: RetryPolicy | str,
    effect: Effect | str,
    idempotent: bool,
    version: str,
    retry_on: Iterable[type[BaseException]],
) -> ToolDefinition:
    tool_name = name or fn.__name__
    why = check_tool_name(tool_name)
    if why:
        raise ValueError(f"tool name {tool_name!r} {why}")
    if not isinstance(timeout_sec, int) or not 0 <= timeout_sec <= 2**32 - 1:
        raise ValueError("timeout_sec must be a whole number of seconds (0: the executor's 60 s fallback)")
    hints = typing.get_type_hints(fn, include_extras=True)
    params = inspect.signature(fn).parameters
    context_param = None
    fields: dict[str, Any] = {}
    for p in params.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"tool {tool_name!r}: parameter {p.name!r} must be a named parameter")
        annotation = hints.get(p.name, Any)
        if annotation is ToolContext:
            context_param = p.name
            continue
        fields[p.name] = (annotation, ... if p.default is p.empty else p.default)
    model: type[BaseModel]
    whole = False
    only = next(iter(fields.values()))[0] if len(fields) == 1 else None
    if inspect.isclass(only) and issubclass(only, BaseModel):
        model, whole = only, True
    else:
        model = create_model(
            "".join(part.capitalize() for part in tool_name.replace("-", ".").replace("_", ".").split(".")) + "Args",
            __config__=ConfigDict(extra="forbid"),
            **fields,
        )
    returns = hints.get("return", inspect.Signature.empty)
    adapter = None if returns in (inspect.Signature.empty, Any) else TypeAdapter(returns)
    return ToolDefinition(
        name=tool_name,
        description=description if description is not None else _description(fn),
        function=fn,
        args_model=model,
        arg_names=tuple(fields),
        whole_model=whole,
        context_param=context_param,
        output_adapter=adapter,
        timeout_sec=timeout_sec,
        retry=_coerce(retry, RetryPolicy, "retry"),
        effect=_coerce(effect, Effect, "effect"),
        idempotent=idempotent,
        version=version,
        retry_on=tuple(retry_on),
    )


@overload
def tool(fn: _F, /) -> ToolDefinition: ...


@overload
def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_sec: int = 10,
    retry: RetryPolicy | str = RetryPolicy.NONE,
    effect: Effect | str = Effect.WRITE,
    idempotent: bool = False,
    version: str = "1",
    retry_on: Iterable[type[BaseException]] = (),
) -> Callable[[Callable[..., Any]], ToolDefinition]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_sec: int = 10,
    retry: RetryPolicy | str = RetryPolicy.NONE,
    effect: Effect | str = Effect.WRITE,
    idempotent: bool = False,
    version: str = "1",
    retry_on: Iterable[type[BaseException]] = (),
) -> ToolDefinition | Callable[[Callable[..., Any]], ToolDefinition]:
    """Declares a tool (register it with ``ToolHost(tools=[…])`` or :meth:`ToolHost.add`).

    - ``name``: the tool's name in plans (default: the function's name).
    - ``description``: default: the docstring's first paragraph.
    - ``timeout_sec``: the only source of the call's timeout (0: the executor's 60 s).
    - ``retry``: ``none`` (1 attempt), ``standard`` (3) or ``aggressive`` (5); only failures
      reported retryable are retried (:class:`ToolFailure` with ``retryable=True``, or an
      exception listed in ``retry_on``).
    - ``effect``: ``read_only``, ``write`` (the default: assume an effect) or
      ``consequential`` (Maple's class: declared in ``ToolSpec``; whether a call needs an
      explicit commitment is decided by policy's ``consequential_tools``).
    - ``idempotent``: running the call again changes nothing. The executor re-invokes only
      such tools when an outcome is unknown; the others go to an operator. Replaying recorded
      outcomes does not make a tool idempotent: a call in flight when the host dies has none.
    """

    def wrap(f: Callable[..., Any]) -> ToolDefinition:
        return _define(
            f,
            name=name,
            description=description,
            timeout_sec=timeout_sec,
            retry=retry,
            effect=effect,
            idempotent=idempotent,
            version=version,
            retry_on=retry_on,
        )

    return wrap(fn) if fn is not None else wrap


# --- refusals --------------------------------------------------------------------------------


class InvokeRefused(Exception):
    """A call the host answers with a gRPC error instead of an outcome: unproven
    (``PERMISSION_DENIED``), malformed (``INVALID_ARGUMENT``, ``field`` names what), a key
    reused for another call (``FAILED_PRECONDITION``), an unknown tool (``NOT_FOUND``), or
    state that cannot be read or written (``UNAVAILABLE``)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None, why: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.why = why

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        if self.field is None:
            return ()
        bad = error_details_pb2.BadRequest(
            field_violations=[error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.why)]
        )
        status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message=self.message)
        status.details.add().Pack(bad)
        return ((DETAILS_KEY, status.SerializeToString()),)


def _invalid_field(field: str, why: str) -> InvokeRefused:
    return InvokeRefused(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {why}", field, why)


def _now_ms() -> int:
    return int(time.time() * 1000)


# --- the host --------------------------------------------------------------------------------


@dataclass
class _Call:
    request: toolhost_pb2.InvokeRequest
    tool: ToolDefinition
    args: Any
    args_sha256: str
    context: ToolContext


def _response(outcome: Outcome, replayed: bool) -> toolhost_pb2.InvokeResponse:
    if outcome.output_json is not None:
        return toolhost_pb2.InvokeResponse(output_json=outcome.output_json, replayed=replayed)
    err = toolhost_pb2.ToolError(code=outcome.code, message=outcome.message, retryable=outcome.retryable)
    return toolhost_pb2.InvokeResponse(error=err, replayed=replayed)


class _KeyRing:
    """Verifying keys by id, refreshed from their publisher when an unknown id shows up
    (a rotated key), so a host needs no restart when policy or the ledger rotates."""

    def __init__(self, fetch: Callable[[], Awaitable[list[tuple[str, bytes]]]] | None) -> None:
        self._keys: dict[str, Ed25519PublicKey] = {}
        self._fetch = fetch

    def install(self, keys: Iterable[tuple[str, bytes]]) -> None:
        for kid, raw in keys:
            key = public_key_from_bytes(raw)
            if key is not None:
                self._keys[kid] = key

    def get(self, kid: str) -> Ed25519PublicKey | None:
        return self._keys.get(kid)

    async def refresh(self) -> None:
        if self._fetch is not None:
            self.install(await self._fetch())

    async def ensure(self, kid: str) -> None:
        """Asks the publisher once when ``kid`` is unknown; a failure leaves it unknown."""
        if kid and kid not in self._keys and self._fetch is not None:
            try:
                await self.refresh()
            except Exception as e:  # the call is then refused: unknown key
                log.warning("verification keys not refreshed: %s", e)


class _InFlight:
    """One lock per (tenant, key) with a call in progress: concurrent calls with a key take
    turns, so the tool runs at most once per key; an entry lives only while calls hold it."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, str], tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def turn(self, key: tuple[str, str]) -> Any:
        lock, holders = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, holders + 1)
        try:
            async with lock:
                yield
        finally:
            lock, holders = self._locks[key]
            if holders == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, holders - 1)

    def __len__(self) -> int:
        return len(self._locks)


class ToolHost:
    """Serves declared tools as a ``warden.v1.ToolHost``.

    - ``policy_endpoint`` / ``ledger_endpoint``: where the verification keys come from
      (default ``WARDEN_POLICY_ENDPOINT`` / ``WARDEN_LEDGER_ENDPOINT``, then
      ``WARDEN_ENDPOINT``, then ``http://127.0.0.1:7100``).
    - ``state_path``: the SQLite file of first outcomes (default ``WARDEN_TOOLS_STATE`` or
      ``warden-tools.db``). One host process owns a file.
    - ``token``: bearer token for fetching keys when the mesh has ``[auth] tokens``.
    - ``policy_keys`` / ``ledger_keys``: fixed ``{key_id: raw public key}`` instead of
      fetching (tests, air-gapped hosts). ``clock`` returns Unix milliseconds (tests).
    - ``max_workers``: threads for synchronous tools.
    """

    def __init__(
        self,
        tools: Iterable[ToolDefinition] = (),
        *,
        policy_endpoint: str | None = None,
        ledger_endpoint: str | None = None,
        state_path: str | os.PathLike[str] | None = None,
        token: str | None = None,
        policy_keys: Mapping[str, bytes] | None = None,
        ledger_keys: Mapping[str, bytes] | None = None,
        clock: Callable[[], int] = _now_ms,
        max_workers: int = 16,
    ) -> None:
        default = os.environ.get("WARDEN_ENDPOINT") or "http://127.0.0.1:7100"
        self.policy_endpoint = policy_endpoint or os.environ.get("WARDEN_POLICY_ENDPOINT") or default
        self.ledger_endpoint = ledger_endpoint or os.environ.get("WARDEN_LEDGER_ENDPOINT") or default
        self.store = OutcomeStore(state_path or os.environ.get("WARDEN_TOOLS_STATE") or "warden-tools.db")
        token = token if token is not None else os.environ.get("WARDEN_TOKEN")
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._clock = clock
        self._tools: dict[str, ToolDefinition] = {}
        self._channels: dict[str, aio.Channel] = {}
        self._policy_keys = _KeyRing(None if policy_keys is not None else self._fetch_policy_keys)
        self._ledger_keys = _KeyRing(None if ledger_keys is not None else self._fetch_ledger_keys)
        self._policy_keys.install((policy_keys or {}).items())
        self._ledger_keys.install((ledger_keys or {}).items())
        self._in_flight = _InFlight()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="warden-tool")
        self._server: aio.Server | None = None
        for t in tools:
            self.add(t)

    # --- declaring tools ------------------------------------------------------------------

    def add(self, definition: ToolDefinition | Callable[..., Any]) -> ToolDefinition:
        """Hosts a tool (a :func:`tool` definition, or a plain function with the defaults)."""
        d = definition if isinstance(definition, ToolDefinition) else tool(definition)
        if d.name in self._tools:
            raise ValueError(f"tool {d.name!r} is declared twice")
        self._tools[d.name] = d
        return d

    def tool(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        **options: Any,
    ) -> Any:
        """Declares and hosts a tool: ``@host.tool`` or ``@host.tool(name=…, …)`` with the
        options of :func:`tool`."""
        if fn is not None:
            return self.add(tool(fn, **options) if options else tool(fn))

        def wrap(f: Callable[..., Any]) -> ToolDefinition:
            return self.add(tool(**options)(f))

        return wrap

    @property
    def tools(self) -> Mapping[str, ToolDefinition]:
        return dict(self._tools)

    # --- keys -----------------------------------------------------------------------------

    def _channel(self, endpoint: str) -> aio.Channel:
        ch = self._channels.get(endpoint)
        if ch is None:
            target, tls = channel_target(endpoint)
            ch = aio.secure_channel(target, grpc.ssl_channel_credentials()) if tls else aio.insecure_channel(target)
            self._channels[endpoint] = ch
        return ch

    async def _fetch_policy_keys(self) -> list[tuple[str, bytes]]:
        stub: Any = policy_pb2_grpc.PolicyStub(self._channel(self.policy_endpoint))
        resp = await stub.GetVerificationKeys(
            policy_pb2.GetVerificationKeysRequest(), timeout=5, metadata=self._metadata
        )
        return [(k.key_id, k.public_key) for k in resp.keys]

    async def _fetch_ledger_keys(self) -> list[tuple[str, bytes]]:
        stub: Any = ledger_pb2_grpc.LedgerStub(self._channel(self.ledger_endpoint))
        resp = await stub.GetLedgerKeys(ledger_pb2.GetLedgerKeysRequest(), timeout=5, metadata=self._metadata)
        return [(k.key_id, k.public_key) for k in resp.keys]

    async def refresh_keys(self) -> None:
        """Fetches the policy's and the ledger's keys (done at start and on unknown ids)."""
        await self._policy_keys.refresh()
        await self._ledger_keys.refresh()

    # --- one call -------------------------------------------------------------------------

    async def _verify(
        self, r: toolhost_pb2.InvokeRequest, args_sha256: str
    ) -> tuple[AuthorizationClaims, RequestAckClaims]:
        """Both proofs every call needs before anything happens: policy allowed exactly this
        call, and the ledger durably recorded its request citing that allow."""
        auth = r.authorization if r.HasField("authorization") else None
        if auth is not None and auth.key_id:
            await self._policy_keys.ensure(auth.key_id)
        call = CallIdentity(
            tenant=r.tenant,
            run_id=r.run_id,
            step_id=r.step_id,
            attempt=r.attempt,
            tool=r.tool,
            args_sha256=args_sha256,
            idempotency_key=r.idempotency_key,
        )

        def refused(e: AuthError, what: str) -> InvokeRefused:
            log.warning(
                "refused unauthorized call: run_id=%s step_id=%s tool=%s error=%s", r.run_id, r.step_id, r.tool, e
            )
            return InvokeRefused(grpc.StatusCode.PERMISSION_DENIED, f"refused: {what}{e}")

        try:
            claims = verify_authorization(auth, self._policy_keys.get, call, self._clock())
        except AuthError as e:
            raise refused(e, "") from None
        # Decided for the tool as this host declares it now (class, version, schemas).
        # A milder class than declared, or a consequential tool's call decided without its
        # declaration, is refused (mirrors ``warden_core::auth::check_declaration``).
        definition = self._tools.get(r.tool)
        if definition is not None:
            spec = definition.spec()
            declared_effect = effect_name(spec)
            if claims.tool_sha256 and claims.tool_sha256 != declaration_sha256(spec):
                raise refused(AuthError.mismatch("tool_sha256"), "decided for another declaration of the tool: ")
            if claims.effect and claims.effect != declared_effect:
                raise refused(AuthError.mismatch("effect"), "decided for another declaration of the tool: ")
            if declared_effect == "consequential" and not (claims.tool_sha256 and claims.effect):
                raise refused(AuthError.undeclared(), "decided for another declaration of the tool: ")
        ack = r.request_ack if r.HasField("request_ack") else None
        if ack is not None and ack.key_id:
            await self._ledger_keys.ensure(ack.key_id)
        acked = AckedCall(
            tenant=r.tenant,
            run_id=r.run_id,
            step_id=r.step_id,
            attempt=r.attempt,
            decision_id=claims.decision_id,
            idempotency_key=r.idempotency_key,
        )
        try:
            ack_claims = verify_request_ack(ack, self._ledger_keys.get, acked)
        except AuthError as e:
            raise refused(e, "no ledger acknowledgement that the request is recorded: ") from None
        return claims, ack_claims

    @staticmethod
    def _replay(call: _Call, first: RecordedOutcome) -> toolhost_pb2.InvokeResponse:
        """``first`` answered as this call's outcome — only if it is this very call's: the
        authorization binds a key to one tool and argument digest, so a key met again with
        others means a caller reused it, and replaying would tell it something false."""
        r = call.request
        if first.tool != r.tool or first.args_sha256 != call.args_sha256:
            raise InvokeRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"idempotency key '{r.idempotency_key}' was first used for another call ({first.tool} with "
                f"arguments {first.args_sha256}); its outcome is not this call's",
            )
        return _response(first.outcome, replayed=True)

    async def _stored(self, call: _Call) -> RecordedOutcome | None:
        try:
            return await self.store.get(call.request.tenant, call.request.idempotency_key)
        except StateError as e:
            log.warning("outcomes unreadable; nothing was done: %s", e)
            raise InvokeRefused(grpc.StatusCode.UNAVAILABLE, f"outcomes unreadable; nothing was done: {e}") from None

    async def invoke(self, r: toolhost_pb2.InvokeRequest) -> toolhost_pb2.InvokeResponse:
        """Verifies and runs one call (the ``Invoke`` RPC without the transport). Raises
        ``InvokeRefused`` for gRPC errors; tool failures are outcomes in the response."""
        for field, value in (("tenant", r.tenant), ("run_id", r.run_id), ("idempotency_key", r.idempotency_key)):
            why = check_id(value)
            if why:
                raise _invalid_field(field, why)
        why = check_step_id(r.step_id)
        if why:
            raise _invalid_field("step_id", why)
        definition = self._tools.get(r.tool)
        if definition is None:
            raise InvokeRefused(grpc.StatusCode.NOT_FOUND, f"tool '{r.tool}' is not hosted here")
        try:
            args = parse_json(r.args_json)
            digest = args_digest(args)
        except JsonError as e:
            raise _invalid_field("args_json", f"not valid JSON: {e}") from None
        claims, ack = await self._verify(r, digest)
        context = ToolContext(
            tenant=r.tenant,
            run_id=r.run_id,
            step_id=r.step_id,
            attempt=r.attempt,
            tool=r.tool,
            idempotency_key=r.idempotency_key,
            authorization=claims,
            request_ack=ack,
            request=r,
        )
        call = _Call(request=r, tool=definition, args=args, args_sha256=digest, context=context)
        # The recorded outcome, if any, is read once, in turn with other calls of the key.
        # On its own task: a caller that hangs up (a timeout) must not stop the tool between
        # its effect and the recording of its outcome.
        task = asyncio.ensure_future(self._run_once(call))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _mark_started(self, call: _Call) -> None:
        """Marks a call of a tool that is not idempotent started before it acts. A mark
        without an outcome is a call that may have acted (the host stopped mid-call, or could
        not record the outcome): it is in doubt, answered UNKNOWN, and never run again."""
        r = call.request
        try:
            first = await self.store.mark_started(r.tenant, r.idempotency_key, self._clock())
        except StateError as e:
            log.warning("calls unmarkable; nothing was done: %s", e)
            raise InvokeRefused(grpc.StatusCode.UNAVAILABLE, f"calls unmarkable; nothing was done: {e}") from None
        if not first:
            log.warning("call in doubt: run %s step %s tool %s", r.run_id, r.step_id, r.tool)
            raise InvokeRefused(
                grpc.StatusCode.UNKNOWN,
                "in doubt: this call was started before and its outcome was never recorded (the host stopped "
                "mid-call); it may have acted, so it is not run again",
            )

    async def _run_once(self, call: _Call) -> toolhost_pb2.InvokeResponse:
        """Runs ``call`` unless its key has an outcome, and records the outcome before
        answering. Calls with one key take turns, so the tool runs at most once per key."""
        r = call.request
        async with self._in_flight.turn((r.tenant, r.idempotency_key)):
            # A call that held the turn before this one has recorded its outcome by now.
            first = await self._stored(call)
            if first is not None:
                return self._replay(call, first)
            if not call.tool.idempotent:
                await self._mark_started(call)
            outcome = await self._execute(call)
            ours = RecordedOutcome(tool=r.tool, args_sha256=call.args_sha256, outcome=outcome)
            try:
                stored, is_ours = await self.store.record(r.tenant, r.idempotency_key, ours, self._clock())
            except StateError as e:
                # Unrecorded, the outcome would not be replayed: the caller must treat it as
                # unknown (UNAVAILABLE is what the executor reads so) rather than rely on it.
                log.warning("the call ran but its outcome could not be recorded: %s", e)
                raise InvokeRefused(
                    grpc.StatusCode.UNAVAILABLE, f"the call ran but its outcome could not be recorded: {e}"
                ) from None
            if not is_ours:
                return self._replay(call, stored)
            return _response(stored.outcome, replayed=False)

    async def _execute(self, call: _Call) -> Outcome:
        """The tool's outcome: its validated output, or the failure it raised."""
        d = call.tool
        try:
            if not isinstance(call.args, dict):
                raise ToolFailure("arguments must be a JSON object", code="invalid_arguments")
            try:
                model = d.args_model.model_validate(call.args)
            except ValidationError as e:
                raise ToolFailure(_validation_message(e), code="invalid_arguments") from None
            if d.whole_model:
                kwargs: dict[str, Any] = {d.arg_names[0]: model}
            else:
                kwargs = {name: getattr(model, name) for name in d.arg_names}
            if d.context_param:
                kwargs[d.context_param] = call.context
            if inspect.iscoroutinefunction(d.function):
                result = await d.function(**kwargs)
            else:
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(self._threads, functools.partial(d.function, **kwargs))
            return Outcome(output_json=_output_json(d, result))
        except ToolFailure as f:
            return Outcome(code=f.code, message=_clip(f.message), retryable=f.retryable)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # The exception's type and message are the outcome; the traceback is the host's
            # business and stays in its log.
            log.warning(
                "tool %s raised %s (run_id=%s step_id=%s)",
                d.name,
                type(e).__name__,
                call.request.run_id,
                call.request.step_id,
                exc_info=True,
            )
            kind = type(e).__name__
            text = str(e)
            return Outcome(
                code=kind,
                message=_clip(f"{kind}: {text}" if text else kind),
                retryable=isinstance(e, d.retry_on) if d.retry_on else False,
            )

    # --- serving --------------------------------------------------------------------------

    async def start(self, listen: str = "127.0.0.1:0") -> str:
        """Opens the state file, fetches the keys (a failure is retried on the first call),
        and serves on ``listen``; returns the endpoint (``http://host:port``)."""
        self.store.open()
        try:
            await self.refresh_keys()
        except Exception as e:
            log.warning("verification keys not fetched yet; will fetch on first call: %s", e)
        server = aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        toolhost_pb2_grpc.add_ToolHostServicer_to_server(_Servicer(self), server)
        health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port(listen)
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set("warden.v1.ToolHost", health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        host = listen.rsplit(":", 1)[0] or "127.0.0.1"
        return f"http://{host}:{port}"

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stops serving (calls in progress get ``grace`` seconds), then closes the state."""
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for ch in self._channels.values():
            await ch.close(None)
        self._channels.clear()
        self.store.close()

    async def wait_for_termination(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

    async def serve_async(self, listen: str = "127.0.0.1:0") -> None:
        """Serves until SIGINT or SIGTERM. Prints ``WARDEN_LISTENING tools <endpoint>``, the
        line the Warden binaries print for supervisors and test harnesses."""
        endpoint = await self.start(listen)
        print(f"WARDEN_LISTENING tools {endpoint}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await self.stop()

    def serve(self, listen: str = "127.0.0.1:0") -> None:
        """Serves until SIGINT or SIGTERM (blocking; see :meth:`serve_async`)."""
        asyncio.run(self.serve_async(listen))


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_MESSAGE else text[: MAX_ERROR_MESSAGE - 1] + "…"


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False, include_input=False):
        loc = ".".join(str(x) for x in err.get("loc", ())) or "arguments"
        parts.append(f"'{loc}': {err.get('msg', 'invalid')}")
    return "invalid arguments: " + "; ".join(parts)


def _output_json(d: ToolDefinition, result: Any) -> str:
    """The output as JSON text, validated against the return annotation when there is one."""
    try:
        if d.output_adapter is not None:
            value = d.output_adapter.dump_python(d.output_adapter.validate_python(result), mode="json")
        else:
            value = TypeAdapter(Any).dump_python(result, mode="json")
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValidationError as e:
        raise ToolFailure(
            f"the tool's output does not match its declared type: {_validation_message(e)}", code="invalid_output"
        ) from None
    except (TypeError, ValueError) as e:
        raise ToolFailure(f"the tool's output is not JSON: {e}", code="invalid_output") from None


class _Servicer(toolhost_pb2_grpc.ToolHostServicer):
    def __init__(self, host: ToolHost) -> None:
        self._host = host

    async def ListTools(  # noqa: N802 (gRPC method name)
        self, request: common_pb2.ListToolsRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.ListToolsResponse:
        return common_pb2.ListToolsResponse(tools=[d.spec() for d in self._host._tools.values()])

    async def Invoke(  # noqa: N802 (gRPC method name)
        self, request: toolhost_pb2.InvokeRequest, context: aio.ServicerContext[Any, Any]
    ) -> toolhost_pb2.InvokeResponse:
        try:
            return await self._host.invoke(request)
        except InvokeRefused as r:
            await context.abort(r.code, r.message, trailing_metadata=r.trailing_metadata())
            raise AssertionError("unreachable") from None
