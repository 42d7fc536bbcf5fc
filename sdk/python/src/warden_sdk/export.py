"""Run exports (JSON Lines) and their offline verification.

An export is what ``warden run export RUN`` writes (``libs/core/src/export.rs``)::

    {"kind":"header","data":{"format":"warden-run-export/1","run_id":…,"tenant":…,"status":…,"exported_at_ms":…}}
    {"kind":"event","data":{…event body…,"prev_hash":…,"hash":…}}      one per event, in seq order
    {"kind":"receipt","data":{…receipt…}}                              one per tool call outcome
    {"kind":"head","data":{"head":{"run_id","seq","hash"},"signature":hex,"key_id","public_key":hex}}

:func:`verify_export` is the algorithm of ``warden ledger verify-file``, step for step, so an
auditor with only Python gets the same verdict — and, for a bad file, the same first bad line
and seq — as one with the Rust CLI: the chain is recomputed, every receipt re-derived from its
event, and the head signature checked against a pinned key (or the file's own, whose id is
reported for comparison). Lines are read as the CLI reads them (``BufRead::lines``: split on
``\\n``, one trailing ``\\r`` dropped, reading stops at the first line that is not UTF-8) and
parsed as ``serde`` parses them, including its stricter corners (duplicate fields, integer
ranges, structs given as arrays).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from os import PathLike
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .auth import key_id as _key_id
from .auth import public_key_from_bytes
from .canonical import JsonError, parse_json
from .chain import (
    POLICY_DECISION,
    ChainBreak,
    ChainedEvent,
    ChainVerifier,
    EventBody,
    Head,
    Receipt,
    expected_capability,
    receipt_for,
    text_field,
)

__all__ = [
    "FORMAT",
    "ExportError",
    "ExportReport",
    "verify_export",
    "verify_export_file",
    "read_export_lines",
    "export_line",
    "parse_public_key_hex",
]

FORMAT = "warden-run-export/1"


class ExportError(Exception):
    """The first thing wrong with an export: its line (from 1), the seq concerned, and why."""

    def __init__(self, line: int, seq: int | None, reason: str) -> None:
        where = f"line {line}" + (f" (seq {seq})" if seq is not None else "")
        super().__init__(f"{where}: {reason}")
        self.line = line
        self.seq = seq
        self.reason = reason


@dataclass(frozen=True)
class ExportReport:
    """What a valid export holds; ``key_id`` is the key its head is signed by."""

    run_id: str
    events: int
    receipts: int
    key_id: str


# --- reading lines as `BufRead::lines().map_while(Result::ok)` does -------------------------

# Rust's `str::trim` removes Unicode White_Space, which differs from Python's `str.strip`
# (Python also strips U+001C..U+001F).
_RUST_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)


def read_export_lines(data: bytes) -> list[str]:
    """Splits an export file's bytes into lines exactly as the Rust CLI reads them."""
    pieces = data.split(b"\n")
    if pieces and pieces[-1] == b"":
        pieces.pop()
    lines = []
    for piece in pieces:
        if piece.endswith(b"\r"):
            piece = piece[:-1]
        try:
            lines.append(piece.decode("utf-8"))
        except UnicodeDecodeError:
            break
    return lines


# --- parsing as serde does -------------------------------------------------------------------


class _Malformed(Exception):
    pass


class _Obj(dict[str, Any]):
    """A JSON object that remembers which keys it saw twice (the last value is kept, as
    ``serde_json::Value`` keeps it; a struct field given twice is an error)."""

    dups: frozenset[str] = frozenset()


def _pairs(pairs: list[tuple[str, Any]]) -> _Obj:
    obj = _Obj()
    dups: set[str] = set()
    for k, v in pairs:
        if k in obj:
            dups.add(k)
        obj[k] = v
    obj.dups = frozenset(dups)
    return obj


_STR = "str"
_ANY = "any"
_RANGES = {"u32": (0, 2**32 - 1), "u64": (0, 2**64 - 1), "i64": (-(2**63), 2**63 - 1)}


