"""The TCP congestion control of a collective peer's block connections (``join(congestion=)``)."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from helpers.collective import KEY, close, rendezvous
from tensorswap.collective import Collective, Rendezvous
from tensorswap.transport import TcpTransport, connect_tcp
from tensorswap.wire import BlockServer

pytestmark = pytest.mark.skipif(
    not hasattr(socket, "TCP_CONGESTION"), reason="no TCP_CONGESTION (not Linux)"
)


def _system_default() -> str:
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


async def _pair(congestion: str | None) -> tuple[list[Collective], BlockServer, Rendezvous]:
    server, made = await rendezvous()
    address = f"127.0.0.1:{server.port}"
    peers = await asyncio.gather(
        *(
            Collective.join(
                address, group="g", peer=f"p{i}", size=2, key=KEY, congestion=congestion
            )
            for i in range(2)
        )
    )
    return list(peers), server, made


def test_block_connections_use_the_chosen_congestion_control() -> None:
    """Both ends of every peer-to-peer connection send with "reno" (always built in);
    the call averages as without it."""

    async def main() -> tuple[set[str], set[str], list[np.ndarray], list[int]]:
        peers, server, made = await _pair("reno")
        try:
            xs = [np.full(1000, float(i), np.float32) for i in range(2)]
            out = await asyncio.gather(
                *(p.all_reduce({"w": x}) for p, x in zip(peers, xs, strict=True))
            )
            dialled = set()
            for peer in peers:
                other = next(m for m in peer.roster if m.peer != peer.peer)
                client = await peer.client_of(other)
                assert isinstance(client.conn.transport, TcpTransport)
                dialled.add(client.conn.transport.congestion_control)
            accepted = set()
            for peer in peers:
                assert peer.server.listener is not None
                accepted |= {t.congestion_control for t in peer.server.listener.served()}
            return dialled, accepted, [r["w"] for r in out], [p.congestion_refused for p in peers]
        finally:
            await close(peers, server, made)

    dialled, accepted, results, refused = asyncio.run(main())
    assert dialled == {"reno"} and accepted == {"reno"}
    assert refused == [0, 0]
    for result in results:
        assert np.array_equal(result, np.full(1000, 0.5, np.float32))


def test_none_keeps_the_system_default_and_an_unknown_one_is_counted() -> None:
    async def main() -> tuple[str, str, list[int]]:
        peers, server, made = await _pair(None)
        bad, bad_server, bad_made = await _pair("no-such-algorithm")
        try:
            other = next(m for m in peers[0].roster if m.peer != "p0")
            kept = (await peers[0].client_of(other)).conn.transport
            assert isinstance(kept, TcpTransport)
            out = await asyncio.gather(*(p.all_reduce({"w": np.ones(10, np.float32)}) for p in bad))
            assert all(np.array_equal(r["w"], np.ones(10, np.float32)) for r in out)
            probe = await connect_tcp("127.0.0.1", server.port)
            try:
                default = probe.congestion_control
            finally:
                probe.abort()
            return kept.congestion_control, default, [p.congestion_refused for p in bad]
        finally:
            await close(peers, server, made)
            await close(bad, bad_server, bad_made)

    kept, default, refused = asyncio.run(main())
    assert kept == default == _system_default()
    assert all(count >= 1 for count in refused)  # its dialled and accepted connections
