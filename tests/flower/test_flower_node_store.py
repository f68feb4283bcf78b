"""A node's blocks on disk (``NodeStore``, ``blocks_mod(..., store=DIR)``): a link opened later
in another process of the same node fetches only what none of them held, and the directory
keeps the last few roots (no Flower needed)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid
from tensorswap.flower import BlockLink, BlockService, NodeStore
from tensorswap.store import manifest_closure

FLOATS = 1 << 20  # 4 MiB a tensor: one chunk each


def model(round_no: int) -> dict[str, np.ndarray]:
    """A frozen tensor (the same every round) and one that changes."""
    rng = np.random.default_rng(round_no)
    return {
        "frozen": np.arange(FLOATS, dtype=np.float32),
        "head": rng.standard_normal(FLOATS).astype(np.float32),
    }


@pytest.fixture
def service() -> Iterator[BlockService]:
    with BlockService() as running:
        yield running


def fetch_in_another_process(address: str, directory: Path, root: Cid) -> int:
    """What a fresh ``flwr-clientapp`` process does with the node's store: fetch ``root``;
    the bytes it had to fetch."""
    code = (
        "import sys\n"
        "from tensorswap.cid import Cid\n"
        "from tensorswap.flower import BlockLink, NodeStore\n"
        "with BlockLink(sys.argv[1], store=NodeStore(sys.argv[2])) as link:\n"
        "    link.fetch(Cid.parse(sys.argv[3]))\n"
        "    print(link.counters.fetched_bytes)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, address, str(directory), str(root)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return int(done.stdout.split()[-1])


def test_a_later_process_of_the_node_fetches_only_what_changed(
    service: BlockService, tmp_path: Path
) -> None:
    roots = []
    with BlockLink(service.address) as server_side:
        roots = [server_side.push(model(r)) for r in (1, 2)]
    node = tmp_path / "node"
    first = fetch_in_another_process(service.address, node, roots[0])
    second = fetch_in_another_process(service.address, node, roots[1])
    assert first >= 2 * FLOATS * 4  # both tensors
    assert FLOATS * 4 <= second < 1.5 * FLOATS * 4  # the changed one only (and manifests)
    store = NodeStore(node)
    assert store.roots() == roots
    with BlockLink(service.address, store=store) as link:
        got = link.fetch(roots[1])
        assert link.counters.fetched_bytes == 0  # all on disk already
    np.testing.assert_array_equal(got["head"], model(2)["head"])


def test_the_node_keeps_the_last_roots_and_collects_the_rest(
    service: BlockService, tmp_path: Path
) -> None:
    with BlockLink(service.address) as server_side:
        roots = [server_side.push(model(r)) for r in range(1, 5)]
    store = NodeStore(tmp_path / "node", keep=2, grace=0.0)
    with BlockLink(service.address, store=store) as link:
        for root in roots:
            link.fetch(root)
    assert store.roots() == roots[-2:]
    held = set(store.store)
    kept = set().union(*(manifest_closure(store.store, r) for r in roots[-2:]))
    assert held == kept  # the frozen chunk stays: the kept roots list it
    assert store.collected > 0
    assert not store.store.has(roots[0])


def test_a_damaged_roots_file_loses_only_its_bad_lines(tmp_path: Path) -> None:
    store = NodeStore(tmp_path / "node")
    good = Cid.of(b"x")
    (tmp_path / "node" / "flower-roots").write_text(f"not-a-cid\n{good}\n")
    assert store.roots() == [good]
    with pytest.raises(ValueError, match="at least 1"):
        NodeStore(tmp_path / "other", keep=0)


def test_a_fetch_in_progress_holds_off_the_collections_of_the_other_processes(
    tmp_path: Path,
) -> None:
    store = NodeStore(tmp_path / "node")

    def collection_could_run() -> bool:
        """What another process's ``remember`` finds: can it take the lock exclusively?"""
        fd = os.open(tmp_path / "node" / "flower-roots.lock", os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    with store.reading():
        assert not collection_could_run()
        with NodeStore(tmp_path / "node").reading():  # fetches share it
            assert not collection_could_run()
    assert collection_could_run()
