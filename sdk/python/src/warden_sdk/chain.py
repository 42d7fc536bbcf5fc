"""The per-run hash chain, signed heads and receipts, as ``libs/core`` defines them.

* ``hash = SHA-256(prev_hash ‖ RFC 8785 JSON of the event body)``; the body carries the
  event's position (``run_id``, ``seq``), so removing or reordering events breaks the chain
  even when payloads repeat (``chain.rs``).
* The ledger signs ``{"hash", "run_id", "seq"}`` of a run's last event with Ed25519
  (``head.rs``), so an export can be checked with no server.
* A receipt is derived deterministically from its outcome event (``receipt.rs``), so a
  verifier recomputes each one instead of trusting it.

Everything here is pure: no I/O, no gRPC. :mod:`warden_sdk.export` reads export files with
it, and :class:`warden_sdk.Client` uses it to check a run's events as it streams them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .canonical import canonical_bytes, sha256_hex

__all__ = [
    "GENESIS_HASH",
    "EventBody",
    "ChainedEvent",
    "ChainBreak",
    "ChainVerifier",
    "Head",
    "Receipt",
    "receipt_for",
    "receipt_id",
    "expected_capability",
    "trace_id",
    "span_id",
    "text_field",
]

GENESIS_HASH = "0" * 64
"""``prev_hash`` of the first event of every run."""

TOOL_COMPLETED = "tool_completed"
TOOL_FAILED = "tool_failed"
STEP_FAILED = "step_failed"
STEP_CANCELLED = "step_cancelled"
TX_COMMITTED = "tx_committed"
TX_ROLLED_BACK = "tx_rolled_back"
POLICY_DECISION = "policy_decision"


@dataclass(frozen=True)
class EventBody:
    """The hashed content of one ledger event."""

    run_id: str
    seq: int
    event_type: str
    payload: Any
    step_id: str
    epoch: int
    idempotency_key: str
    timestamp_ms: int

    def chain_hash(self, prev_hash: str) -> str:
        """The chained hash of this body after ``prev_hash``."""
        h = hashlib.sha256(prev_hash.encode("utf-8"))
        h.update(canonical_bytes(asdict(self)))
        return h.hexdigest()


@dataclass(frozen=True)
class ChainedEvent:
    """An event as stored: its body plus the links."""

    body: EventBody
    prev_hash: str
    hash: str


class ChainBreak(Exception):
    """Where (the seq expected at that position) and why a chain stops verifying."""

    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(f"chain breaks at seq {seq}: {reason}")
        self.seq = seq
        self.reason = reason


@dataclass
class ChainVerifier:
    """Incremental verifier: feed events in stored order; the first break is raised."""

    run_id: str | None = None
    expected_seq: int = 1
    prev_hash: str = GENESIS_HASH

    def push(self, event: ChainedEvent) -> None:
        seq = self.expected_seq
        if self.run_id is None:
            self.run_id = event.body.run_id
        if event.body.run_id != self.run_id:
            raise ChainBreak(seq, f"event belongs to run {event.body.run_id}")
        if event.body.seq != seq:
            raise ChainBreak(seq, f"expected seq {seq}, found seq {event.body.seq}")
        if event.prev_hash != self.prev_hash:
            raise ChainBreak(seq, "prev_hash does not link to the previous event")
        if event.body.chain_hash(self.prev_hash) != event.hash:
            raise ChainBreak(seq, "hash does not match the event's content")
        self.prev_hash = event.hash
        self.expected_seq += 1

    @property
    def verified(self) -> int:
        """Number of events verified so far."""
        return self.expected_seq - 1

    @property
    def head(self) -> str:
        """Hash of the last verified event."""
        return self.prev_hash


@dataclass(frozen=True)
class Head:
    """A run's chain head: what the ledger signs."""

    run_id: str
    seq: int
    hash: str

    def message(self) -> bytes:
        return canonical_bytes({"run_id": self.run_id, "seq": self.seq, "hash": self.hash})

    def verify(self, signature: bytes, key: Ed25519PublicKey) -> bool:
        if len(signature) != 64:
            return False
        try:
            key.verify(signature, self.message())
        except InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class Receipt:
    """SPEC-KERN-01 §5 receipt of one tool call outcome (or transaction), as exported."""

    receipt_id: str
    run_id: str
    step_id: str
    attempt: int
    seq: int
    trace_id: str
    span_id: str
    job_id: str
    tx_id: str
    capability_id: str
    policy_decision: str
    action_type: str
    timestamp_ms: int
    status: str
    reason: str
    event_hash: str
    hash: str = field(default="")

    def computed_hash(self) -> str:
        """SHA-256 of the RFC 8785 JSON of every other field (``hash`` empty)."""
        fields = asdict(self)
        fields["hash"] = ""
        return sha256_hex(canonical_bytes(fields))

    def hash_is_valid(self) -> bool:
        return self.computed_hash() == self.hash


