"""One federated peer of `tensorswap demo`: `python -m tensorswap.demo.peer --index I ...`.

The peer holds its own non-IID shard of digits (see `tensorswap.demo.task`) and a copy of the
model. The driver (`tensorswap.demo.driver`) sends it commands on stdin, one JSON object a line:

    {"cmd": "peers", "endpoints": {"peer-0": "127.0.0.1:40001", ...}}   # p2p only
    {"cmd": "round", "round": 3, "initiator": "demo-1a2b", "deadline_s": 20.0,
     "expect": ["peer-0", "peer-1", ...]}                     # one round
    {"cmd": "stop"}                                           # (or end of input)

and reads its reports on stdout, one JSON object a line (never pickle): ``ready``,
``trained``, ``submitted``, ``round`` and ``error`` events (see `docs/demo.md`). Logs and
tracebacks go to stderr.

Star topology: the peer trains locally, submits its update to the coordinator's round
(`RoundClient`), waits for the aggregate, fetches it (only blocks it lacks) and evaluates it.
With ``--compression`` other than ``none`` it submits its weight *delta* against the round's
global model, stored with that lossy encoding, and keeps what the encoding lost as a residual
added to the next round's delta (error feedback); the aggregate is then a delta too, which the
peer adds to the global model it started from.

P2P topology: no coordinator. The peer broadcasts its delta as a DWE fragment on the delta bus
to every other peer (split into several parts when it exceeds ``--max-fragment-bytes``),
collects every part of the others' deltas for the round (until the deadline), and aggregates
the whole deltas itself, weighting by each peer's sample count (known to every peer, as the
shards are a deterministic split).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from tensorswap._netaddr import HostPortError, split_host_port
from tensorswap.delta.bincode import MAX_DWE_FRAGMENT_BYTES

__all__ = ["COMPRESSIONS", "DeltaInbox", "main"]

COMPRESSIONS = ("none", "f16", "int8", "topk")
# p2p fragments of round r carry sequence r * SEQ_STRIDE (room for the parts of a split delta).
SEQ_STRIDE = 1000
#: Room for a part's header and a few values of a slice.
MIN_FRAGMENT_BYTES = 1024


def emit(event: str, **fields: Any) -> None:
    """One JSON report line on stdout."""
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


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


class DeltaInbox:
    """The parts of other peers' deltas, by round and sender, until each delta is whole.

    A delta above the size cap arrives as several parts (`split_fragment`) with consecutive
    sequences from ``round * SEQ_STRIDE``, possibly in any order and ahead of their round. A
    sender's delta is complete once its parts, from the first one on without a hole, carry as
    many values as the model has; `take` then reassembles it (checking that the slices join)
    and lays it out as name -> array like ``template``.
    """

    def __init__(self, template: Mapping[str, np.ndarray]) -> None:
        self.template = {k: np.asarray(v) for k, v in template.items()}
        self._values = sum(int(prod(v.shape)) for v in self.template.values())
        self._parts: dict[int, dict[str, dict[int, Any]]] = {}  # round -> sender -> seq -> part
        self._carried: dict[tuple[int, str], int] = {}

    def add(self, fragment: Any) -> None:
        """File one verified part under its round and sender (a repeated sequence is ignored)."""
        number = int(fragment.sequence) // SEQ_STRIDE
        parts = self._parts.setdefault(number, {}).setdefault(fragment.session_id, {})
        if fragment.sequence in parts:
            return
        parts[fragment.sequence] = fragment
        key = (number, fragment.session_id)
        self._carried[key] = self._carried.get(key, 0) + int(fragment.value_count)

    def complete(self, number: int, sender: str) -> bool:
        """True once every part of ``sender``'s delta for round ``number`` has arrived."""
        parts = self._parts.get(number, {}).get(sender)
        if not parts or self._carried.get((number, sender), 0) < self._values:
            return False
        first = number * SEQ_STRIDE
        return all(first + i in parts for i in range(len(parts)))

    def take(self, number: int) -> dict[str, dict[str, np.ndarray]]:
        """The complete deltas of round ``number`` by sender; forgets that round and older ones.

        A sender whose parts are incomplete (the deadline passed) or do not reassemble into
        one delta of the model's layers is left out, with a line on stderr.
        """
        from tensorswap.delta import apply_fragment, reassemble
        from tensorswap.errors import DeltaError

        deltas: dict[str, dict[str, np.ndarray]] = {}
        for sender, parts in sorted(self._parts.get(number, {}).items()):
            if not self.complete(number, sender):
                _log(f"round {number}: {sender}'s delta is incomplete ({len(parts)} parts)")
                continue
            try:
                whole = reassemble([parts[seq] for seq in sorted(parts)])
                indices = sorted(layer.layer_index for layer in whole.layers)
                if indices != list(range(len(self.template))):
                    raise DeltaError(f"layers {indices} do not match the model's")
                states = [np.zeros_like(v) for v in self.template.values()]
                apply_fragment(states, whole)  # checks every layer's index and shape first
            except DeltaError as exc:
                _log(f"round {number}: {sender}'s delta is refused: {exc}")
                continue
            deltas[sender] = dict(zip(self.template, states, strict=True))
        for old in [r for r in self._parts if r <= number]:
            for sender in self._parts.pop(old):
                self._carried.pop((old, sender), None)
        return deltas


