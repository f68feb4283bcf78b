"""The Flower tests import their shared app (``apps``) by name: this folder on sys.path, so
that ``pytest tests/flower`` collects them without a PYTHONPATH of its own. Ray is told not
to warn about accelerators it does not see (the suite runs with warnings as errors).

Ray's worker processes leave ``/dev/null`` handles in this process that the garbage collector
finds later, in whatever test happens to run then (a deployment test after the simulations,
in CI's order). Those, and only those, are ignored in every test here."""

from __future__ import annotations

import gc
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")

_RAY_DEVNULL = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in.*name='/dev/null':pytest.PytestUnraisableExceptionWarning"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(_RAY_DEVNULL)


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Collect Ray's leftover ``/dev/null`` handles before pytest's last sweep for unraisable
    exceptions does (it runs after every test, where the marker above no longer applies);
    their ResourceWarnings, and only those, are ignored."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"unclosed file <_io\.TextIOWrapper name='/dev/null'")
        gc.collect()


@pytest.fixture
def task(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Flower's process identity, which building a Message needs (its runtimes set it), for
    tests that make messages without a Flower run; monkeypatch puts Flower's own values back
    afterwards. Flower is imported here, not above: without it the modules skip."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("task_id", 1), ("run_id", 1), ("node_id", 0)):
        monkeypatch.setattr(TaskIdentity, f"_{name}", value)
    yield
