"""A real Warden mesh for the tests: the built Rust binaries as separate processes, wired
the way ``libs/testkit/src/mesh.rs`` wires them, plus the Python tool host of ``hostapp.py``
as one more tool host of the planner and the executor.

``warden dev`` would be simpler, but it overwrites ``[planner]``/``[executor] tool_hosts``
with its own endpoint, so it cannot reach a Python host; separate processes can.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

SDK_ROOT = Path(__file__).resolve().parent.parent
REPO_ROOT = SDK_ROOT.parent.parent
HOSTAPP = Path(__file__).resolve().parent / "hostapp.py"

TENANT = "acme"
ALLOWED = ["echo", "text.upper", "sleep", "fail", "py.*"]


def bin_dir() -> Path:
    """The Rust binaries: ``WARDEN_BIN_DIR``, else ``$CARGO_TARGET_DIR/debug``, else the
    workspace's ``target/debug``."""
    if os.environ.get("WARDEN_BIN_DIR"):
        return Path(os.environ["WARDEN_BIN_DIR"])
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO_ROOT / "target")
    return target / "debug"


def binary(name: str) -> Path:
    p = bin_dir() / name
    if not p.is_file():
        raise RuntimeError(f"{p} is not built: run `cargo build --workspace --bins` first")
    return p


