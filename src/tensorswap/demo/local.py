"""What a demo peer holds and does on its own: shard, model, local training, its command and
report lines."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tensorswap.demo.inbox import DeltaInbox

__all__ = ["PeerState", "build_state", "commands", "emit", "fail", "log", "next_command"]


async def commands() -> asyncio.StreamReader:
    """The driver's commands: this process's stdin as an asyncio stream."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def next_command(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next command (a JSON object on a line of its own); None at the end of input."""
    while True:
        line = await reader.readline()
        if not line:
            return None
        if line.strip():
            cmd = json.loads(line)
            if not isinstance(cmd, dict):
                raise ValueError(f"a command must be a JSON object, got {line!r}")
            return cmd


def emit(event: str, **fields: Any) -> None:
    """One JSON report line on stdout."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def emit_ready(state: PeerState, **fields: Any) -> None:
    """The peer's ``ready`` line: its name, samples, starting accuracy and process id."""
    emit(
        "ready",
        peer=state.name,
        samples=state.shard.num_samples,
        accuracy=state.accuracy(),
        pid=os.getpid(),
        **fields,
    )


def fail(message: str, code: int = 2) -> int:
    """Report a fatal error (stdout event + stderr line) and return the exit code."""
    emit("error", message=message)
    print(f"tensorswap demo peer: {message}", file=sys.stderr, flush=True)
    return code


def _copy(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.array(v, copy=True) for k, v in tensors.items()}


@dataclass
class PeerState:
    """What one peer holds between rounds."""

    args: argparse.Namespace
    name: str
    model: Any
    shard: Any
    test_x: np.ndarray
    test_y: np.ndarray
    samples_of: dict[str, int]
    residual: dict[str, np.ndarray] | None = None
    inbox: DeltaInbox | None = None  # p2p: the parts of the other peers' deltas
    swarm: Any = None  # --swarm: this peer's `tensorswap.swarm.SwarmPeer`

    def weights(self) -> dict[str, np.ndarray]:
        from tensorswap.torch import tensors_of

        return _copy(tensors_of(self.model))

    def load(self, tensors: Mapping[str, np.ndarray]) -> None:
        from tensorswap.torch import load_tensors

        load_tensors(self.model, tensors)

    def accuracy(self) -> float:
        from tensorswap.demo.task import evaluate

        return evaluate(self.model, self.test_x, self.test_y)

    def train(self, round_number: int) -> tuple[dict[str, np.ndarray], float]:
        """Train from the current (global) weights; (weights before, mean loss)."""
        from tensorswap.demo.task import train_local

        base = self.weights()
        seed = self.args.seed * 1_000_003 + round_number * 1009 + self.args.index
        loss = train_local(self.model, self.shard, epochs=self.args.local_epochs, seed=seed)
        return base, loss


def log(message: str) -> None:
    """One line on stderr (the driver keeps it in the peer's log file)."""
    print(f"tensorswap demo peer: {message}", file=sys.stderr, flush=True)


def build_state(args: argparse.Namespace) -> PeerState:
    """Load this peer's shard and the test set, and build the model from the shared seed."""
    import torch

    from tensorswap.demo.task import load_dataset, make_model

    torch.set_num_threads(1)
    data = load_dataset(args.peers, seed=args.seed)
    samples_of = {f"peer-{i}": s.num_samples for i, s in enumerate(data.shards)}
    model = make_model(args.seed)
    if args.freeze_first_layer:
        # Federated fine-tuning: the first layer keeps the shared initial weights.
        for param in model[0].parameters():
            param.requires_grad_(False)
    return PeerState(
        args=args,
        name=f"peer-{args.index}",
        model=model,
        shard=data.shards[args.index],
        test_x=data.test_x,
        test_y=data.test_y,
        samples_of=samples_of,
    )