def _log(message: str) -> None:
    print(f"tensorswap demo peer: {message}", file=sys.stderr, flush=True)


# ── star: through the coordinator ────────────────────────────────────────────
def _closure_bytes(store: Any, cid: Any) -> int:
    from tensorswap.store import manifest_closure

    return sum(store.get(c).nbytes for c in manifest_closure(store, cid))


async def star_round(state: PeerState, client: Any, cmd: Mapping[str, Any]) -> None:
    from tensorswap.cid import Cid
    from tensorswap.rounds import Complete, RoundAlreadyTerminal, RoundClosed, RoundId
    from tensorswap.store import ModelUpdate, get_update, put_update

    number = int(cmd["round"])
    rid = RoundId(number, str(cmd["initiator"]))
    wait_s = float(cmd.get("deadline_s") or 60.0) + 60.0
    start = time.perf_counter()
    base, loss = await asyncio.to_thread(state.train, number)
    trained = state.weights()
    emit("trained", peer=state.name, round=number, loss=loss)
    n = state.shard.num_samples
    compression = state.args.compression
    dense_bytes = sum(v.nbytes for v in trained.values())
    if compression == "none":
        cid = await asyncio.to_thread(put_update, client.store, ModelUpdate(trained, n))
    else:
        delta = {k: trained[k] - base[k] for k in base}
        if state.residual is not None:
            delta = {k: delta[k] + state.residual[k] for k in delta}
        update = ModelUpdate(delta, n)
        cid = await asyncio.to_thread(put_update, client.store, update, encoding=compression)
        sent = get_update(client.store, cid).tensors  # what the coordinator will decode
        state.residual = {k: delta[k] - sent[k] for k in delta}
    stored = _closure_bytes(client.store, cid)
    late = ""
    sent_bytes = saved = 0
    try:
        result = await client.submit(rid, cid)
        sent_bytes = result.push.sent_bytes
        saved = max(stored - sent_bytes, 0)
    except (RoundAlreadyTerminal, RoundClosed) as exc:
        late = str(exc)  # the round closed (deadline) before this peer's update came in
    emit(
        "submitted",
        peer=state.name,
        round=number,
        sent_bytes=sent_bytes,
        saved_bytes=saved,
        dense_bytes=dense_bytes,
        late=late,
    )
    status = await client.wait(rid, timeout=wait_s)
    if not isinstance(status, Complete):
        state.load(base)  # keep the model the round started from
        emit(
            "round",
            peer=state.name,
            round=number,
            ok=False,
            reason=getattr(status, "reason", status.name),
            accuracy=state.accuracy(),
            sent_bytes=sent_bytes,
            saved_bytes=saved,
            pulled_bytes=0,
            pull_saved_bytes=0,
            seconds=time.perf_counter() - start,
        )
        return
    agg_cid = Cid.parse(status.cid)
    pull = await client.blocks.pull(agg_cid, client.store)
    aggregate = await asyncio.to_thread(get_update, client.store, agg_cid)
    pulled_total = _closure_bytes(client.store, agg_cid)
    if compression == "none":
        state.load(aggregate.tensors)
    else:
        state.load({k: base[k] + aggregate.tensors[k] for k in base})
    emit(
        "round",
        peer=state.name,
        round=number,
        ok=True,
        aggregate=str(agg_cid),
        contributors=int(aggregate.metadata.get("contributors", "0") or 0),
        loss=loss,
        accuracy=state.accuracy(),
        sent_bytes=sent_bytes,
        dense_bytes=dense_bytes,
        saved_bytes=saved,
        pulled_bytes=pull.fetched_bytes,
        pull_saved_bytes=max(pulled_total - pull.fetched_bytes, 0),
        late=late,
        seconds=time.perf_counter() - start,
    )


