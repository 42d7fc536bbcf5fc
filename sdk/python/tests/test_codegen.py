"""The checked-in generated contract (``warden_sdk.v1``) is exactly what ``proto/`` generates."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mesh import REPO_ROOT, SDK_ROOT

GENERATED = SDK_ROOT / "src" / "warden_sdk" / "v1"
REGENERATE = "run `sdk/python/run-tests.sh --generate` and commit src/warden_sdk/v1"


def _generator() -> object:
    spec = importlib.util.spec_from_file_location("gen_protos", SDK_ROOT / "tools" / "gen_protos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_protos"] = module
    spec.loader.exec_module(module)
    return module


def test_checked_in_stubs_match_a_fresh_generation_from_proto(tmp_path: Path) -> None:
    gen = _generator()
    fresh = tmp_path / "v1"
    names = gen.generate(REPO_ROOT / "proto", fresh)  # type: ignore[attr-defined]
    checked_in = sorted(p.name for p in GENERATED.iterdir() if p.is_file())
    assert checked_in == names, f"file set differs: {REGENERATE}"
    stale = [n for n in names if (fresh / n).read_text() != (GENERATED / n).read_text()]
    assert not stale, f"{stale} drifted from proto/: {REGENERATE}"


def test_every_service_of_the_contract_has_a_stub() -> None:
    from warden_sdk.v1 import ledger_pb2_grpc, planner_pb2_grpc, policy_pb2_grpc, runs_pb2_grpc, toolhost_pb2_grpc

    for module, services in [
        (runs_pb2_grpc, ["Runs"]),
        (ledger_pb2_grpc, ["Ledger"]),
        (policy_pb2_grpc, ["Policy", "Capabilities", "Approvals"]),
        (planner_pb2_grpc, ["Planner"]),
        (toolhost_pb2_grpc, ["ToolHost"]),
    ]:
        for s in services:
            assert hasattr(module, f"{s}Stub") and hasattr(module, f"{s}Servicer"), s


def test_generated_messages_keep_the_wire_names_of_the_contract() -> None:
    from warden_sdk.v1 import toolhost_pb2

    assert toolhost_pb2.InvokeRequest.DESCRIPTOR.full_name == "warden.v1.InvokeRequest"
    assert toolhost_pb2.InvokeRequest.__module__ == "warden_sdk.v1.toolhost_pb2"
