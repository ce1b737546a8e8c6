"""The direction of imports (docs/architecture.md, "Import rules"), in a fresh interpreter each.

What a module pulls in is what the process pays for at start and what it can break on: a
user's client must not need numba or the worker's store to upsert, and the coordinator must
not load the worker's journal and kernels. (`make lint` checks the static contracts with
import-linter; this checks what actually gets loaded, lazy imports included.)
"""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import coordinator.placement

PROBE = """
import json, sys
import {modules}
print(json.dumps(sorted(sys.modules)))
"""


def loaded_by(*modules: str) -> set[str]:
    """Every module name in sys.modules after a fresh interpreter imports ``modules``."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(modules=", ".join(modules))],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def under(modules: set[str], *roots: str) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in roots)


@pytest.mark.parametrize("module", ["shared.client", "shared.client.memory", "shared.cli.main"])
def test_client_side_loads_no_daemon_numba_or_torch(module: str) -> None:
    loaded = loaded_by(module)

    assert module in loaded  # the probe imported what it says
    assert under(loaded, "worker", "coordinator", "numba", "torch") == []


def test_coordinator_server_loads_no_worker_module() -> None:
    loaded = loaded_by("coordinator.server")

    assert "coordinator.server" in loaded
    assert under(loaded, "worker", "numba") == []


def test_worker_server_loads_no_coordinator_module() -> None:
    loaded = loaded_by("worker.server")

    assert "worker.server" in loaded
    assert under(loaded, "coordinator") == []


def test_placement_loads_neither_the_training_nor_the_memory_room() -> None:
    """The rooms that run jobs build on placement, never the reverse (pyproject's contract)."""
    modules = [
        m.name
        for m in pkgutil.iter_modules(coordinator.placement.__path__, "coordinator.placement.")
    ]
    loaded = loaded_by(*modules)

    assert "coordinator.placement.rebalance" in modules and set(modules) <= loaded
    rooms = ("coordinator.training", "coordinator.memory")
    assert sorted(m for m in loaded if m.startswith(rooms)) == []
