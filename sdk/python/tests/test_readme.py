"""The README's examples run: the client one against the mesh, the tool host one up to
``serve`` (then its tool is called through the real verification path)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from mesh import SDK_ROOT, TENANT, Mesh
from warden_sdk.testing import LocalAuthority


def _examples() -> dict[str, str]:
    text = (SDK_ROOT / "README.md").read_text()
    blocks = re.findall(r"## (A client in 10 lines|A tool host in 10 lines)\n\n```python\n(.*?)```", text, re.S)
    return dict(blocks)


def test_the_examples_are_ten_lines() -> None:
    examples = _examples()
    assert set(examples) == {"A client in 10 lines", "A tool host in 10 lines"}
    for name, code in examples.items():
        assert len([line for line in code.splitlines() if line.strip()]) <= 10, name


def test_the_client_example_runs(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _examples()["A client in 10 lines"]
    code = code.replace("http://127.0.0.1:7100", mesh.endpoint).replace('tenant="default"', f'tenant="{TENANT}"')
    monkeypatch.setenv("WARDEN_LEDGER_ENDPOINT", mesh.ledger.endpoint)
    exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert '\'{"text":"HELLO"}\'' in out and "ExportReport(" in out


async def test_the_tool_host_example_declares_and_serves_its_tool(tmp_path: Path) -> None:
    code = _examples()["A tool host in 10 lines"]
    code = code.replace('state_path="tools.db"', f'state_path="{tmp_path / "tools.db"}"')
    code = "\n".join(line for line in code.splitlines() if not line.startswith("host.serve("))
    scope: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), scope)
    total = scope["host"].tools["orders.total"]
    spec = total.spec()
    assert (spec.read_only, spec.idempotent, spec.timeout_sec, spec.description) == (
        True,
        True,
        5,
        "Adds up an order's prices.",
    )
    assert json.loads(spec.input_schema_json)["properties"]["prices"]["type"] == "array"
    authority = LocalAuthority()
    host = authority.host([total], state_path=tmp_path / "verified.db")
    response = await host.invoke(authority.request("orders.total", {"prices": [1.5, 2]}))
    assert json.loads(response.output_json) == {"total": 3.5}
