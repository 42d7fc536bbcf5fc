"""Identifier rules shared with the Rust services (``libs/core/src/ids.rs``), so a bad id is
refused the same way, with the same words, by a Python host as by the reference host."""

from __future__ import annotations

__all__ = ["MAX_ID_LEN", "MAX_STEP_ID_LEN", "check_id", "check_step_id", "check_tool_name"]

MAX_ID_LEN = 128
MAX_STEP_ID_LEN = 64

_ALNUM = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
_BAD = "must start with a letter or digit and contain only letters, digits, '-', '_', ':' or '.'"


def _check_with(value: str, allowed: frozenset[str]) -> str | None:
    if not value:
        return "must not be empty"
    if len(value.encode("utf-8")) > MAX_ID_LEN:
        return f"must be at most {MAX_ID_LEN} characters"
    if value[0] not in _ALNUM or any(c not in allowed for c in value):
        return _BAD
    return None


_ID = _ALNUM | frozenset("-_:.")
_STEP = _ALNUM | frozenset("-_")
_TOOL = _ALNUM | frozenset("-_.")


def check_id(value: str) -> str | None:
    """Tenants, run ids and idempotency keys: ``[A-Za-z0-9][A-Za-z0-9_.:-]*``, at most 128
    bytes. Returns why ``value`` is refused, or ``None``."""
    return _check_with(value, _ID)


def check_step_id(value: str) -> str | None:
    """Step ids: no ``.`` or ``:`` (templates address ``{{id.output.x}}``), at most 64 bytes."""
    if len(value.encode("utf-8")) > MAX_STEP_ID_LEN:
        return f"must be at most {MAX_STEP_ID_LEN} characters"
    return _check_with(value, _STEP)


def check_tool_name(value: str) -> str | None:
    """Tool names: ``[A-Za-z0-9][A-Za-z0-9_.-]*`` (``text.upper``, ``kv.put``)."""
    return _check_with(value, _TOOL)