def _die_with_parent() -> None:
    """Children get SIGKILL when the test process dies, so no mesh outlives a killed run."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# util-linux's setpriv sets the same death signal and then execs the service, so no Python
# code runs in the forked child. Python code between fork and exec (``preexec_fn``) is unsafe
# in a process with threads — this one has gRPC's — and was seen to leave a restarted host
# dead before it listened. The ``preexec_fn`` is kept only for machines without setpriv.
_SETPRIV = shutil.which("setpriv")


def _spawn_argv(argv: list[str]) -> tuple[list[str], Callable[[], None] | None]:
    """The command that starts ``argv`` as a child that dies with this process."""
    if _SETPRIV is not None:
        return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv], None
    return argv, _die_with_parent


@dataclass
class Service:
    """One process of the mesh; ``endpoint`` is what it announced."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    endpoint: str = ""
    proc: subprocess.Popen[str] | None = field(default=None, repr=False)

    def start(self, timeout: float = 60.0) -> None:
        log = open(self.log, "a", encoding="utf-8")  # noqa: SIM115 (owned by the child)
        argv, preexec = _spawn_argv(self.argv)
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, **self.env},
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            text=True,
            preexec_fn=preexec,
        )
        log.close()
        lines: queue.Queue[str] = queue.Queue()
        proc = self.proc

        def drain() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)

        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                if proc.poll() is not None:
                    break
                continue
            if line.startswith("WARDEN_LISTENING "):
                self.endpoint = line.split()[2]
                return
        self.kill()
        raise RuntimeError(f"{self.name} did not start; its log:\n{self.log.read_text(errors='replace')}")

    def kill(self) -> None:
        """SIGKILL: a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


@dataclass
class Mesh:
    dir: Path
    ledger: Service
    policy: Service
    tools: Service
    pyhost: Service
    planner: Service
    executor: Service

    @property
    def endpoint(self) -> str:
        """The front door (the executor's ``Runs``)."""
        return self.executor.endpoint

    @property
    def effects_file(self) -> Path:
        return self.dir / "effects.jsonl"

    def effects(self) -> list[dict[str, object]]:
        """Every time a Python tool's function body ran, in order."""
        if not self.effects_file.exists():
            return []
        return [json.loads(line) for line in self.effects_file.read_text().splitlines() if line.strip()]

    def restart_pyhost(self) -> None:
        """Kills the Python host (SIGKILL) and starts it again on the same address (gRPC
        listens with SO_REUSEADDR, so the address is free again once the process is gone)."""
        self.pyhost.kill()
        self.pyhost.argv[-1] = self.pyhost.endpoint.removeprefix("http://")
        self.pyhost.start()

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Runs the Rust ``warden`` CLI against this mesh."""
        env = {
            **os.environ,
            "WARDEN_ENDPOINT": self.endpoint,
            "WARDEN_LEDGER_ENDPOINT": self.ledger.endpoint,
            "WARDEN_POLICY_ENDPOINT": self.policy.endpoint,
            "WARDEN_TENANT": TENANT,
        }
        return subprocess.run(
            [str(binary("warden")), *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )

    def logs(self) -> str:
        out = []
        for s in (self.ledger, self.policy, self.tools, self.pyhost, self.planner, self.executor):
            out.append(f"--- {s.name} ---\n{s.log.read_text(errors='replace') if s.log.exists() else ''}")
        return "\n".join(out)

    def stop(self) -> None:
        for s in (self.executor, self.planner, self.pyhost, self.tools, self.policy, self.ledger):
            s.stop()


def start_mesh(root: Path) -> Mesh:
    root.mkdir(parents=True, exist_ok=True)
    config = root / "warden.toml"
    config.write_text(
        f"""
[ledger]
database_url = "sqlite://{root / "ledger.db"}"
key_file = "{root / "ledger.key"}"

[policy]
key_file = "{root / "policy.key"}"
database_url = "sqlite://{root / "policy.db"}"

[policy.tenants.{TENANT}]
allow_tools = {_toml_list(ALLOWED)}
require_approval = ["py.gated"]

[planner]
max_steps = 10

[executor]
redis_url = ""
lease_ttl_ms = 2000
sweep_interval_ms = 500
retry_backoff_base_ms = 10

[tools]
outbox_path = "{root / "outbox.jsonl"}"
"""
    )
    # Metrics on free ports: the services' default ports would collide between meshes.
    base = {"WARDEN_CONFIG": str(config), "RUST_LOG": "warn", "WARDEN_METRICS_LISTEN": "127.0.0.1:0"}

    def service(name: str, bin_name: str, **env: str) -> Service:
        s = Service(name, [str(binary(bin_name))], {**base, **env}, root / f"{name}.log")
        s.start()
        return s

    started: list[Service] = []
    try:
        # The ledger verifies decisions with the policy's keys and the policy records into
        # the ledger: the policy's address is chosen first so each can name the other.
        policy_addr = f"127.0.0.1:{free_port()}"
        ledger = service(
            "ledger",
            "warden-ledger",
            WARDEN_LEDGER__LISTEN="127.0.0.1:0",
            WARDEN_LEDGER__POLICY_ENDPOINT=f"http://{policy_addr}",
        )
        started.append(ledger)
        policy = service(
            "policy", "warden-policy", WARDEN_POLICY__LISTEN=policy_addr, WARDEN_POLICY__LEDGER_ENDPOINT=ledger.endpoint
        )
        started.append(policy)
        tools = service(
            "tools",
            "warden-tools",
            WARDEN_TOOLS__LISTEN="127.0.0.1:0",
            WARDEN_TOOLS__POLICY_ENDPOINT=policy.endpoint,
            WARDEN_TOOLS__LEDGER_ENDPOINT=ledger.endpoint,
        )
        started.append(tools)
        pyhost = Service(
            "pyhost",
            [sys.executable, str(HOSTAPP), "127.0.0.1:0"],
            {
                "WARDEN_POLICY_ENDPOINT": policy.endpoint,
                "WARDEN_LEDGER_ENDPOINT": ledger.endpoint,
                "WARDEN_TOOLS_STATE": str(root / "pyhost.db"),
                "HOSTAPP_EFFECTS": str(root / "effects.jsonl"),
                "PYTHONUNBUFFERED": "1",
            },
            root / "pyhost.log",
        )
        pyhost.start()
        started.append(pyhost)
        hosts = _toml_list([tools.endpoint, pyhost.endpoint])
        planner = service(
            "planner", "warden-planner", WARDEN_PLANNER__LISTEN="127.0.0.1:0", WARDEN_PLANNER__TOOL_HOSTS=hosts
        )
        started.append(planner)
        executor = service(
            "executor",
            "warden-executor",
            WARDEN_EXECUTOR__LISTEN="127.0.0.1:0",
            WARDEN_EXECUTOR__LEDGER_ENDPOINT=ledger.endpoint,
            WARDEN_EXECUTOR__POLICY_ENDPOINT=policy.endpoint,
            WARDEN_EXECUTOR__PLANNER_ENDPOINT=planner.endpoint,
            WARDEN_EXECUTOR__TOOL_HOSTS=hosts,
            WARDEN_EXECUTOR__EXECUTOR_ID="executor-0",
        )
        started.append(executor)
    except BaseException:
        for s in reversed(started):
            s.kill()
        raise
    return Mesh(root, ledger, policy, tools, pyhost, planner, executor)


class Gate:
    """A FIFO a gated test tool (``py.slow``, ``py.hang``) blocks on until :meth:`release`:
    the test decides when the tool's work ends, instead of both sides guessing a duration."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / f"gate-{uuid.uuid4().hex}"
        os.mkfifo(self.path)

    def release(self, timeout: float = 60.0) -> None:
        """Ends the tool's work: opening for writing waits until the tool is reading (it runs),
        then the tool's read returns. The timeout only guards against a hang."""
        opened = threading.Thread(target=lambda: open(self.path, "w", encoding="utf-8").close(), daemon=True)
        opened.start()
        opened.join(timeout)
        if opened.is_alive():
            raise TimeoutError(f"no tool waited on {self.path}")