def _typed(name: str, kind: str, v: Any) -> Any:
    if kind == _ANY:
        return v
    if kind == _STR:
        if not isinstance(v, str):
            raise _Malformed(f"invalid type for `{name}`: expected a string")
        return v
    lo, hi = _RANGES[kind]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Malformed(f"invalid type for `{name}`: expected {kind}")
    if not lo <= v <= hi:
        raise _Malformed(f"invalid value for `{name}`: {v}, expected {kind}")
    return v


def _struct(
    value: Any,
    what: str,
    fields: Sequence[tuple[str, str]],
    defaults: Mapping[str, Any] | None = None,
    *,
    seq_form: bool = True,
) -> dict[str, Any]:
    """A serde-derived struct read from a map (unknown keys ignored, duplicates refused) or,
    as serde_json also accepts, from an array of its fields in declaration order."""
    defaults = defaults or {}
    out: dict[str, Any] = {}
    if isinstance(value, dict):
        dups: frozenset[str] = getattr(value, "dups", frozenset())
        for name, _ in fields:
            if name in dups:
                raise _Malformed(f"duplicate field `{name}`")
        for name, kind in fields:
            if name in value:
                out[name] = _typed(name, kind, value[name])
            elif name in defaults:
                out[name] = defaults[name]
            else:
                raise _Malformed(f"missing field `{name}`")
        return out
    if isinstance(value, list) and seq_form:
        required = sum(1 for name, _ in fields if name not in defaults)
        if not required <= len(value) <= len(fields):
            raise _Malformed(f"invalid length {len(value)}, expected struct {what} with {len(fields)} elements")
        for i, (name, kind) in enumerate(fields):
            out[name] = _typed(name, kind, value[i]) if i < len(value) else defaults[name]
        return out
    raise _Malformed(f"invalid type: expected struct {what}")


_HEADER = [("format", _STR), ("run_id", _STR), ("tenant", _STR), ("status", _STR), ("exported_at_ms", "i64")]
_EVENT = [
    ("run_id", _STR),
    ("seq", "u64"),
    ("event_type", _STR),
    ("payload", _ANY),
    ("step_id", _STR),
    ("epoch", "u64"),
    ("idempotency_key", _STR),
    ("timestamp_ms", "i64"),
    ("prev_hash", _STR),
    ("hash", _STR),
]
_RECEIPT = [
    ("receipt_id", _STR),
    ("run_id", _STR),
    ("step_id", _STR),
    ("attempt", "u32"),
    ("seq", "u64"),
    ("trace_id", _STR),
    ("span_id", _STR),
    ("job_id", _STR),
    ("tx_id", _STR),
    ("capability_id", _STR),
    ("policy_decision", _STR),
    ("action_type", _STR),
    ("timestamp_ms", "i64"),
    ("status", _STR),
    ("reason", _STR),
    ("event_hash", _STR),
    ("hash", _STR),
]
_HEAD = [("run_id", _STR), ("seq", "u64"), ("hash", _STR)]
_SIGNED_HEAD = [("head", _ANY), ("signature", _STR), ("key_id", _STR), ("public_key", _STR)]
_KINDS = ("header", "event", "receipt", "head")


@dataclass(frozen=True)
class _Header:
    format: str
    run_id: str
    tenant: str
    status: str
    exported_at_ms: int


@dataclass(frozen=True)
class _SignedHead:
    head: Head
    signature: str
    key_id: str
    public_key: str


