"""Offline verification, differentially: one real run exported by the Rust CLI
(``warden run export``), then that file intact and altered in many ways, each verified by
``warden ledger verify-file --json`` and by :func:`warden_sdk.verify_export_file`. Both must
agree on the verdict and, for a bad file, on the first bad line and seq."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mesh import Mesh
from warden_sdk import Client, ExportError, verify_export_file
from warden_sdk.export import _decompresses

Lines = list[str]


@pytest.fixture(scope="module")
def exported(mesh: Mesh, client: Client) -> Lines:
    """A finished run with every kind of receipt: ok, error, cancelled and denied."""
    sub = client.submit(
        {
            "steps": [
                {"id": "a", "tool": "py.add", "params": {"a": 2, "b": 3}},
                {"id": "x", "tool": "py.explode", "params": {"message": "boom"}},
                {"id": "y", "tool": "echo", "params": {}, "depends_on": ["x"]},
                {"id": "d", "tool": "kv.put", "params": {"key": "k", "value": "v"}},
            ]
        }
    )
    run = client.wait(sub.run_id, timeout=30)
    assert {s.id: s.status for s in run.steps}.keys() == {"a", "x", "y", "d"}
    out = mesh.cli("run", "export", sub.run_id)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    statuses = {json.loads(line)["data"]["status"] for line in lines if '"kind":"receipt"' in line}
    assert statuses == {"ok", "error", "cancelled", "denied"}, statuses
    return lines


def rust_verdict(mesh: Mesh, path: Path, *key: str) -> tuple[bool, int | None, int | None, str]:
    out = mesh.cli("ledger", "verify-file", str(path), "--json", *key)
    assert out.returncode in (0, 1), out.stderr
    v = json.loads(out.stdout)
    if v["valid"]:
        return True, None, None, f"{v['events']} {v['receipts']} {v['key_id']}"
    return False, v["line"], v["seq"], v["reason"]


def python_verdict(path: Path, key: str | None = None) -> tuple[bool, int | None, int | None, str]:
    try:
        r = verify_export_file(path, key)
    except ExportError as e:
        return False, e.line, e.seq, e.reason
    return True, None, None, f"{r.events} {r.receipts} {r.key_id}"


def _kinds(lines: Lines) -> list[str]:
    return [json.loads(line)["kind"] if line.strip() else "" for line in lines]


def _index(lines: Lines, kind: str, nth: int = 0) -> int:
    return [i for i, k in enumerate(_kinds(lines)) if k == kind][nth]


def _edit(lines: Lines, i: int, fn: Callable[[dict[str, Any]], None]) -> Lines:
    out = list(lines)
    line = json.loads(out[i])
    fn(line)
    out[i] = json.dumps(line, separators=(",", ":"), ensure_ascii=False)
    return out


def _replace(lines: Lines, i: int, old: str, new: str) -> Lines:
    assert old in lines[i], (old, lines[i])
    out = list(lines)
    out[i] = out[i].replace(old, new, 1)
    return out


def _event_with(lines: Lines, event_type: str, step_id: str) -> int:
    def matches(line: str) -> bool:
        d = json.loads(line)
        return d["kind"] == "event" and (d["data"]["event_type"], d["data"]["step_id"]) == (event_type, step_id)

    return next(i for i, line in enumerate(lines) if matches(line))


def _not_a_point() -> str:
    for b in range(256):
        raw = bytes([b]) * 32
        if not _decompresses(raw):
            return raw.hex()
    raise AssertionError("no invalid point found")


def _swap(lines: Lines, i: int, j: int) -> Lines:
    out = list(lines)
    out[i], out[j] = out[j], out[i]
    return out


def _drop(lines: Lines, i: int) -> Lines:
    return lines[:i] + lines[i + 1 :]


def _insert(lines: Lines, i: int, line: str) -> Lines:
    return lines[:i] + [line] + lines[i:]


def _head_sig(lines: Lines) -> Lines:
    def flip(d: dict[str, Any]) -> None:
        sig = d["data"]["signature"]
        d["data"]["signature"] = ("0" if sig[0] != "0" else "1") + sig[1:]

    return _edit(lines, len(lines) - 1, flip)


def _receipt_as_array(lines: Lines) -> Lines:
    i = _index(lines, "receipt")
    d = json.loads(lines[i])
    out = list(lines)
    out[i] = json.dumps({"kind": "receipt", "data": list(d["data"].values())}, separators=(",", ":"))
    return out


def _line_as_array(lines: Lines) -> Lines:
    d = json.loads(lines[0])
    return [json.dumps([d["kind"], d["data"]])] + lines[1:]


def _duplicate_field(lines: Lines) -> Lines:
    i = _index(lines, "event", 2)
    return _replace(lines, i, '"seq":', '"seq":3,"seq":')


MUTATIONS: dict[str, Callable[[Lines], Lines | bytes]] = {
    "intact": lambda ls: ls,
    "crlf_line_ends": lambda ls: "".join(line + "\r\n" for line in ls).encode(),
    "no_final_newline": lambda ls: "\n".join(ls).encode(),
    "blank_lines_between": lambda ls: _insert(_insert(ls, 2, ""), len(ls), "   "),
    "leading_blank_line": lambda ls: _insert(ls, 0, ""),
    "unicode_space_around_a_line": lambda ls: [ls[0]] + ["\u00a0" + ls[1] + "\u3000"] + ls[2:],
    "control_char_after_a_line": lambda ls: [ls[0], ls[1] + "\x1c"] + ls[2:],
    "payload_edited": lambda ls: _replace(ls, _event_with(ls, "tool_requested", "a"), '"a":2', '"a":9'),
    "event_deleted": lambda ls: _drop(ls, _index(ls, "event", 3)),
    "events_swapped": lambda ls: _swap(ls, _index(ls, "event", 3), _index(ls, "event", 4)),
    "event_of_another_run": lambda ls: _edit(
        ls, _index(ls, "event", 2), lambda d: d["data"].__setitem__("run_id", "someone-else")
    ),
    "event_extra_field": lambda ls: _edit(ls, _index(ls, "event", 2), lambda d: d["data"].__setitem__("zzz", 1)),
    "event_duplicate_field": _duplicate_field,
    "event_seq_as_float": lambda ls: _replace(ls, _index(ls, "event", 2), '"seq":3,', '"seq":3.0,'),
    "event_hash_edited": lambda ls: _edit(
        ls, _index(ls, "event", 5), lambda d: d["data"].__setitem__("hash", "f" * 64)
    ),
    "receipt_deleted": lambda ls: _drop(ls, _index(ls, "receipt", 1)),
    "receipt_status_edited": lambda ls: _replace(ls, _index(ls, "receipt", 0), '"status":"', '"status":"x'),
    "receipt_duplicated": lambda ls: _insert(ls, _index(ls, "receipt", 0), ls[_index(ls, "receipt", 0)]),
    "receipt_attempt_overflow": lambda ls: _edit(
        ls, _index(ls, "receipt", 0), lambda d: d["data"].__setitem__("attempt", 2**32)
    ),
    "receipt_capability_edited": lambda ls: _edit(
        ls, _index(ls, "receipt", 0), lambda d: d["data"].__setitem__("capability_id", "cap-forged")
    ),
    "receipt_as_array": _receipt_as_array,
    "line_as_array": _line_as_array,
    "head_signature_edited": _head_sig,
    "head_seq_edited": lambda ls: _edit(
        ls, len(ls) - 1, lambda d: d["data"]["head"].__setitem__("seq", d["data"]["head"]["seq"] - 1)
    ),
    "head_missing": lambda ls: ls[:-1],
    "content_after_head": lambda ls: ls + [ls[1]],
    "head_key_not_a_point": lambda ls: _edit(
        ls, len(ls) - 1, lambda d: d["data"].__setitem__("public_key", _not_a_point())
    ),
    "head_key_short": lambda ls: _edit(
        ls, len(ls) - 1, lambda d: d["data"].__setitem__("public_key", d["data"]["public_key"][:-2])
    ),
    "header_missing": lambda ls: ls[1:],
    "header_twice": lambda ls: _insert(ls, 1, ls[0]),
    "header_unknown_format": lambda ls: _replace(ls, 0, "warden-run-export/1", "warden-run-export/2"),
    "not_json": lambda ls: _insert(ls, 4, "not json"),
    "unknown_kind": lambda ls: _replace(ls, _index(ls, "receipt"), '"kind":"receipt"', '"kind":"receipts"'),
    "invalid_utf8_line": lambda ls: "\n".join(ls[:6]).encode() + b"\n\xff\xfe\n" + "\n".join(ls[6:]).encode(),
    "empty": lambda ls: b"",
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_python_and_rust_agree_on_every_file(mesh: Mesh, exported: Lines, tmp_path: Path, name: str) -> None:
    mutated = MUTATIONS[name](exported)
    path = tmp_path / f"{name}.jsonl"
    path.write_bytes(mutated if isinstance(mutated, bytes) else "".join(line + "\n" for line in mutated).encode())
    rust = rust_verdict(mesh, path)
    py = python_verdict(path)
    assert py[:3] == rust[:3], f"python {py} vs rust {rust}"
    if rust[0]:
        assert py[3] == rust[3], "same events, receipts and key id"
    assert rust[0] == (name in VALID), f"{name}: {rust}"


VALID = {
    "intact",
    "crlf_line_ends",
    "no_final_newline",
    "blank_lines_between",
    "unicode_space_around_a_line",
    "event_extra_field",
    "receipt_as_array",
    "line_as_array",
}


def test_a_pinned_key_is_checked_by_both(mesh: Mesh, client: Client, exported: Lines, tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_text("".join(line + "\n" for line in exported))
    (ledger_key,) = client.ledger_keys()
    good = ledger_key.public_key.hex()
    assert rust_verdict(mesh, path, "--key", good)[0] and python_verdict(path, good)[0]
    other = os.urandom(32)
    while not _decompresses(other):
        other = os.urandom(32)
    rust = rust_verdict(mesh, path, "--key", other.hex())
    py = python_verdict(path, other.hex())
    assert not rust[0] and py[:3] == rust[:3]
    assert "not the pinned key" in py[3]


def test_an_export_written_by_the_sdk_verifies_with_the_rust_cli(mesh: Mesh, client: Client, tmp_path: Path) -> None:
    sub = client.submit(
        {
            "steps": [
                {"id": "a", "tool": "py.add", "params": {"a": 1, "b": 1}},
                {"id": "b", "tool": "text.upper", "params": {"text": "héllo"}},
            ]
        }
    )
    client.wait(sub.run_id, timeout=30)
    path = tmp_path / "sdk-export.jsonl"
    assert client.export_run(sub.run_id, path) > 3
    rust = rust_verdict(mesh, path)
    assert rust[0], rust
    assert python_verdict(path) == rust
