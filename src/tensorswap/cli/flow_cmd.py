"""``tensorswap flow``: publish and watch corpus-ipc training messages over ZeroMQ."""

from __future__ import annotations

import sys
import time

import click

from tensorswap.cli._util import SECONDS, FiniteFloatRange
from tensorswap.flow import (
    CommunicationError,
    FlowError,
    InvalidInput,
    Publisher,
    Subscriber,
    TransportConfig,
    decode,
    encode,
    encode_message,
)


@click.group("flow")
def flow() -> None:
    """Typed training messages (corpus-ipc compatible) over ZeroMQ PUB/SUB.

    Delivery is PUB/SUB's: best effort, at most once; a subscriber misses what was published
    before it joined.
    """


@flow.command("pub")
@click.argument("endpoint")
@click.option(
    "--wait",
    "wait_s",
    type=FiniteFloatRange(min=0),
    default=0.5,
    show_default=True,
    help="Seconds to wait after binding before the first message, so subscribers can join.",
)
@click.option(
    "--interval",
    type=FiniteFloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Seconds to pause after each message.",
)
@click.option(
    "--linger",
    "linger_s",
    type=FiniteFloatRange(min=0),
    default=1.0,
    show_default=True,
    help="Seconds to keep flushing queued messages after the last one.",
)
@click.option(
    "--send-hwm",
    type=click.IntRange(min=0),
    default=1000,
    show_default=True,
    help="Messages queued per subscriber before the socket drops (0: no limit).",
)
@click.pass_context
def pub(
    ctx: click.Context,
    endpoint: str,
    wait_s: float,
    interval: float,
    linger_s: float,
    send_hwm: int,
) -> None:
    """Publish JSON lines read from standard input on ENDPOINT (a bound PUB socket).

    Each line is one message, bare ({"Loss":0.25}, "Ping") or in its envelope
    ({"payload":...,"wire_version":1}). It is validated and sent as its canonical envelope.
    Blank lines are skipped. A line that fails is reported on standard error with its line
    number and skipped; the exit status is then 1.

    Example: tensorswap flow pub ipc:///tmp/flow.ipc < messages.jsonl
    """
    config = TransportConfig(endpoint, send_hwm=send_hwm, linger_ms=round(linger_s * 1000))
    sent = rejected = 0
    with Publisher.bind(config) as publisher:
        click.echo(f"bound {publisher.endpoint}", err=True)
        if wait_s:
            time.sleep(wait_s)
        for number, line in enumerate(sys.stdin, start=1):
            text = line.strip()
            if not text:
                continue
            try:
                publisher.send(decode(text))
            except FlowError as exc:
                rejected += 1
                click.echo(f"line {number}: {exc}", err=True)
                continue
            sent += 1
            if interval:
                time.sleep(interval)
    click.echo(f"published {sent} message(s), rejected {rejected} line(s)", err=True)
    if rejected:
        ctx.exit(1)


@flow.command("sub")
@click.argument("endpoint")
@click.option(
    "--count",
    "-n",
    type=click.IntRange(min=1),
    default=None,
    help="Stop after N messages (exit status 1 if fewer arrive before --timeout).",
)
@click.option(
    "--timeout",
    type=SECONDS,
    default=None,
    help="Stop when no message has arrived for this many seconds.",
)
@click.option(
    "--bare",
    is_flag=True,
    help='Print bare messages ({"Loss":0.25}) instead of canonical envelopes.',
)
@click.option(
    "--receive-hwm",
    type=click.IntRange(min=0),
    default=1000,
    show_default=True,
    help="Messages queued before the publisher drops (0: no limit).",
)
@click.pass_context
def sub(
    ctx: click.Context,
    endpoint: str,
    count: int | None,
    timeout: float | None,
    bare: bool,
    receive_hwm: int,
) -> None:
    """Print every message received on ENDPOINT (a connected SUB socket) as a JSON line.

    Lines are canonical envelopes (or bare messages with --bare), which `flow pub` reads
    back. A frame that fails to decode or validate is reported on standard error and skipped.

    Example: tensorswap flow sub ipc:///tmp/flow.ipc --count 10 --timeout 5
    """
    received = 0
    with Subscriber.connect(TransportConfig(endpoint, receive_hwm=receive_hwm)) as subscriber:
        click.echo(f"subscribed to {endpoint}", err=True)
        while count is None or received < count:
            try:
                message = subscriber.recv(timeout)
            except (CommunicationError, InvalidInput) as exc:
                click.echo(f"rejected frame: {exc}", err=True)
                continue
            if message is None:
                click.echo(f"no message for {timeout:g} s; stopping", err=True)
                break
            line = encode_message(message) if bare else encode(message)
            click.echo(line.decode("utf-8"))
            received += 1
    if count is not None and received < count:
        ctx.exit(1)
