"""One round of a demo peer: star through the coordinator's RoundClient, p2p over the delta bus."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

from tensorswap.demo.inbox import SEQ_STRIDE, DeltaInbox
from tensorswap.demo.local import PeerState, emit

__all__ = ["p2p_round", "star_round"]


# ── star: through the coordinator ────────────────────────────────────────────
def _closure_bytes(store: Any, cid: Any) -> int:
    from tensorswap.store import manifest_closure

    return sum(store.get(c).nbytes for c in manifest_closure(store, cid))


async def _store_update(
    state: PeerState, store: Any, trained: dict[str, Any], base: dict[str, Any]
) -> Any:
    """Put what this peer sends into ``store``: its weights, or (compressed) its delta from
    ``base`` plus the residual the last lossy encoding left, keeping the new residual."""
    from tensorswap.store import ModelUpdate, get_update, put_update

    n = state.shard.num_samples
    compression = state.args.compression
    if compression == "none":
        cid = await asyncio.to_thread(put_update, store, ModelUpdate(trained, n))
    else:
        delta = {k: trained[k] - base[k] for k in base}
        if state.residual is not None:
            delta = {k: delta[k] + state.residual[k] for k in delta}
        update = ModelUpdate(delta, n)
        cid = await asyncio.to_thread(put_update, store, update, encoding=compression)
        sent = get_update(store, cid).tensors  # what the coordinator will decode
        state.residual = {k: delta[k] - sent[k] for k in delta}
    return cid


async def _pull_aggregate(state: PeerState, client: Any, agg_cid: Any) -> tuple[int, int]:
    """Fetch the round's aggregate into the client's store: bytes from the coordinator, and
    from other peers (--swarm)."""
    if state.swarm is None:
        pulled = (await client.blocks.pull(agg_cid, client.store)).fetched_bytes
        from_peers = 0
    else:  # --swarm: from the coordinator and the peers that hold it, each block CID-checked
        fetched = await state.swarm.fetch(client.blocks, agg_cid)
        pulled, from_peers = fetched.from_coordinator, fetched.from_peers
    return pulled, from_peers


async def star_round(state: PeerState, client: Any, cmd: Mapping[str, Any]) -> None:
    from tensorswap.cid import Cid
    from tensorswap.rounds import Complete, RoundAlreadyTerminal, RoundClosed, RoundId
    from tensorswap.store import get_update

    number = int(cmd["round"])
    rid = RoundId(number, str(cmd["initiator"]))
    wait_s = float(cmd.get("deadline_s") or 60.0) + 60.0
    start = time.perf_counter()
    base, loss = await asyncio.to_thread(state.train, number)
    trained = state.weights()
    emit("trained", peer=state.name, round=number, loss=loss)
    compression = state.args.compression
    dense_bytes = sum(v.nbytes for v in trained.values())
    cid = await _store_update(state, client.store, trained, base)
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
    pulled, from_peers = await _pull_aggregate(state, client, agg_cid)
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
        pulled_bytes=pulled,
        swarm_bytes=from_peers,
        pull_saved_bytes=max(pulled_total - pulled - from_peers, 0),
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
