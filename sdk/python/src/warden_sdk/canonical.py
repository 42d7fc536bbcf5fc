"""RFC 8785 (JCS) canonical JSON and the SHA-256 digests Warden binds to it.

Warden signs and chains bytes, not values: an authorization binds the SHA-256 of the
*canonical* JSON of a call's arguments, and every ledger event is hashed over the canonical
JSON of its body. A Python host or auditor must therefore produce exactly the bytes the Rust
services produce (``libs/core/src/canonical.rs``, ``serde_jcs``), or every digest differs.

Serialization is delegated to the ``rfc8785`` package (Trail of Bits), with one adaptation:
``rfc8785`` refuses integers outside ±(2⁵³−1), while the Rust side — like JavaScript —
turns every number into an IEEE 754 double first (so ``2**64`` hashes as
``18446744073709552000``). We convert such integers to ``float`` (round-half-even, as Rust's
``as f64`` does) before handing them over, so both sides agree on every JSON input.

Parsing is strict in the same ways ``serde_json`` is, because a host must refuse what the
Rust host refuses: no ``NaN``/``Infinity``, no numbers that overflow a double, no lone UTF-16
surrogates, at most 127 levels of nesting.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Union

import rfc8785

__all__ = [
    "JsonValue",
    "JsonError",
    "parse_json",
    "canonical_json",
    "canonical_bytes",
    "sha256_hex",
    "args_digest",
    "MAX_DEPTH",
]

JsonValue = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
"""A JSON value as Python's ``json`` module represents it."""

MAX_DEPTH = 127
"""Deepest nesting of arrays and objects ``serde_json`` accepts (its recursion limit is 128)."""

_SAFE_INT = 2**53 - 1


class JsonError(ValueError):
    """Text that is not JSON as Warden's services read it."""


def _refuse_constant(name: str) -> Any:
    raise JsonError(f"{name} is not a JSON number")


def _check(value: Any, depth: int) -> None:
    """Refuses what serde_json refuses after Python's parser accepted it."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise JsonError("number out of range")
    elif isinstance(value, int) and not isinstance(value, bool) and not -(2**64) < value < 2**64:
        # serde_json reads an integer beyond u64/i64 as a double; one beyond a double's
        # range is an error there.
        try:
            float(value)
        except OverflowError as e:
            raise JsonError("number out of range") from e
    elif isinstance(value, str):
        _check_str(value)
    elif isinstance(value, list):
        if depth >= MAX_DEPTH:
            raise JsonError("recursion limit exceeded")
        for item in value:
            _check(item, depth + 1)
    elif isinstance(value, dict):
        if depth >= MAX_DEPTH:
            raise JsonError("recursion limit exceeded")
        for key, item in value.items():
            _check_str(key)
            _check(item, depth + 1)


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise JsonError("lone surrogate in string escape") from e


def parse_json(text: str | bytes, *, object_pairs_hook: Any = None) -> JsonValue:
    """Parses ``text`` as strictly as ``serde_json::from_str`` does.

    Raises :class:`JsonError` for anything the Rust services would refuse, so a Python
    host answers ``INVALID_ARGUMENT`` exactly where the reference host does.
    """
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonError(f"invalid UTF-8: {e}") from e
    try:
        value = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=object_pairs_hook)
    except JsonError:
        raise
    except (ValueError, RecursionError) as e:
        raise JsonError(str(e)) from e
    _check(value, 0)
    return value  # type: ignore[no-any-return]


def _as_double_domain(value: Any) -> Any:
    """Integers beyond 2⁵³ become the double Rust (and JavaScript) would use for them."""
    if isinstance(value, bool) or value is None or isinstance(value, (str, float)):
        return value
    if isinstance(value, int):
        if -_SAFE_INT <= value <= _SAFE_INT:
            return value
        try:
            return float(value)
        except OverflowError as e:
            raise JsonError(f"integer {value} is out of range of a JSON number") from e
    if isinstance(value, Mapping):
        return {k: _as_double_domain(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [_as_double_domain(v) for v in value]
    raise JsonError(f"{type(value).__name__} is not a JSON value")


def canonical_bytes(value: Any) -> bytes:
    """The RFC 8785 canonical JSON of ``value`` as UTF-8 bytes.

    Raises :class:`JsonError` for values JSON cannot carry (NaN, infinities, lone
    surrogates, non-string keys).
    """
    try:
        return rfc8785.dumps(_as_double_domain(value))
    except rfc8785.CanonicalizationError as e:
        raise JsonError(str(e)) from e


def canonical_json(value: Any) -> str:
    """The RFC 8785 canonical JSON of ``value`` (sorted keys, ECMAScript number form)."""
    return canonical_bytes(value).decode("utf-8")


def sha256_hex(data: str | bytes) -> str:
    """Lower-case hex SHA-256 of ``data`` (a ``str`` is hashed as UTF-8)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def args_digest(value: Any) -> str:
    """Hex SHA-256 of the canonical JSON of ``value``: what an authorization binds."""
    return hashlib.sha256(canonical_bytes(value)).hexdigest()