# ── p2p: the delta bus ───────────────────────────────────────────────────────
async def p2p_round(
    state: PeerState, bus: Any, inbox: asyncio.Queue[Any], cmd: Mapping[str, Any]
) -> None:
    from tensorswap.aggregate import AggregatorKind, AggregatorSpec, aggregate
    from tensorswap.delta import extract_delta_fragment, split_fragment

    number = int(cmd["round"])
    deadline_s = float(cmd.get("deadline_s") or 60.0)
    expect = [str(p) for p in cmd.get("expect", []) if str(p) != state.name]
    loop = asyncio.get_running_loop()
    until = loop.time() + deadline_s
    start = time.perf_counter()
    base, loss = await asyncio.to_thread(state.train, number)
    trained = state.weights()
    emit("trained", peer=state.name, round=number, loss=loss)
    own = {k: trained[k] - base[k] for k in base}
    before = bus.telemetry().sent_bytes
    fragment = extract_delta_fragment(state.name, number * SEQ_STRIDE, trained, base)
    parts = split_fragment(fragment, max_bytes=state.args.max_fragment_bytes)
    if len(parts) > SEQ_STRIDE:
        raise ValueError(f"a delta in {len(parts)} parts does not fit a round's {SEQ_STRIDE}")
    for part in parts:
        await bus.put(part)
    emit("submitted", peer=state.name, round=number, sent_bytes=0, saved_bytes=0, late="")

    collected = state.inbox if state.inbox is not None else DeltaInbox(base)
    state.inbox = collected
    timed_out = False
    while not all(collected.complete(number, p) for p in expect):
        remaining = until - loop.time()
        if remaining <= 0:
            timed_out = True
            break
        try:
            frag = await asyncio.wait_for(inbox.get(), remaining)
        except TimeoutError:
            timed_out = True
            break
        collected.add(frag)
    deltas = collected.take(number)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(bus.flush(), 5.0)
    sent_bytes = bus.telemetry().sent_bytes - before

    names = list(base)
    members = {s: d for s, d in deltas.items() if s in state.samples_of and s != state.name}
    members[state.name] = own
    # One order on every peer (by name): every peer then computes the same average.
    contributions = [(members[s], state.samples_of[s]) for s in sorted(members)]
    spec = AggregatorSpec(AggregatorKind(state.args.aggregator))
    result = aggregate(contributions, spec)
    assert isinstance(result.values, dict)
    state.load({k: base[k] + result.values[k] for k in names})
    emit(
        "round",
        peer=state.name,
        round=number,
        ok=True,
        contributors=len(contributions),
        expected=len(expect) + 1,
        timed_out=timed_out,
        loss=loss,
        accuracy=state.accuracy(),
        sent_bytes=sent_bytes,
        saved_bytes=0,
        pulled_bytes=0,
        pull_saved_bytes=0,
        seconds=time.perf_counter() - start,
    )


