"""Published quality: the package type-checks under ``mypy --strict`` and builds into a
wheel with its metadata, license, ``py.typed`` and the generated contract."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from mesh import SDK_ROOT


def test_the_package_is_mypy_strict_clean() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=SDK_ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_code_is_ruff_clean_and_formatted() -> None:
    for args in (
        ["check", "--no-cache", "src", "tests", "tools"],
        ["format", "--check", "--no-cache", "src", "tests", "tools"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "ruff", *args],
            cwd=SDK_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_the_wheel_carries_metadata_types_and_the_contract(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(tmp_path)],
        cwd=SDK_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp_path.glob("warden_sdk-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(meta_name).decode())
    assert {
        "warden_sdk/py.typed",
        "warden_sdk/v1/runs_pb2.py",
        "warden_sdk/v1/runs_pb2.pyi",
        "warden_sdk/v1/toolhost_pb2_grpc.py",
        "warden_sdk/host.py",
    } <= names
    assert not any(n.startswith("tests/") for n in names)
    assert meta["Name"] == "warden-sdk"
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["License-Expression"] == "Apache-2.0"
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert "Typing :: Typed" in meta.get_all("Classifier", [])
    assert "A client in 10 lines" in (meta.get_payload() or "")
