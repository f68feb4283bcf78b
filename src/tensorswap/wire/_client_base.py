"""What BlockClient's push and fetch paths share: the connection, the server's Welcome, a lock."""

from __future__ import annotations

import asyncio

from tensorswap.wire.connection import FrameConnection
from tensorswap.wire.messages import MAX_CIDS_PER_MESSAGE, Welcome
from tensorswap.wire.transport import Transport

__all__ = ["ClientBase"]

_CIDS_PER_MESSAGE = MAX_CIDS_PER_MESSAGE  # ~2.6 MB of binary CIDs, under the message limit


class ClientBase:
    """One authenticated connection to a BlockServer, its requests run one at a time."""

    def __init__(self, conn: FrameConnection, welcome: Welcome) -> None:
        self.conn = conn
        self.welcome = welcome
        self._stream_id = 0
        self._lock = asyncio.Lock()

    @property
    def transport(self) -> Transport:
        return self.conn.transport

    def _next_stream(self) -> int:
        self._stream_id += 1
        return self._stream_id