def trace_id(run_id: str) -> str:
    """W3C-sized trace id of a run (32 hex chars)."""
    return sha256_hex(run_id)[:32]


def span_id(run_id: str, step_id: str, attempt: int) -> str:
    """W3C-sized span id (16 hex chars) of one call attempt."""
    return sha256_hex(f"{run_id}:{step_id}:{attempt}")[:16]


def text_field(p: Any, k: str) -> str:
    """``p[k]`` when ``p`` is an object and that is a string, else ``""`` (Rust's ``text``)."""
    v = p.get(k) if isinstance(p, Mapping) else None
    return v if isinstance(v, str) else ""


def _attempt_of(p: Any) -> int:
    """``p["attempt"]`` as Rust reads it: a u64 or 1, at least 1, truncated to u32."""
    v = p.get("attempt") if isinstance(p, Mapping) else None
    n = v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**64 else 1
    return max(n, 1) & 0xFFFFFFFF


def receipt_id(run_id: str, event_type: str, step_id: str, payload: Any) -> str | None:
    """The id of the receipt an outcome event yields (``None``: not an outcome)."""
    if event_type in (TX_COMMITTED, TX_ROLLED_BACK):
        call = f"{run_id}:tx:{text_field(payload, 'tx_id')}"
    elif event_type in (TOOL_COMPLETED, TOOL_FAILED, STEP_FAILED, STEP_CANCELLED):
        call = f"{run_id}:call:{step_id}:{_attempt_of(payload)}"
    else:
        return None
    return "rcpt-" + sha256_hex(call)[:24]


def expected_capability(event: ChainedEvent, decisions: Mapping[str, str]) -> str:
    """The capability a receipt must name: the one of the allow decision its event cites."""
    if event.body.event_type in (TOOL_COMPLETED, TX_COMMITTED):
        return decisions.get(text_field(event.body.payload, "decision_id"), "")
    return ""


def receipt_for(event: ChainedEvent, capability_id: str) -> Receipt | None:
    """The receipt an outcome event yields, if it is one (``receipt.rs::receipt_for``)."""
    b = event.body
    p = b.payload
    t = b.event_type
    if t == TOOL_COMPLETED:
        status = "ok"
    elif t == TOOL_FAILED:
        status = "error"
    elif t == STEP_FAILED:
        status = "denied" if text_field(p, "kind") == "policy_denied" else "error"
    elif t == STEP_CANCELLED:
        status = "cancelled"
    elif t == TX_COMMITTED:
        status = "ok"
    elif t == TX_ROLLED_BACK:
        status = "cancelled"
    else:
        return None
    rid = receipt_id(b.run_id, t, b.step_id, p)
    if rid is None:
        return None
    attempt = _attempt_of(p)
    cap = text_field(p, "capability_id") or capability_id
    if t == TX_COMMITTED:
        action_type = "commit_tx"
    elif t == TX_ROLLED_BACK:
        action_type = "rollback_tx"
    else:
        action_type = text_field(p, "tool")
    unsigned = Receipt(
        receipt_id=rid,
        run_id=b.run_id,
        step_id=b.step_id,
        attempt=attempt,
        seq=b.seq,
        trace_id=trace_id(b.run_id),
        span_id=span_id(b.run_id, b.step_id, attempt),
        job_id=b.run_id,
        tx_id=text_field(p, "tx_id"),
        capability_id=cap,
        policy_decision=text_field(p, "decision_id"),
        action_type=action_type,
        timestamp_ms=b.timestamp_ms,
        status=status,
        reason=text_field(p, "reason"),
        event_hash=event.hash,
        hash="",
    )
    return Receipt(**{**asdict(unsigned), "hash": unsigned.computed_hash()})
