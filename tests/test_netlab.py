"""The network lab itself: hosts reach each other, links are shaped both ways, faults, teardown."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys

import pytest

from tensorswap.errors import NetlabError, TensorSwapError
from tensorswap.netlab import Host, Lab, NamespacesUnavailable, namespace_exists, sweep_stale
from tensorswap.netlab.relay import DelayPipe


def listen(host: Host) -> socket.socket:
    def make() -> socket.socket:
        server = socket.socket()
        server.bind((host.address, 0))
        server.listen(4)
        return server

    return host.call(make)


def dial(host: Host, address: str, port: int, timeout: float = 5.0) -> tuple[str, int]:
    """Connect from inside ``host``; the local address the connection got."""

    def connect() -> tuple[str, int]:
        with socket.create_connection((address, port), timeout=timeout) as conn:
            return conn.getsockname()[:2]

    return host.call(connect)


def test_hosts_reach_each_other_at_their_own_addresses(lab: Lab) -> None:
    a, b = lab.add_host("a"), lab.add_host("b")
    assert (a.address, b.address) == ("198.18.0.1", "198.18.0.2")
    with listen(b) as server:
        local = dial(a, b.address, server.getsockname()[1])
        conn, peer = server.accept()
        conn.close()
    assert local[0] == peer[0] == a.address


def test_a_link_is_shaped_by_tbf_on_both_ends(lab: Lab) -> None:
    host = lab.add_host("a", mbit=50)
    up, down = host.qdiscs()
    assert "tbf" in up and "rate 50Mbit" in up
    assert "tbf" in down and "rate 50Mbit" in down
    host.shape(10, 20)
    up, down = host.qdiscs()
    assert "rate 10Mbit" in up and "rate 20Mbit" in down
    host.shape(None)
    assert not any("tbf" in side for side in host.qdiscs())


def test_a_link_down_fails_at_once_and_up_restores_it(lab: Lab) -> None:
    a, b = lab.add_host("a"), lab.add_host("b")
    with listen(b) as server:
        port = server.getsockname()[1]
        a.link_down()
        with pytest.raises(OSError) as failed:
            dial(a, b.address, port)
        assert failed.value.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)
        a.link_up()
        assert dial(a, b.address, port)[0] == a.address


def test_a_partition_is_silent_and_heals(lab: Lab) -> None:
    a, b = lab.add_host("a"), lab.add_host("b")
    with listen(b) as server:
        port = server.getsockname()[1]
        lab.partition(a)
        with pytest.raises(TimeoutError):  # no refusal, no error: nothing comes back
            dial(a, b.address, port, timeout=0.5)
        lab.heal(a)
        assert dial(a, b.address, port)[0] == a.address


def root_view() -> tuple[list[str], list[str]]:
    """The root namespace's lab-range addresses and routes."""
    show = [subprocess.run(["ip", "-o", "-4", *what], capture_output=True, text=True).stdout
            for what in (["addr"], ["route"])]  # fmt: skip
    addrs, routes = ([line for line in out.splitlines() if "198.18." in line] for out in show)
    return addrs, routes


def test_a_process_runs_inside_its_host_and_the_root_namespace_is_untouched(lab: Lab) -> None:
    before = root_view()
    host = lab.add_host("a", mbit=10)
    proc = host.popen(["ip", "-o", "-4", "addr", "show"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert f"{host.address}/15" in out and "eth0" in out
    assert root_view() == before


def test_close_kills_processes_and_deletes_namespaces_even_when_the_body_fails() -> None:
    try:
        made = Lab()
    except NamespacesUnavailable as exc:
        pytest.skip(exc.reason)
    with pytest.raises(RuntimeError, match="the test failed"), made as lab:
        host = lab.add_host("a")
        proc = host.popen(["sleep", "600"])
        namespaces = lab.namespaces()
        raise RuntimeError("the test failed")
    assert proc.poll() is not None
    assert namespaces and not any(namespace_exists(name) for name in namespaces)
    made.close()  # twice is harmless


def test_namespaces_of_a_dead_labs_process_are_swept(lab: Lab) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = f"tsnl{gone.pid}x1-old"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in sweep_stale()
        assert not namespace_exists(stale)
        assert all(namespace_exists(name) for name in lab.namespaces())  # a live lab stays
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)


def test_without_root_the_lab_is_a_clear_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NamespacesUnavailable, match="root") as refused:
        Lab()
    assert isinstance(refused.value, NetlabError) and isinstance(refused.value, TensorSwapError)


def test_a_relay_forwards_both_directions_intact(lab: Lab) -> None:
    a, b = lab.add_host("a"), lab.add_host("b")
    payload = os.urandom(3 << 20)

    def echo(server: socket.socket) -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    with listen(b) as server:
        relay = lab.relay((b.address, server.getsockname()[1]), rtt=0.01, mbit=100)
        # the link's bandwidth-delay product and one more as its queue
        assert relay.cap == max(64 * 1024, round(100e6 / 8 * 0.005 * 2))
        echoing = b.start(lambda: echo(server))

        def roundtrip() -> bytes:
            with socket.create_connection((relay.address, relay.port), timeout=30) as conn:
                sending = a.start(lambda: conn.sendall(payload) or conn.shutdown(socket.SHUT_WR))
                got = bytearray()
                while data := conn.recv(1 << 16):
                    got += data
                sending.result(timeout=30)
                return bytes(got)

        assert a.call(roundtrip) == payload
        echoing.result(timeout=30)


async def test_a_delay_pipe_keeps_order_and_never_holds_more_than_its_cap() -> None:
    pipe = DelayPipe(delay=0.0, cap=10)
    peaks: list[int] = []

    async def fill() -> None:
        for chunk in (b"abcd", b"efgh", b"ijkl", b"m" * 25, b"n", b""):
            await pipe.put(chunk)
            peaks.append(pipe.held)

    filling = asyncio.ensure_future(fill())
    got = b""
    while data := await pipe.get():
        got += data
    await filling
    assert got == b"abcdefghijkl" + b"m" * 25 + b"n"
    # one read larger than the cap passes alone; otherwise the cap holds
    assert all(p <= 10 or p == 25 for p in peaks)


async def test_reads_sized_by_the_room_left_fill_a_pipe_to_its_cap_exactly() -> None:
    pipe = DelayPipe(delay=60.0, cap=100_000)  # nothing leaves during the test
    source = bytes(1_000_000)
    offset = 0
    while pipe.held < pipe.cap:
        room = await pipe.room()
        assert room == pipe.cap - pipe.held
        take = min(64 * 1024, room)  # what the relay reads: 64 KiB or the room left
        await pipe.put(source[offset : offset + take])
        offset += take
    assert pipe.held == pipe.cap == offset
