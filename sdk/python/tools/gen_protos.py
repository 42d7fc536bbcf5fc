#!/usr/bin/env python3
"""Generates ``warden_sdk.v1`` (messages, gRPC stubs and their type stubs) from ``proto/``.

The generated modules are checked in so that the published wheel is pure Python and needs no
code generator at install time; ``tests/test_codegen.py`` runs this generator into a temporary
directory and fails on any difference, so the checked-in code cannot drift from the contract.

protoc names the modules after the proto package (``warden.v1``); they are moved under
``warden_sdk.v1`` so that installing the SDK never claims the top-level name ``warden``.
Only Python import paths are rewritten: the wire names (``/warden.v1.Runs/SubmitRun``) and
the descriptors stay exactly as the contract declares them.

Usage: ``python tools/gen_protos.py [--proto-dir DIR] [--out DIR]`` (defaults: the repository's
``proto/`` and ``src/warden_sdk/v1``). Needs the ``codegen`` extra (grpcio-tools and
mypy-protobuf at the pinned versions, since their output embeds their versions).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDK_ROOT = HERE.parent
DEFAULT_PROTO_DIR = SDK_ROOT.parent.parent / "proto"
DEFAULT_OUT = SDK_ROOT / "src" / "warden_sdk" / "v1"

PROTO_PACKAGE_DIR = Path("warden") / "v1"
PY_PACKAGE = "warden_sdk.v1"

INIT = '''"""Generated from proto/warden/v1 by tools/gen_protos.py: do not edit.

The Warden contract as Python modules: ``<name>_pb2`` (messages) and ``<name>_pb2_grpc``
(stubs and servicers) for each of common, ledger, planner, policy, runs and toolhost.
"""
'''


def _plugin(name: str) -> str:
    """The protoc plugin ``name`` installed beside this interpreter (mypy-protobuf's)."""
    candidate = Path(sys.executable).parent / name
    found = str(candidate) if candidate.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: install the SDK's codegen extra (mypy-protobuf)")
    return found


def _rewrite(text: str) -> str:
    # Imports between generated modules: `from warden.v1 import x_pb2 as …`.
    text = re.sub(r"^from warden\.v1 import ", f"from {PY_PACKAGE} import ", text, flags=re.M)
    text = re.sub(r"^import warden\.v1\.", f"import {PY_PACKAGE}.", text, flags=re.M)
    # The module name the message classes are registered under (their __module__).
    text = re.sub(r"'warden\.v1\.(\w+_pb2)'", rf"'{PY_PACKAGE}.\1'", text)
    return text


def generate(proto_dir: Path, out: Path) -> list[str]:
    """Writes the generated package into ``out`` (replacing it); returns the file names."""
    protos = sorted((proto_dir / PROTO_PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {proto_dir / PROTO_PACKAGE_DIR}")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--mypy_out=quiet:{tmp}",
            f"--mypy_grpc_out=quiet:{tmp}",
            *[str(p.relative_to(proto_dir)) for p in protos],
        ]
        subprocess.run(cmd, check=True, cwd=proto_dir)
        generated = Path(tmp) / PROTO_PACKAGE_DIR
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        names = []
        for f in sorted(generated.iterdir()):
            (out / f.name).write_text(_rewrite(f.read_text(encoding="utf-8")), encoding="utf-8")
            names.append(f.name)
        (out / "__init__.py").write_text(INIT, encoding="utf-8")
        names.append("__init__.py")
        return sorted(names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proto-dir", type=Path, default=DEFAULT_PROTO_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    names = generate(args.proto_dir.resolve(), args.out.resolve())
    print(f"generated {len(names)} files into {args.out}")


if __name__ == "__main__":
    main()
