"""Durable first outcomes of tool calls, keyed by (tenant, idempotency key).

The executor asks a tool again under the same idempotency key whenever it cannot know what
happened (a timeout, a broken connection, its own restart). A host must then answer with the
first outcome instead of acting twice — also after the host itself restarted, so outcomes
live in a SQLite file and are committed *before* the call is answered.

The table is the one the Rust demo host keeps (``services/tools/src/tools.rs``): same
columns, same stored form of an outcome (``{"output": text}`` or ``{"error": {code, message,
retryable}}``), so the two hosts' state files read alike.

SQLite work runs on a worker thread (:func:`asyncio.to_thread`): a commit waits for the disk,
and the gRPC server's event loop must not wait with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Outcome", "RecordedOutcome", "OutcomeStore", "StateError"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outcomes (
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    tool TEXT NOT NULL,
    args_sha256 TEXT NOT NULL,
    outcome_json TEXT NOT NULL,
    recorded_at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, idempotency_key)
) WITHOUT ROWID
"""

# Calls of tools that are not idempotent, marked before they act (see OutcomeStore.mark_started).
_STARTED_SCHEMA = """
CREATE TABLE IF NOT EXISTS started (
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    started_at_ms INTEGER NOT NULL,
    PRIMARY KEY (tenant, idempotency_key)
) WITHOUT ROWID
"""


class StateError(Exception):
    """The state file cannot be used (unopenable, unwritable, or a stored row unreadable)."""


@dataclass(frozen=True)
class Outcome:
    """What a call produced: ``output_json`` (JSON text) or an error (``code``, ``message``,
    ``retryable``)."""

    output_json: str | None = None
    code: str = ""
    message: str = ""
    retryable: bool = False

    @property
    def is_error(self) -> bool:
        return self.output_json is None

    def to_stored(self) -> str:
        if self.output_json is not None:
            return json.dumps({"output": self.output_json}, separators=(",", ":"), ensure_ascii=False)
        err = {"code": self.code, "message": self.message, "retryable": self.retryable}
        return json.dumps({"error": err}, separators=(",", ":"), ensure_ascii=False)

    @staticmethod
    def from_stored(text: str) -> Outcome:
        try:
            v = json.loads(text)
            if isinstance(v, dict) and set(v) == {"output"} and isinstance(v["output"], str):
                return Outcome(output_json=v["output"])
            if isinstance(v, dict) and set(v) == {"error"}:
                e = v["error"]
                if (
                    isinstance(e, dict)
                    and set(e) == {"code", "message", "retryable"}
                    and isinstance(e["code"], str)
                    and isinstance(e["message"], str)
                    and isinstance(e["retryable"], bool)
                ):
                    return Outcome(code=e["code"], message=e["message"], retryable=e["retryable"])
        except ValueError:
            pass
        raise StateError(f"a stored outcome is unreadable: {text[:200]!r}")


@dataclass(frozen=True)
class RecordedOutcome:
    """The first outcome of one key, with the call that produced it: a later call with the
    key must be the same call (tool and argument digest) to be answered with it."""

    tool: str
    args_sha256: str
    outcome: Outcome


class OutcomeStore:
    """The SQLite file of first outcomes. One host process owns a file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            try:
                if self.path.parent and str(self.path.parent) not in ("", "."):
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None, check_same_thread=False)
                # WAL with synchronous=NORMAL, as the Rust host and the ledger: a committed
                # outcome survives the host process dying (what replay guards against); an OS
                # crash may lose the last commits, which then read as unknown outcomes.
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute(_SCHEMA)
                conn.execute(_STARTED_SCHEMA)
            except (sqlite3.Error, OSError) as e:
                raise StateError(f"tool host state '{self.path}' cannot be used: {e}") from e
            self._conn = conn
        return self._conn

    def open(self) -> None:
        """Opens the file and creates the table now, so a bad path stops a host at start."""
        with self._lock:
            self._db()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _get(self, tenant: str, key: str) -> RecordedOutcome | None:
        with self._lock:
            try:
                row = (
                    self._db()
                    .execute(
                        "SELECT tool, args_sha256, outcome_json FROM outcomes WHERE tenant = ? AND idempotency_key = ?",
                        (tenant, key),
                    )
                    .fetchone()
                )
            except sqlite3.Error as e:
                raise StateError(f"tool host state is unavailable: {e}") from e
        if row is None:
            return None
        return RecordedOutcome(tool=row[0], args_sha256=row[1], outcome=Outcome.from_stored(row[2]))

    def _put(self, tenant: str, key: str, rec: RecordedOutcome, now_ms: int) -> tuple[RecordedOutcome, bool]:
        with self._lock:
            try:
                cur = self._db().execute(
                    "INSERT INTO outcomes (tenant, idempotency_key, tool, args_sha256, outcome_json, recorded_at_ms)"
                    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, idempotency_key) DO NOTHING",
                    (tenant, key, rec.tool, rec.args_sha256, rec.outcome.to_stored(), now_ms),
                )
                inserted = cur.rowcount == 1
            except sqlite3.Error as e:
                raise StateError(f"tool host state is unavailable: {e}") from e
        if inserted:
            return rec, True
        first = self._get(tenant, key)
        if first is None:
            raise StateError(f"outcome of key '{key}' vanished after a conflict")
        return first, False

    def _mark(self, tenant: str, key: str, now_ms: int) -> bool:
        with self._lock:
            try:
                db = self._db()
                # Synced before returning, unlike outcomes: a mark lost to an OS crash would
                # let a repeat act twice, where a lost outcome only leaves the call in doubt.
                db.execute("PRAGMA synchronous=FULL")
                try:
                    cur = db.execute(
                        "INSERT INTO started (tenant, idempotency_key, started_at_ms) VALUES (?, ?, ?)"
                        " ON CONFLICT (tenant, idempotency_key) DO NOTHING",
                        (tenant, key, now_ms),
                    )
                finally:
                    db.execute("PRAGMA synchronous=NORMAL")
                return cur.rowcount == 1
            except sqlite3.Error as e:
                raise StateError(f"tool host state is unavailable: {e}") from e

    async def mark_started(self, tenant: str, key: str, now_ms: int) -> bool:
        """Marks a call of ``key`` started, durably, before a tool that is not idempotent
        acts; ``False`` when it was marked before — by a call that then could not record its
        outcome, or by a host process that stopped mid-call: that call may have acted, and
        nobody knows whether it did."""
        return await asyncio.to_thread(self._mark, tenant, key, now_ms)

    async def get(self, tenant: str, key: str) -> RecordedOutcome | None:
        """The outcome first recorded for ``key`` of ``tenant``, if any."""
        return await asyncio.to_thread(self._get, tenant, key)

    async def record(self, tenant: str, key: str, rec: RecordedOutcome, now_ms: int) -> tuple[RecordedOutcome, bool]:
        """Records ``rec`` unless the key has an outcome already; returns the stored one and
        whether it is ``rec``. The first outcome always wins, so every call with a key is
        answered with one outcome even if a tool somehow ran twice."""
        return await asyncio.to_thread(self._put, tenant, key, rec, now_ms)
