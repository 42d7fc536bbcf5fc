"""Fixtures: one real mesh for the whole session (``mesh.py``), and clients pointed at it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from mesh import TENANT, Mesh, start_mesh
from warden_sdk import AsyncClient, Client


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    m = start_mesh(tmp_path_factory.mktemp("mesh"))
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failing test that used the mesh prints its services' logs."""
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed and "mesh" in request.fixturenames:
        print(request.getfixturevalue("mesh").logs()[-20000:])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep


def _kwargs(mesh: Mesh) -> dict[str, str]:
    return {
        "tenant": TENANT,
        "ledger_endpoint": mesh.ledger.endpoint,
        "policy_endpoint": mesh.policy.endpoint,
        "planner_endpoint": mesh.planner.endpoint,
    }


@pytest.fixture(scope="session")
def client(mesh: Mesh) -> Iterator[Client]:
    with Client(mesh.endpoint, **_kwargs(mesh)) as c:
        yield c


@pytest.fixture
async def aclient(mesh: Mesh) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(mesh.endpoint, **_kwargs(mesh)) as c:
        yield c


def payload(event: Any) -> Any:
    return json.loads(event.payload_json)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path
