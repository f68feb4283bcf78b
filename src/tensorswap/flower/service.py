"""BlockService: a block service (a rounds coordinator's server + the swarm's tracker) on a
thread of its own, for a Flower simulation or a test; in deployment ``tensorswap serve`` is
the same service."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from tensorswap.rounds.engine import Coordinator
from tensorswap.rounds.server import RoundServer
from tensorswap.store import BlockStore, MemoryStore
from tensorswap.swarm import SwarmTracker
from tensorswap.wire import BlockServer

__all__ = ["BlockService"]


class BlockService:
    """Serve ``store`` (default: a new MemoryStore) on ``host:port`` (port 0: any free one)
    with the ``"swarm"`` tracker attached and a rounds coordinator over the same store (no
    journal: its rounds last as long as the service), from a daemon thread running its own
    event loop. The coordinator is what aggregates a ``BlockStrategy``'s FedAvg-family
    replies where they are stored (``tensorswap serve`` hosts one too).

    ``start()`` returns once it listens; ``address`` is then ``HOST:PORT``; ``close()`` (or
    leaving the ``with`` block) stops it and joins the thread. Clients authenticate with
    ``key`` when one is set.
    """

    def __init__(
        self,
        store: BlockStore | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        key: bytes | None = None,
    ) -> None:
        self.store = store if store is not None else MemoryStore()
        self.host = host
        self.key = key
        self._want_port = port
        self.coordinator = Coordinator(self.store)
        self.rounds = RoundServer(self.coordinator, key=key, name="tensorswap-flower")
        self.server: BlockServer = self.rounds.blocks
        self.tracker = SwarmTracker(self.store).attach(self.server)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tensorswap-block-service", daemon=True
        )
        self._started = False

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def start(self) -> BlockService:
        self._thread.start()
        self._started = True
        self._call(self.rounds.start(self.host, self._want_port)).result(timeout=30)
        return self

    def close(self) -> None:
        if not self._started:
            self.coordinator.close()
            return
        self._started = False
        try:
            self._call(self.rounds.aclose()).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            if not self._thread.is_alive():
                self._loop.close()
            self.coordinator.close()

    def __enter__(self) -> BlockService:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _call(self, coro: object) -> Future[object]:
        async def run() -> object:
            return await coro  # type: ignore[misc]

        return asyncio.run_coroutine_threadsafe(run(), self._loop)
