"""blocks_mod: a Flower ClientApp mod that resolves array references in incoming messages and
sends the reply's arrays as blocks through the block service, references in their place.

Importing it imports nothing but the standard library: a deployed ClientApp runs each message
in a fresh ``flwr-clientapp`` process, which imports the app (and so this module) before its
message arrives. The data plane (the link, the wire, the store, the swarm; the rounds client
for a submit) is imported by the first message that needs it, and never by one that does
not (a message without references, from a ServerApp without the bridge).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flwr.app import Context, Message, RecordDict

    from tensorswap.flower.link import BlockLink

__all__ = ["blocks_mod", "shared_link", "submitted"]

log = logging.getLogger(__name__)

_links: dict[tuple[str, bytes | None, str | None], BlockLink] = {}
_links_lock = threading.Lock()


def shared_link(
    address: str, key: bytes | None = None, store: str | os.PathLike[str] | None = None
) -> BlockLink:
    """This process's link to the service at ``address`` (one per address, key and store;
    the ClientApps a process runs share its connection, its store and its swarm seeder).
    ``store``: a directory for the node's blocks, kept across processes (``NodeStore``);
    None: in this process's memory."""
    from tensorswap.flower.link import BlockLink
    from tensorswap.flower.node_store import NodeStore

    where = None if store is None else os.fspath(store)
    with _links_lock:
        link = _links.get((address, key, where))
        if link is None:
            node = None if where is None else NodeStore(where)
            link = _links[(address, key, where)] = BlockLink(address, key=key, store=node)
        return link


@atexit.register
def _close_links() -> None:
    with _links_lock:
        links = list(_links.values())
        _links.clear()
    for link in links:
        link.close()


ClientAppCall = Callable[["Message", "Context"], "Message"]

PLAN_KEY, REF_MARKER = "tensorswap.reply", "tensorswap.ref"
"""``records.REPLY_PLAN`` and ``reference.MARKER`` (tests/flower/test_flower_imports.py checks
they agree): what marks a message the bridge has to handle, told apart without importing it."""


def _bridged(content: RecordDict) -> bool:
    """Whether ``content`` holds a reply plan or a reference (else the mod passes it on)."""
    from flwr.app import ConfigRecord  # the ClientApp's own import: already loaded

    if PLAN_KEY in content:
        return True
    return any(isinstance(r, ConfigRecord) and REF_MARKER in r for r in content.values())


def blocks_mod(
    address: str, *, key: bytes | None = None, store: str | os.PathLike[str] | None = None
) -> Callable[..., Message]:
    """A ClientApp mod (``ClientApp(mods=[blocks_mod("HOST:PORT")])``).

    On a message whose content holds references (a ``BlockStrategy`` sent it) each is
    replaced by an ArrayRecord of its arrays, fetched into this process's store (only the
    blocks it lacks; from peers too when the reference says ``swarm``), CID-checked, and
    compared with the reference (``ReferenceMismatch``). The ClientApp then runs unchanged,
    and the ArrayRecords of its reply are pushed (only the blocks the service lacks; a push
    cut by a broken connection is resumed) and replaced by references. A message without
    references, and its reply, pass through untouched: a ServerApp without the bridge is
    answered as before. ``key``: the block service's shared key. ``store``: a directory
    where the node keeps its blocks across messages (``NodeStore``): in deployment each
    message runs in a fresh ``flwr-clientapp`` process, and without it every round fetches
    every tensor again, changed or not.

    A train message whose strategy has the block service aggregate (``records.REPLY_PLAN``,
    removed before the ClientApp sees the message) names the metric its weight is read
    from: the reply's arrays are then stored with that weight (``reply_samples``: their
    update's ``num_samples``), and its reference says it. Where the message also names the
    coordinator's round the strategy opened for the nodes it sampled, the mod then submits
    them to it as this node's contribution (``submitted``): the service folds the round
    once every sampled node has replied, while Flower is still relaying the replies.
    """

    def mod(message: Message, context: Context, call_next: ClientAppCall) -> Message:
        if not message.has_content() or not _bridged(message.content):
            return call_next(message, context)
        from tensorswap.flower.records import (
            REPLY_PLAN,
            has_reference,
            peer_of,
            reply_samples,
            swap_in,
            swap_out,
            take_reply_plan,
        )

        planned = REPLY_PLAN in message.content
        content, plan = take_reply_plan(message.content)
        if not planned and not has_reference(content):
            return call_next(message, context)
        link = shared_link(address, key, store)
        message.content = swap_in(content, lambda ref: link.fetch(ref.root, swarm=ref.swarm))
        reply = call_next(message, context)
        if reply.has_content():
            samples = None if plan is None else reply_samples(reply.content, plan.weight_key)
            reply.content = swap_out(
                reply.content,
                lambda arrays: link.push(arrays, samples=samples or 0),
                samples=samples,
            )
            if plan is not None and plan.round is not None and samples is not None:
                peer = peer_of(message.metadata.dst_node_id)
                reply.content = submitted(reply.content, link, plan.round, peer)
        return reply

    return mod


def submitted(
    content: RecordDict, link: BlockLink, round: tuple[int, str], peer: str
) -> RecordDict:
    """``content`` (a reply holding one reference) with its arrays submitted to the
    coordinator's ``round`` (number, initiator) as ``peer``'s contribution, and its reference
    saying so (``ArrayRef.submitted``) once the round holds exactly them. Where the submit
    is refused or fails (logged), the reference stays as it was: the strategy then has the
    service aggregate the replies Flower hands it in a round of its own, as without it."""
    from flwr.app import ConfigRecord, RecordDict

    from tensorswap.errors.flower import FlowerBridgeError
    from tensorswap.flower.records import reference_of
    from tensorswap.flower.reference import ArrayRef, is_reference
    from tensorswap.rounds.core import RoundId  # the rounds model, only where it is used

    found = [(k, r) for k, r in content.items() if isinstance(r, ConfigRecord) and is_reference(r)]
    if len(found) != 1:
        return content
    key, record = found[0]
    ref = ArrayRef.parse(key, dict(record.items()))
    round_id = RoundId(*round)
    try:
        refused = link.submit_held(round_id, peer, ref.root)
    except FlowerBridgeError as exc:
        refused = str(exc)
    if refused is not None:
        log.warning("%s: reply not submitted to round %s: %s", peer, round_id, refused)
        return content
    marked = dataclasses.replace(ref, submitted=round_id.as_key())
    return RecordDict({k: reference_of(marked) if k == key else r for k, r in content.items()})
