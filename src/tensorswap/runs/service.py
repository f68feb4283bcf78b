"""RunService: the runs application on a RoundServer's port (register, tasks, runs, submit)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import TensorSwapError
from tensorswap.rounds.core import RoundId, RoundStatus
from tensorswap.rounds.protocol import error_info, status_to_wire
from tensorswap.rounds.server import RoundServer
from tensorswap.runs.batch import RunBatches, refuse_unproven
from tensorswap.runs.errors import BufferBusy
from tensorswap.runs.manager import RunManager, Task
from tensorswap.runs.messages import (
    APP,
    MAX_VERSIONS,
    ContributeRequest,
    CreateRunRequest,
    HeartbeatRequest,
    PartRequest,
    RegisterRequest,
    RunAnswer,
    RunRequest,
    RunsRequest,
    SecAggRequest,
    TaskRequest,
    VersionRow,
    VersionsRequest,
    decode_request,
    encode,
    task_wire,
)
from tensorswap.runs.model import RunSpec
from tensorswap.runs.regional import part_for
from tensorswap.runs.views import Viewer, hides_sample, row_of, version_row
from tensorswap.wire import AppRequest, ProtocolViolation

__all__ = ["RunService"]

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class RunService:
    """Serves ``manager``'s runs on ``server``'s port (app ``"runs"``).

    A ``task`` request that finds no task waits without a thread until the run changes (a
    round starts, a version is made) or its timeout (at most the server's ``max_wait``),
    so peers long-poll: they only ever dial the coordinator. A refused request (a
    RoundsError, e.g. NotSelected) is answered in the reply and the connection stays usable.
    ``wait`` and ``contribute`` are what the batched ops (``runs.batch``) use too.
    """

    def __init__(self, manager: RunManager, server: RoundServer) -> None:
        self.manager = manager
        self.server = server
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: dict[str, set[asyncio.Event]] = {}
        server.blocks.handlers[APP] = self._on_request
        server.visibility.add(lambda rid: hides_sample(manager, rid))
        manager.subscribe(self._on_change)
        self.batches = RunBatches(self)
        """The batched ops (``runs.batch``) and the grouped registrations."""

    async def _on_request(self, request: AppRequest) -> bytes:
        try:
            call = decode_request(request.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolViolation(f"bad runs request: {exc}") from exc
        except RecursionError:
            raise ProtocolViolation("bad runs request: nested too deeply") from None
        try:
            return encode(await self._answer(call, Viewer(call.peer, request.operator)))
        except TensorSwapError as exc:
            if isinstance(exc, ProtocolViolation):
                raise
            return encode(RunAnswer(error=error_info(exc)))

    async def _answer(self, call: RunRequest, viewer: Viewer) -> RunAnswer:
        manager, registry = self.manager, self.manager.registry
        match call:
            case RegisterRequest():
                await self.batches.intake.register(call.peer, call.facts)
                return RunAnswer(clients=len(registry), active=len(registry.active()))
            case HeartbeatRequest():
                registry.seen(call.peer)
                return RunAnswer(active=len(registry.active()))
            case CreateRunRequest():
                spec = RunSpec.from_json(call.spec)
                info = await asyncio.to_thread(
                    manager.create_run, call.run, spec, Cid.parse(call.initial)
                )
                return RunAnswer(runs=[row_of(manager, info, viewer)])
            case RunsRequest():
                infos = [manager.run(call.run)] if call.run else manager.runs()
                rows = [row_of(manager, info, viewer) for info in infos]
                return RunAnswer(runs=rows, clients=len(registry), active=len(registry.active()))
            case VersionsRequest():
                return RunAnswer(versions=await self._versions(call, viewer))
            case TaskRequest():
                task = await self._task(call)
                return RunAnswer(task=None if task is None else task_wire(task))
            case ContributeRequest():
                refuse_unproven(self, call)
                return RunAnswer(status=status_to_wire(await self.contribute(call)))
            case SecAggRequest():
                return await self._secagg(call)
            case PartRequest():  # a regional coordinator's share of the round
                info = manager.run(call.run)
                return RunAnswer(part=part_for(manager.units, manager.coordinator, info, call.peer))
        raise ProtocolViolation(f"unknown runs request {type(call).__name__}")

    async def contribute(self, call: ContributeRequest) -> RoundStatus:
        """Submit; an asynchronous run's delta that finds no buffer open to it waits here
        (no thread) for the next one, up to the server's ``max_wait``."""
        loop = asyncio.get_running_loop()
        until = loop.time() + self.server.max_wait
        manager = self.manager
        while True:
            try:
                return await asyncio.to_thread(
                    manager.submit,
                    RoundId(call.round, call.run),
                    call.peer,
                    Cid.parse(call.update),
                    trained_on=call.trained_on,
                    clipped=call.clipped,
                )
            except BufferBusy:
                left = until - loop.time()
                if left <= 0:
                    raise

                def opened() -> tuple[bool, None]:
                    return manager.buffer_open(call.run, call.peer), None

                await self.wait(call.run, left, opened)

    async def _task(self, call: TaskRequest) -> Task | None:
        def probe() -> tuple[bool, Task | None]:
            task = self.manager.task(call.run, call.peer)
            return task is not None or self.manager.run(call.run).finished, task

        return await self.wait(call.run, call.timeout, probe)

    async def _secagg(self, call: SecAggRequest) -> RunAnswer:
        """Post the peer's SecAgg+ message, then answer its next server message (waiting
        for its phase to close, up to the timeout)."""
        from tensorswap.privacy.secagg.protocol import MaskedInput, UnmaskResponse, decode

        manager = self.manager
        manager.registry.seen(call.peer)
        rid = RoundId(call.round, call.run)
        session = manager.secure.session_for(manager.run(call.run), rid, call.peer)
        if call.message:
            message = decode(call.message)
            if isinstance(message, MaskedInput):  # folded, its block deleted, in one hop
                post = manager.secure.post_masked
                await asyncio.to_thread(post, rid, session, call.peer, message, call.block)
            else:
                await asyncio.to_thread(session.post, call.peer, message)
            if isinstance(message, UnmaskResponse):  # the peer's last step
                status = manager.coordinator.status(rid)
                return RunAnswer(status=None if status is None else status_to_wire(status))
        elif call.after == 0:
            index, setup = await asyncio.to_thread(session.setup, call.peer)
            return RunAnswer(secagg=setup, secagg_peer=index)

        def probe() -> tuple[bool, bytes | None]:
            got = session.message_for(call.peer, call.after)
            return got is not None, got

        return RunAnswer(secagg=await self.wait(call.run, call.timeout, probe))

    async def _versions(self, call: VersionsRequest, viewer: Viewer) -> list[VersionRow]:
        if call.wait is not None:

            def made() -> tuple[bool, None]:
                info = self.manager.run(call.run)
                return info.version >= call.since or info.finished, None

            await self.wait(call.run, call.wait, made)

        def read() -> list[VersionRow]:
            info = self.manager.run(call.run)
            records = self.manager.versions(call.run)
            spent = {s.round: s.epsilon for s in self.manager.privacy.steps(call.run)}
            picked = [r for r in records if r.version >= call.since][:MAX_VERSIONS]
            return [
                version_row(info, r, spent.get(r.round) if r.version else None, viewer)
                for r in picked
            ]

        return await asyncio.to_thread(read)

    async def wait(
        self, run: str, timeout: float | None, probe: Callable[[], tuple[bool, _T]]
    ) -> _T | None:
        """``probe()``'s value once it says done, probed again at each change of ``run``;
        None after ``timeout`` (the server's ``max_wait`` at most). No thread waits."""
        self._loop = asyncio.get_running_loop()  # where run changes wake the waiters
        limit = self.server.max_wait if timeout is None else min(timeout, self.server.max_wait)
        event = asyncio.Event()
        self._waiters.setdefault(run, set()).add(event)
        try:
            async with asyncio.timeout(limit):
                while True:
                    event.clear()
                    done, value = probe()
                    if done:
                        return value
                    await event.wait()
        except TimeoutError:
            return None
        finally:
            waiting = self._waiters.get(run)
            if waiting is not None:
                waiting.discard(event)
                if not waiting:
                    del self._waiters[run]

    def _on_change(self, run: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, run)

    def _wake(self, run: str) -> None:
        for event in self._waiters.get(run, ()):
            event.set()