# ── the command loop ─────────────────────────────────────────────────────────
async def _commands() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def _next(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    while True:
        line = await reader.readline()
        if not line:
            return None
        if line.strip():
            cmd = json.loads(line)
            if not isinstance(cmd, dict):
                raise ValueError(f"a command must be a JSON object, got {line!r}")
            return cmd


def _build_state(args: argparse.Namespace) -> PeerState:
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


async def run_star(args: argparse.Namespace) -> int:
    from tensorswap.errors import WireError
    from tensorswap.rounds.client import RoundClient
    from tensorswap.wire.connection import Timeouts

    name = f"peer-{args.index}"
    host, port = split_host_port(args.coordinator)  # checked by parse_args
    try:
        client = await RoundClient.connect(host, port, peer=name, timeouts=Timeouts(connect=10.0))
    except (OSError, TimeoutError, WireError) as exc:
        reason = str(exc) or type(exc).__name__
        return fail(
            f"{name} cannot reach the coordinator at {args.coordinator}: {reason} "
            "(is `tensorswap serve` listening there?)"
        )
    async with client:
        state = await asyncio.to_thread(_build_state, args)
        emit(
            "ready",
            peer=state.name,
            samples=state.shard.num_samples,
            accuracy=state.accuracy(),
            pid=os.getpid(),
        )
        reader = await _commands()
        while (cmd := await _next(reader)) is not None and cmd.get("cmd") != "stop":
            if cmd.get("cmd") == "round":
                await star_round(state, client, cmd)
    return 0


async def run_p2p(args: argparse.Namespace) -> int:
    from tensorswap.delta import DweBus, DweConfig, DweListener

    state = await asyncio.to_thread(_build_state, args)
    state.inbox = DeltaInbox(state.weights())
    config = DweConfig(max_fragment_bytes=args.max_fragment_bytes)
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    async with DweListener(inbox, config=config) as listener:
        emit(
            "ready",
            peer=state.name,
            samples=state.shard.num_samples,
            accuracy=state.accuracy(),
            listen=str(listener.endpoint),
            pid=os.getpid(),
        )
        reader = await _commands()
        cmd = await _next(reader)
        if cmd is None or cmd.get("cmd") == "stop":
            return 0
        if cmd.get("cmd") != "peers":
            return fail(f"expected the peers command first, got {cmd!r}")
        endpoints: dict[str, str] = dict(cmd["endpoints"])
        bus: DweBus | None = None
        members: tuple[str, ...] | None = None
        try:
            while (cmd := await _next(reader)) is not None and cmd.get("cmd") != "stop":
                if cmd.get("cmd") != "round":
                    continue
                # One bus to the peers this round expects: a peer that left is dropped
                # rather than retried (with backoff) round after round.
                want = tuple(p for p in cmd.get("expect", []) if p != state.name)
                if want != members:
                    if bus is not None:
                        await bus.aclose()
                    to = [endpoints[p] for p in want if p in endpoints]
                    bus = DweBus(to, config=config, drain_timeout=1.0)
                    await bus.start()
                    members = want
                assert bus is not None
                await p2p_round(state, bus, inbox, cmd)
        finally:
            if bus is not None:
                await bus.aclose()
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tensorswap.demo.peer", description=__doc__)
    parser.add_argument("--index", type=int, required=True, help="this peer's shard, 0-based")
    parser.add_argument("--peers", type=int, required=True, help="how many shards in all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--topology", choices=("star", "p2p"), default="star")
    parser.add_argument("--coordinator", default="", help="HOST:PORT (star)")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none")
    parser.add_argument("--aggregator", default="fedavg", help="p2p: how deltas are combined")
    parser.add_argument("--freeze-first-layer", action="store_true", help="train the head only")
    parser.add_argument(
        "--max-fragment-bytes",
        type=int,
        default=MAX_DWE_FRAGMENT_BYTES,
        help="p2p: the DWE size cap (8 MiB); a larger delta is sent in several parts",
    )
    args = parser.parse_args(argv)
    if not MIN_FRAGMENT_BYTES <= args.max_fragment_bytes <= 2**32 - 1:
        parser.error(f"--max-fragment-bytes must be in [{MIN_FRAGMENT_BYTES}, 2**32 - 1]")
    if not 0 <= args.index < args.peers:
        parser.error(f"--index must be in [0, {args.peers})")
    if args.topology == "star":
        try:
            split_host_port(args.coordinator)
        except HostPortError as exc:
            parser.error(f"--coordinator HOST:PORT is required with --topology star ({exc})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runner = run_star if args.topology == "star" else run_p2p
    try:
        return asyncio.run(runner(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 1  # the driver went away


if __name__ == "__main__":
    sys.exit(main())