def _parse_line(raw: str) -> tuple[str, Any]:
    try:
        value = parse_json(raw, object_pairs_hook=_pairs)
    except JsonError as e:
        raise _Malformed(str(e)) from e
    if isinstance(value, dict):
        for k in ("kind", "data"):
            if k in getattr(value, "dups", frozenset()):
                raise _Malformed(f"duplicate field `{k}`")
        if "kind" not in value:
            raise _Malformed("missing field `kind`")
        kind, data, has_data = value["kind"], value.get("data"), "data" in value
    elif isinstance(value, list):
        if len(value) != 2:
            raise _Malformed(f"invalid length {len(value)}, expected adjacently tagged enum Line")
        kind, data, has_data = value[0], value[1], True
    else:
        raise _Malformed("invalid type: expected adjacently tagged enum Line")
    if not isinstance(kind, str) or kind not in _KINDS:
        raise _Malformed(f"unknown variant {json.dumps(kind)}, expected one of {', '.join(_KINDS)}")
    if not has_data:
        raise _Malformed("missing field `data`")
    if kind == "header":
        return kind, _Header(**_struct(data, "Header", _HEADER))
    if kind == "event":
        # `#[serde(flatten)]` makes the event a map-only struct.
        f = _struct(data, "ChainedEvent", _EVENT, seq_form=False)
        prev_hash, hash_ = f.pop("prev_hash"), f.pop("hash")
        return kind, ChainedEvent(EventBody(**f), prev_hash, hash_)
    if kind == "receipt":
        return kind, Receipt(**_struct(data, "Receipt", _RECEIPT, {"hash": ""}))
    f = _struct(data, "SignedHeadLine", _SIGNED_HEAD)
    head = Head(**_struct(f.pop("head"), "Head", _HEAD))
    return kind, _SignedHead(head=head, **f)


_HEX = re.compile(r"[0-9a-fA-F]*")


def _hex(text: str) -> bytes | None:
    """Strict hex (the `hex` crate's): even length, digits only, no whitespace."""
    if len(text) % 2 or not _HEX.fullmatch(text):
        return None
    return bytes.fromhex(text)


_P = 2**255 - 19
_D = (-121665 * pow(121666, _P - 2, _P)) % _P


