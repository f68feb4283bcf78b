"""`tensorswap demo`: store several peers' model updates, aggregate them, show CIDs and timings."""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tensorswap.aggregate import AggregatorKind, AggregatorSpec, aggregate
from tensorswap.cid import Cid
from tensorswap.store import DirectoryStore, ModelUpdate, get_update, put_update

# A small multi-layer perceptron's shapes: (name, shape).
LAYERS = [
    ("embed.weight", (4096, 256)),
    ("block0.weight", (256, 1024)),
    ("block0.bias", (1024,)),
    ("block1.weight", (1024, 256)),
    ("block1.bias", (256,)),
    ("head.weight", (256, 10)),
]


@dataclass(frozen=True)
class PeerResult:
    peer: int
    cid: Cid
    num_samples: int
    nbytes: int
    new_bytes: int
    seconds: float


def short_cid(cid: Cid) -> str:
    """The CID with its middle elided (manifest CIDs share a long common prefix)."""
    text = str(cid)
    return f"{text[:14]}…{text[-10:]}"


def random_update(rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    """A model update with the demo's layer shapes (float32, normal noise of `scale`)."""
    return {
        name: rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
        for name, shape in LAYERS
    }


def run_demo(data_dir: Path, peers: int, aggregator: str, seed: int, console: Console) -> int:
    """Store `peers` updates in a directory store under `data_dir`, aggregate, print a report."""
    rng = np.random.default_rng(seed)
    store = DirectoryStore(data_dir / "blocks")
    base = random_update(rng, 1.0)
    results: list[PeerResult] = []
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("storing peer updates", total=peers)
        for peer in range(peers):
            update = {
                k: v + rng.standard_normal(v.shape, dtype=np.float32) * np.float32(0.01)
                for k, v in base.items()
            }
            # The embedding is frozen in this demo: its chunks are stored once for all peers.
            update["embed.weight"] = base["embed.weight"]
            before = store.size().nbytes
            start = time.perf_counter()
            cid = put_update(store, ModelUpdate(update, num_samples=100 * (peer + 1)))
            seconds = time.perf_counter() - start
            nbytes = sum(v.nbytes for v in update.values())
            results.append(
                PeerResult(
                    peer, cid, 100 * (peer + 1), nbytes, store.size().nbytes - before, seconds
                )
            )
            progress.advance(task)

    table = Table(title=f"{peers} peer updates in {data_dir / 'blocks'}")
    table.add_column("peer", justify="right")
    table.add_column("update CID")
    table.add_column("samples", justify="right")
    table.add_column("MiB", justify="right")
    table.add_column("new MiB", justify="right")
    table.add_column("store GB/s", justify="right")
    for r in results:
        table.add_row(
            str(r.peer),
            short_cid(r.cid),
            str(r.num_samples),
            f"{r.nbytes / 2**20:.1f}",
            f"{r.new_bytes / 2**20:.1f}",
            f"{r.nbytes / r.seconds / 1e9:.2f}",
        )
    console.print(table)

    start = time.perf_counter()
    loaded = [get_update(store, r.cid) for r in results]
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    result = aggregate(
        [(dict(u.tensors), u.num_samples) for u in loaded],
        AggregatorSpec(AggregatorKind(aggregator)),
    )
    agg_s = time.perf_counter() - start
    assert isinstance(result.values, dict)
    agg_cid = put_update(
        store, ModelUpdate(result.values, num_samples=result.total_samples, name="aggregate")
    )
    total = sum(r.nbytes for r in results)
    console.print(
        f"loaded {len(loaded)} updates ({total / 2**20:.0f} MiB, hash-verified, zero-copy) in "
        f"{load_s:.3f}s; {aggregator} over {len(result.used)} in {agg_s:.3f}s "
        f"({total / agg_s / 1e9:.2f} GB/s)"
    )
    console.print(f"aggregate CID [bold]{agg_cid}[/bold] ({result.total_samples} samples)")
    size = store.size()
    console.print(f"store holds {size.blocks} blocks, {size.nbytes / 2**20:.1f} MiB")
    store.close()
    return 0


@click.command("demo")
@click.option(
    "--peers",
    default=4,
    show_default=True,
    type=click.IntRange(1, 64),
    help="How many peer updates to build and aggregate.",
)
@click.option(
    "--aggregator",
    default="fedavg",
    show_default=True,
    type=click.Choice([k.value for k in AggregatorKind]),
    help="Aggregation rule.",
)
@click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the block store here (default: a temporary directory).",
)
@click.option("--seed", default=0, show_default=True, help="Random seed.")
def demo(peers: int, aggregator: str, data_dir: Path | None, seed: int) -> int:
    """Build random multi-layer model updates, store them content-addressed, aggregate them.

    Prints each update's CID, size, how much was new to the store (frozen layers dedup),
    and the load and aggregation throughput.
    """
    console = Console()
    if data_dir is not None:
        return run_demo(data_dir, peers, aggregator, seed, console)
    with tempfile.TemporaryDirectory(prefix="tensorswap-demo-") as tmp:
        return run_demo(Path(tmp), peers, aggregator, seed, console)
