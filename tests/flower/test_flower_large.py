"""A model over 2 GiB (issue 28): one float32 tensor of 2 GiB + 64 MiB, more than a Flower
message (a protobuf, 2 GiB at most) can carry, goes from BlockStrategy's ``configure_train``
through a node's ``blocks_mod`` and back to the strategy's ``aggregate_train`` as a reference
of a few hundred bytes, its arrays moved as blocks and equal to the element at both ends.
Driven without a Flower run (the strategy's calls and the mod on messages made here); the
block service's, the strategy's and the node's stores are directories (about 6.2 GiB on disk,
deleted afterwards), so that memory holds the model and a copy or two of it (peak RSS 4.7 GiB
here). The download moves the 2 GiB; the node returns the model unchanged (a frozen model),
so its reply, hashed again into the same root, sends only what the service lacks: manifests."""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
from flwr.app import (  # noqa: E402
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from tensorswap.flower import ArrayRef, BlockLink, BlockService, BlockStrategy  # noqa: E402
from tensorswap.flower.mod import blocks_mod, shared_link  # noqa: E402
from tensorswap.flower.records import record_of  # noqa: E402
from tensorswap.flower.strategy import content_bytes  # noqa: E402
from tensorswap.store import DirectoryStore  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FLOATS = (1 << 29) + (1 << 24)
"""2 GiB + 64 MiB of float32 in one tensor: sizes and offsets past 2**31 bytes."""
NODE = 7
SLICE = 1 << 24


def part(at: int) -> np.ndarray:
    """Elements ``at`` to ``at + SLICE`` of the model: each its own index rounded to float32
    (numpy's float32 ``arange`` drifts past 2**24), so no two chunks are alike."""
    return np.arange(at, min(at + SLICE, FLOATS), dtype=np.int64).astype(np.float32)


def values() -> np.ndarray:
    """The model's tensor, made a slice at a time (no int64 copy of it all)."""
    out = np.empty(FLOATS, np.float32)
    for at in range(0, FLOATS, SLICE):
        out[at : at + SLICE] = part(at)
    return out


def assert_is_the_model(array: np.ndarray) -> None:
    """``array`` equals ``values()`` element for element (compared a slice at a time)."""
    assert array.dtype == np.float32 and array.shape == (FLOATS,)
    for at in range(0, FLOATS, SLICE):
        assert np.array_equal(array[at : at + SLICE], part(at)), at


class Kept(FedAvg):  # type: ignore[misc]
    """A strategy that returns its one reply's arrays as they came (no arithmetic)."""

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        (reply,) = list(replies)
        return reply.content["arrays"], MetricRecord({"replies": 1})


class OneNode:
    def get_node_ids(self) -> list[int]:
        return [NODE]


@pytest.fixture
def stores(tmp_path: Path) -> Iterator[Path]:
    """A folder for the three stores (about 6.2 GiB), deleted after the test: pytest keeps
    its last runs' ``tmp_path``s, which would keep the blocks too."""
    free_disk = shutil.disk_usage(tmp_path).free
    if free_disk < NEEDS_DISK:
        pytest.skip(f"needs {NEEDS_DISK >> 30} GiB free under {tmp_path}, has {free_disk >> 30}")
    available = _available_memory()
    if available is not None and available < NEEDS_MEMORY:
        pytest.skip(f"needs {NEEDS_MEMORY >> 30} GiB of memory available, has {available >> 30}")
    yield tmp_path
    shutil.rmtree(tmp_path, ignore_errors=True)


NEEDS_DISK = 8 << 30  # the three stores (~6.2 GiB) and some room
NEEDS_MEMORY = 7 << 30  # the model and a copy or two (peak RSS 4.7 GiB here)


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None where there is none (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reference_in(content: RecordDict) -> ArrayRef:
    return ArrayRef.parse("arrays", dict(content["arrays"].items()))


@pytest.mark.usefixtures("task")
def test_a_model_over_2_gib_goes_by_reference_and_comes_back_equal(stores: Path) -> None:
    carried: list[int] = []

    def train(message: Message, context: Context) -> Message:
        arrays = message.content["arrays"]
        assert_is_the_model(arrays["big"].numpy())
        reply = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})
        return Message(reply, reply_to=message)

    with BlockService(DirectoryStore(stores / "service")) as service:
        link = BlockLink(service.address, store=DirectoryStore(stores / "strategy"))
        one = Kept(min_train_nodes=1, min_available_nodes=1)  # else Flower waits for 2 nodes
        with BlockStrategy(one, service.address, swarm=False, link=link) as strategy:
            model = record_of({"big": values()})
            (message,) = strategy.configure_train(1, model, ConfigRecord(), OneNode())  # type: ignore[arg-type]
            del model
            carried.append(content_bytes(message.content))
            sent = reference_in(message.content)
            assert sent.shapes == ((FLOATS,),) and sent.nbytes > 2**31

            mod = blocks_mod(service.address, store=stores / "node")
            reply = mod(message, Context(1, NODE, {}, RecordDict(), {}), train)
            del message
            carried.append(content_bytes(reply.content))
            assert reference_in(reply.content).root == sent.root  # the same blocks came back
            node = shared_link(service.address, store=stores / "node").counters
            assert node.fetched_bytes > 2**31 and node.sent_bytes < 2**20, node

            arrays, _ = strategy.aggregate_train(1, [reply])
            assert arrays is not None
            assert_is_the_model(arrays["big"].numpy())
    assert all(n < 4096 for n in carried), carried  # the messages: references only
