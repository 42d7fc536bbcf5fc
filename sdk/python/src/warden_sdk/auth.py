"""Verification of the two proofs a tool host needs before it acts.

1. The **authorization**: the policy service's Ed25519-signed statement that one exact call —
   tenant, run, step, attempt, tool, SHA-256 of the canonical arguments, idempotency key —
   is allowed until an expiry (``libs/core/src/auth.rs``).
2. The **request acknowledgement**: the ledger's Ed25519-signed statement that this call's
   ``tool_requested`` event, citing that allow, is durably recorded (``libs/core/src/ack.rs``).

An authorization alone would let anyone holding one (a tenant asking policy directly) cause
an effect the ledger never saw; the acknowledgement closes that gap. Both are checked here
exactly as the Rust reference host checks them, in the same order and with the same error
texts, so a refusal reads the same whichever language the host is written in.

Claims are parsed as strictly as ``serde_json`` parses them into ``#[serde(deny_unknown_fields)]``
structs: a missing, unknown, duplicated or mistyped field makes the claims malformed — a
signature over bytes we would read differently than the signer meant proves nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .canonical import JsonError, canonical_bytes, parse_json, sha256_hex

__all__ = [
    "AuthError",
    "AuthorizationClaims",
    "RequestAckClaims",
    "CallIdentity",
    "AckedCall",
    "SignedClaims",
    "KeyLookup",
    "KIND_TOOL_REQUESTED",
    "key_id",
    "public_key_from_bytes",
    "verify_authorization",
    "verify_request_ack",
    "decision_id",
    "sign_claims",
]

KIND_TOOL_REQUESTED = "tool_requested"
"""The only ``kind`` of request acknowledgement there is."""

_U32 = (0, 2**32 - 1)
_U64 = (0, 2**64 - 1)
_I64 = (-(2**63), 2**63 - 1)


class AuthError(Exception):
    """Why a signed statement does not authorize the call in hand.

    ``kind`` is one of ``missing``, ``unknown_key``, ``bad_signature``, ``malformed``,
    ``expired``, ``mismatch`` (then ``field`` names the claim that differs) and ``undeclared``
    (a consequential tool's call decided without naming its declaration).
    """

    def __init__(self, kind: str, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.field = field

    @classmethod
    def undeclared(cls) -> AuthError:
        return cls("undeclared", "authorization names no tool declaration, and the tool is consequential")

    @classmethod
    def missing(cls) -> AuthError:
        return cls("missing", "authorization is missing")

    @classmethod
    def unknown_key(cls, kid: str) -> AuthError:
        return cls("unknown_key", f"authorization is signed by unknown key '{kid}'")

    @classmethod
    def bad_signature(cls) -> AuthError:
        return cls("bad_signature", "authorization signature does not verify")

    @classmethod
    def malformed(cls, why: str) -> AuthError:
        return cls("malformed", f"authorization claims are malformed: {why}")

    @classmethod
    def expired(cls, expired_at_ms: int, now_ms: int) -> AuthError:
        return cls("expired", f"authorization expired at {expired_at_ms} (now {now_ms})")

    @classmethod
    def mismatch(cls, field: str) -> AuthError:
        return cls("mismatch", f"authorization is for another call: {field} does not match", field=field)


class SignedClaims(Protocol):
    """Claims bytes plus signature, as carried on the wire (``warden.v1.SignedAuthorization``)."""

    @property
    def claims_json(self) -> bytes: ...

    @property
    def signature(self) -> bytes: ...

    @property
    def key_id(self) -> str: ...


KeyLookup = Callable[[str], "Ed25519PublicKey | None"]
"""Finds a verifying key by its id (``None``: unknown)."""


@dataclass(frozen=True)
class AuthorizationClaims:
    """What the policy service signed (``AuthorizationClaims`` in ``libs/core/src/auth.rs``)."""

    v: int
    key_id: str
    decision_id: str
    tenant: str
    run_id: str
    step_id: str
    attempt: int
    tool: str
    args_sha256: str
    idempotency_key: str
    capability_id: str
    issued_at_ms: int
    expires_at_ms: int
    # The tool's declaration the run pinned, when the authorization names one.
    tool_version: str = ""
    tool_sha256: str = ""
    effect: str = ""


# Claims the policy adds only when the call names the tool's declaration (serde's
# `#[serde(default)]` fields of `AuthorizationClaims`).
_AUTH_OPTIONAL: dict[str, Any] = {"tool_version": str, "tool_sha256": str, "effect": str}

_AUTH_FIELDS: dict[str, Any] = {
    "v": _U32,
    "key_id": str,
    "decision_id": str,
    "tenant": str,
    "run_id": str,
    "step_id": str,
    "attempt": _U32,
    "tool": str,
    "args_sha256": str,
    "idempotency_key": str,
    "capability_id": str,
    "issued_at_ms": _I64,
    "expires_at_ms": _I64,
}


@dataclass(frozen=True)
class RequestAckClaims:
    """What the ledger signed (``RequestAckClaims`` in ``libs/core/src/ack.rs``)."""

    v: int
    kind: str
    key_id: str
    tenant: str
    run_id: str
    step_id: str
    attempt: int
    decision_id: str
    idempotency_key: str
    seq: int
    event_hash: str


_ACK_FIELDS: dict[str, Any] = {
    "v": _U32,
    "kind": str,
    "key_id": str,
    "tenant": str,
    "run_id": str,
    "step_id": str,
    "attempt": _U32,
    "decision_id": str,
    "idempotency_key": str,
    "seq": _U64,
    "event_hash": str,
}


@dataclass(frozen=True)
class CallIdentity:
    """What the call in hand claims to be; compared field by field with the authorization."""

    tenant: str
    run_id: str
    step_id: str
    attempt: int
    tool: str
    args_sha256: str
    idempotency_key: str


@dataclass(frozen=True)
class AckedCall:
    """What the call in hand claims; compared field by field with the acknowledgement."""

    tenant: str
    run_id: str
    step_id: str
    attempt: int
    decision_id: str
    idempotency_key: str


def key_id(public_key: Ed25519PublicKey | bytes) -> str:
    """The id of a verification key: the first 16 hex chars of SHA-256 of its raw bytes."""
    raw = public_key if isinstance(public_key, bytes) else _raw(public_key)
    return sha256_hex(raw)[:16]


def _raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def public_key_from_bytes(raw: bytes) -> Ed25519PublicKey | None:
    """A verifying key from its raw 32 bytes; ``None`` when they are not a valid key."""
    if len(raw) != 32:
        return None
    try:
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        return None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise JsonError(f"duplicate field `{k}`")
        out[k] = v
    return out


_C = TypeVar("_C")


def _parse_claims(
    raw: bytes, fields: Mapping[str, Any], cls: type[_C], optional: Mapping[str, Any] | None = None
) -> _C:
    """Reads ``raw`` into ``cls`` the way serde reads a ``deny_unknown_fields`` struct."""
    try:
        # serde refuses a struct field given twice; claims hold no nested objects.
        value = parse_json(raw, object_pairs_hook=_no_duplicates)
    except JsonError as e:
        raise AuthError.malformed(str(e)) from e
    if not isinstance(value, dict):
        raise AuthError.malformed(f"invalid type: expected struct {cls.__name__}")
    optional = optional or {}
    for k in value:
        if k not in fields and k not in optional:
            raise AuthError.malformed(f"unknown field `{k}`")
    out: dict[str, Any] = {}
    for name, kind in {**fields, **optional}.items():
        if name not in value:
            if name in optional:
                continue
            raise AuthError.malformed(f"missing field `{name}`")
        v = value[name]
        if kind is str:
            if not isinstance(v, str):
                raise AuthError.malformed(f"invalid type for `{name}`: expected a string")
        else:
            lo, hi = kind
            if isinstance(v, bool) or not isinstance(v, int):
                raise AuthError.malformed(f"invalid type for `{name}`: expected an integer")
            if not lo <= v <= hi:
                raise AuthError.malformed(f"invalid value for `{name}`: {v} is out of range")
        out[name] = v
    return cls(**out)


def _check_signature(signed: SignedClaims, keys: KeyLookup) -> None:
    if not signed.claims_json and not signed.signature:
        raise AuthError.missing()
    key = keys(signed.key_id)
    if key is None:
        raise AuthError.unknown_key(signed.key_id)
    if len(signed.signature) != 64:
        raise AuthError.bad_signature()
    try:
        key.verify(bytes(signed.signature), bytes(signed.claims_json))
    except InvalidSignature as e:
        raise AuthError.bad_signature() from e


def verify_authorization(
    signed: SignedClaims | None,
    keys: KeyLookup | Mapping[str, Ed25519PublicKey],
    call: CallIdentity,
    now_ms: int,
) -> AuthorizationClaims:
    """Verifies signature, expiry and binding of an authorization; returns its claims.

    Mirrors ``warden_core::auth::verify``: missing → unknown key → signature → claims →
    ``key_id`` → expiry (``now_ms >= expires_at_ms`` is expired) → tenant, run_id, step_id,
    attempt, tool, args_sha256, idempotency_key, in that order. Raises :class:`AuthError`.
    """
    lookup = _lookup(keys)
    if signed is None:
        raise AuthError.missing()
    _check_signature(signed, lookup)
    claims = _parse_claims(bytes(signed.claims_json), _AUTH_FIELDS, AuthorizationClaims, _AUTH_OPTIONAL)
    if claims.key_id != signed.key_id:
        raise AuthError.mismatch("key_id")
    if now_ms >= claims.expires_at_ms:
        raise AuthError.expired(claims.expires_at_ms, now_ms)
    for name in ("tenant", "run_id", "step_id", "attempt", "tool", "args_sha256", "idempotency_key"):
        if getattr(claims, name) != getattr(call, name):
            raise AuthError.mismatch(name)
    return claims


def verify_request_ack(
    signed: SignedClaims | None,
    keys: KeyLookup | Mapping[str, Ed25519PublicKey],
    call: AckedCall,
) -> RequestAckClaims:
    """Verifies the ledger's acknowledgement that ``call``'s request is recorded.

    Mirrors ``warden_core::ack::verify_ack``. Acknowledgements do not expire: what is
    recorded stays recorded (the authorization they accompany does expire). Raises
    :class:`AuthError`.
    """
    lookup = _lookup(keys)
    if signed is None:
        raise AuthError.missing()
    _check_signature(signed, lookup)
    claims = _parse_claims(bytes(signed.claims_json), _ACK_FIELDS, RequestAckClaims)
    if claims.key_id != signed.key_id:
        raise AuthError.mismatch("key_id")
    if claims.kind != KIND_TOOL_REQUESTED:
        raise AuthError.mismatch("kind")
    for name in ("tenant", "run_id", "step_id", "attempt", "decision_id", "idempotency_key"):
        if getattr(claims, name) != getattr(call, name):
            raise AuthError.mismatch(name)
    return claims


def _lookup(keys: KeyLookup | Mapping[str, Ed25519PublicKey]) -> KeyLookup:
    if isinstance(keys, Mapping):
        return keys.get
    return keys


def decision_id(call: CallIdentity, capability_id: str = "") -> str:
    """The deterministic id policy gives the decision about ``call`` (32 hex chars).

    ``capability_id`` is followed by the decision's gate when it has one: a decision asked for
    while its run was being created (its record names ``plan_sha256``) is derived from
    ``capability_id + "|plan:" + plan_sha256[:16]``.
    """
    material = canonical_bytes(
        [
            call.tenant,
            call.run_id,
            call.step_id,
            call.attempt,
            call.tool,
            call.args_sha256,
            call.idempotency_key,
            capability_id,
        ]
    )
    return sha256_hex(material)[:32]


@dataclass(frozen=True)
class _Signed:
    claims_json: bytes
    signature: bytes
    key_id: str


def sign_claims(claims: AuthorizationClaims | RequestAckClaims, key: Ed25519PrivateKey) -> _Signed:
    """Signs ``claims`` as policy (or, for an acknowledgement, the ledger) would.

    ``key_id`` is set to the signer's (and ``kind`` of an acknowledgement to
    ``tool_requested``). Used by :mod:`warden_sdk.testing` to exercise a host's verification
    without a mesh; a real host never signs.
    """
    kid = key_id(key.public_key())
    changes: dict[str, Any] = {"key_id": kid}
    if isinstance(claims, RequestAckClaims):
        changes["kind"] = KIND_TOOL_REQUESTED
    claims = dataclasses.replace(claims, **changes)
    raw = canonical_bytes(dataclasses.asdict(claims))
    return _Signed(claims_json=raw, signature=key.sign(raw), key_id=kid)
