"""A TCP proxy on 127.0.0.1 that cuts one connection (the first, or the ``which``-th) after some
bytes from the client: a link (or a node in a Flower run) behind it loses that connection
mid-upload once."""

from __future__ import annotations

import asyncio
import threading


class CuttingProxy:
    """Forwards 127.0.0.1:port to the service; connection number ``which`` (1: the first)
    is cut after ``cut`` bytes from the client, the others pass everything."""

    def __init__(self, upstream: int, cut: int, which: int = 1) -> None:
        self.upstream, self.cut, self.which, self.connections = upstream, cut, which, 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        limit = self.cut if self.connections == self.which else None
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)

        async def pipe(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, left: int | None
        ) -> None:
            try:
                while data := await src.read(65536):
                    if left is not None:
                        data, left = data[:left], left - len(data)
                    dst.write(data)
                    await dst.drain()
                    if left is not None and left <= 0:
                        break
            except OSError:
                pass
            finally:
                for w in (writer, up_writer):
                    w.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, limit), pipe(up_reader, writer, None))

    def close(self) -> None:
        async def stop() -> None:
            self.server.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
