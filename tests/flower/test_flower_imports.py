"""What a ClientApp process imports: in deployment each message runs in a fresh
``flwr-clientapp`` process, which imports the app (and ``blocks_mod``) first. Importing the
mod, and passing it a message the bridge has nothing to do with, must leave the data plane
(link, wire, store, swarm, the rounds engine) and pyarrow unimported; a message holding a
reference imports them. Each check runs in a fresh interpreter (Flower's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from tensorswap.flower import mod
from tensorswap.flower.records import REPLY_PLAN
from tensorswap.flower.reference import MARKER

HEAVY = (
    "tensorswap.flower.link",
    "tensorswap.wire",
    "tensorswap.store",
    "tensorswap.swarm",
    "tensorswap.rounds",
    "tensorswap.codec",
    "pyarrow",
)
"""Modules (and their submodules) the mod's import must not bring."""

_CHILD = """
import json, sys
import flwr.app, flwr.clientapp
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
for name, value in (("task_id", 1), ("run_id", 1), ("node_id", 3)):
    setattr(TaskIdentity, "_" + name, value)
from tensorswap.flower import blocks_mod
seen = {"import": sorted(sys.modules)}
content = RecordDict({"config": ConfigRecord({"lr": 0.1}), "arrays": ArrayRecord()})
if sys.argv[1] == "reference":
    content["arrays"] = ConfigRecord({"tensorswap.ref": 1})
message = Message(content, dst_node_id=3, message_type="train")
def answer(m, c):
    return Message(RecordDict(), reply_to=m)
try:
    blocks_mod("127.0.0.1:9")(message, Context(1, 3, {}, RecordDict(), {}), answer)
except Exception as exc:
    seen["raised"] = type(exc).__name__
seen["message"] = sorted(sys.modules)
print(json.dumps(seen))
"""


def _child(kind: str) -> dict[str, list[str] | str]:
    env = {**os.environ, "PYTHONPATH": str(Path(mod.__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, kind],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=env,
    )
    seen: dict[str, list[str] | str] = json.loads(done.stdout.splitlines()[-1])
    return seen


def _heavy(modules: list[str] | str) -> list[str]:
    return [m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY)]


def test_the_mod_imports_no_data_plane_until_a_message_needs_it() -> None:
    plain = _child("plain")
    assert _heavy(plain["import"]) == []
    assert _heavy(plain["message"]) == []  # no reference, no plan: passed on untouched
    assert "raised" not in plain
    bridged = _child("reference")  # a (broken) reference: the data plane is imported to read it
    assert "tensorswap.flower.records" in bridged["message"]
    assert bridged.get("raised") == "BadReference"


def test_the_mod_tells_bridged_messages_by_the_bridge_s_own_marks() -> None:
    assert (mod.PLAN_KEY, mod.REF_MARKER) == (REPLY_PLAN, MARKER)