def _decompresses(raw: bytes) -> bool:
    """Whether ``raw`` is a point encoding ed25519-dalek accepts (``VerifyingKey::from_bytes``):
    y is read modulo p, and x² = (y²−1)/(d·y²+1) must have a square root."""
    y = (int.from_bytes(raw, "little") & ((1 << 255) - 1)) % _P
    y2 = y * y % _P
    x2 = (y2 - 1) * pow(_D * y2 + 1, _P - 2, _P) % _P
    return x2 == 0 or pow(x2, (_P - 1) // 2, _P) == 1


def parse_public_key_hex(text: str) -> Ed25519PublicKey:
    """An Ed25519 public key from 64 hex chars (what ``--key`` takes). Raises ``ValueError``."""
    raw = _hex(text.strip())
    if raw is None or len(raw) != 32:
        raise ValueError("the key must be 32 bytes of hex")
    key = public_key_from_bytes(raw) if _decompresses(raw) else None
    if key is None:
        raise ValueError("the key is not a valid Ed25519 public key")
    return key


# --- verification ----------------------------------------------------------------------------


def verify_export(lines: Iterable[str], pinned: Ed25519PublicKey | bytes | None = None) -> ExportReport:
    """Verifies an export read line by line; raises :class:`ExportError` at the first fault.

    ``pinned`` is the ledger key the auditor trusts; without it the file's embedded key is
    used and :attr:`ExportReport.key_id` names it for comparison.
    """
    if isinstance(pinned, bytes):
        key = public_key_from_bytes(pinned) if _decompresses(pinned) and len(pinned) == 32 else None
        if key is None:
            raise ValueError("the pinned key is not a valid Ed25519 public key")
        pinned = key
    header: _Header | None = None
    chain = ChainVerifier()
    outcome_events: dict[int, ChainedEvent] = {}
    decisions: dict[str, str] = {}
    receipts: list[tuple[int, Receipt]] = []
    head: tuple[int, _SignedHead] | None = None
    n = 0
    for i, text in enumerate(lines):
        no = i + 1
        n = no
        raw = text.strip(_RUST_WHITESPACE)
        if not raw:
            continue
        try:
            kind, item = _parse_line(raw)
        except _Malformed as e:
            raise ExportError(no, None, f"not an export line: {e}") from None
        if head is not None:
            raise ExportError(no, None, "content after the signed head")
        if kind == "header":
            assert isinstance(item, _Header)
            if header is not None or no != 1:
                raise ExportError(no, None, "header must be the first line, once")
            if item.format != FORMAT:
                raise ExportError(no, None, f"unknown format '{item.format}'")
            header = item
            continue
        if header is None:
            raise ExportError(no, None, "missing header")
        if kind == "event":
            assert isinstance(item, ChainedEvent)
            if item.body.run_id != header.run_id:
                raise ExportError(no, item.body.seq, f"event of run {item.body.run_id} in an export of {header.run_id}")
            try:
                chain.push(item)
            except ChainBreak as b:
                raise ExportError(no, b.seq, b.reason) from None
            if item.body.event_type == POLICY_DECISION:
                p = item.body.payload
                decisions[text_field(p, "decision_id")] = text_field(p, "capability_id")
            if receipt_for(item, "") is not None:
                outcome_events[item.body.seq] = item
        elif kind == "receipt":
            assert isinstance(item, Receipt)
            receipts.append((no, item))
        else:
            assert isinstance(item, _SignedHead)
            head = (no, item)
    if header is None:
        raise ExportError(max(n, 1), None, "empty export")
    for no, r in receipts:
        outcome = outcome_events.pop(r.seq, None)
        if outcome is None:
            raise ExportError(no, r.seq, "receipt cites no outcome event (or a second receipt for one)")
        if receipt_for(outcome, expected_capability(outcome, decisions)) != r:
            raise ExportError(no, r.seq, "receipt does not match its event")
    if outcome_events:
        raise ExportError(n, min(outcome_events), "tool call outcome without its receipt")
    if head is None:
        raise ExportError(n, None, "missing signed head")
    no, h = head
    if h.head.run_id != header.run_id or h.head.seq != chain.verified or h.head.hash != chain.head:
        raise ExportError(no, h.head.seq, f"signed head does not match the events (they end at seq {chain.verified})")
    key_bytes = _hex(h.public_key)
    if key_bytes is None or len(key_bytes) != 32:
        raise ExportError(no, None, "public key is not 32 hex bytes")
    embedded = public_key_from_bytes(key_bytes) if _decompresses(key_bytes) else None
    if embedded is None:
        raise ExportError(no, None, "public key is invalid")
    key = pinned if pinned is not None else embedded
    if _key_id(key) != h.key_id:
        raise ExportError(no, None, f"head is signed by key {h.key_id}, not the pinned key {_key_id(key)}")
    signature = _hex(h.signature) or b""
    if not h.head.verify(signature, key):
        raise ExportError(no, h.head.seq, "head signature does not verify")
    return ExportReport(run_id=header.run_id, events=chain.verified, receipts=len(receipts), key_id=h.key_id)


def verify_export_file(path: str | PathLike[str], key: str | Ed25519PublicKey | None = None) -> ExportReport:
    """Verifies an export file offline, as ``warden ledger verify-file FILE [--key HEX]``.

    ``key`` pins the ledger's public key (64 hex chars or a key object). Raises
    :class:`ExportError` for a bad file and ``ValueError`` for a bad key.
    """
    pinned = parse_public_key_hex(key) if isinstance(key, str) else key
    with open(path, "rb") as f:
        data = f.read()
    return verify_export(read_export_lines(data), pinned)


# --- writing ---------------------------------------------------------------------------------


def _line(kind: str, data: Mapping[str, Any]) -> str:
    return json.dumps({"kind": kind, "data": data}, separators=(",", ":"), ensure_ascii=False)


def export_line(item: ChainedEvent | Receipt | Head | Mapping[str, Any], **head_signature: str) -> str:
    """One export line, in the field order the Rust CLI writes.

    A mapping is a header's data; a :class:`Head` needs ``signature``, ``key_id`` and
    ``public_key`` (hex) as keywords.
    """
    if isinstance(item, ChainedEvent):
        return _line("event", {**asdict(item.body), "prev_hash": item.prev_hash, "hash": item.hash})
    if isinstance(item, Receipt):
        return _line("receipt", asdict(item))
    if isinstance(item, Head):
        return _line(
            "head",
            {
                "head": asdict(item),
                "signature": head_signature["signature"],
                "key_id": head_signature["key_id"],
                "public_key": head_signature["public_key"],
            },
        )
    return _line("header", dict(item))
