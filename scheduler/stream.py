"""A request's stream of events, and their delivery to the threads and event loops that read them.

    stream = RequestStream(request, cancel, outbox)   # the scheduler makes one per request
    async for event in stream: ...                    # TokenEvent..., then a RequestRecord
                                                      # (PromptProgress first, where asked)
    for event in stream: ...                          # the same, from a plain thread
    stream.cancel()                                   # cancel(request): the scheduler's, usually
    async for batch in merged(streams): ...           # several streams' events as they come
    async for i, item in interleaved(sources): ...    # several async iterators' items, likewise

The scheduler's loop thread pushes each event as the request produces it (`Request.emit`). A
stream read from a plain thread takes it at once through a thread-safe queue. A stream made
inside an event loop collects its events in the `Outbox` until the iteration ends; then
`Outbox.deliver` hands each loop all of its readers' events in one thread-safe call, not one per
token: with hundreds of streams, a wake-up of the loop per token is what the host pays most. A
reader whose loop is closed is gone: its request is cancelled through the stream's callback.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from cadence.scheduler.request import PromptProgress, Request, RequestRecord, TokenEvent


def _put_all(items: list[tuple[RequestStream, Any]]) -> None:  # the reader's event loop
    for stream, event in items:
        stream._queue.put_nowait(event)


class Outbox:
    """Events for readers in event loops, per loop, until the iteration hands them over.

    `put` runs on a loop thread holding `lock` (the scheduler's state lock); `deliver` takes
    what has gathered under it and hands it over outside it."""

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self._items: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, Any]]] = {}

    def put(self, loop: asyncio.AbstractEventLoop, stream: RequestStream, event: Any) -> None:
        self._items.setdefault(loop, []).append((stream, event))

    def deliver(self) -> None:
        """Hands each event loop its readers' events in one thread-safe call."""
        with self._lock:
            outbox, self._items = self._items, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that loop is closed: nobody will read these
                for stream in {id(stream): stream for stream, _ in items}.values():
                    if not stream.request.finished:
                        stream.cancel()


class RequestStream:
    """Events of one request; iterate it with `async for` or a plain `for`.

    A stream made inside an event loop receives its events through that loop: the scheduler
    hands each loop all of an iteration's events in one call (`Outbox.deliver`)."""

    def __init__(self, request: Request, cancel: Callable[[Request], None], outbox: Outbox):
        self.request = request
        self.record: RequestRecord | None = None
        self._cancel = cancel
        self._outbox = outbox
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._queue: Any = asyncio.Queue() if self._loop else queue.Queue()

    @property
    def id(self) -> str:
        return self.request.id

    def _push(self, event: TokenEvent | PromptProgress | RequestRecord) -> None:  # scheduler thread
        if self._loop is None:
            self._queue.put(event)
        else:  # delivered with the iteration's others, in one call into the reader's loop
            self._outbox.put(self._loop, self, event)

    def cancel(self) -> None:
        self._cancel(self.request)

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent | PromptProgress | RequestRecord:
        if self.record is not None:
            raise StopAsyncIteration
        event = await self._queue.get()
        if isinstance(event, RequestRecord):
            self.record = event
        return event

    async def next_events(self) -> list[TokenEvent | PromptProgress | RequestRecord]:
        """Waits for the next event, then takes every other one already queued, in order
        (the record, if among them, is last). [] once the record has been taken."""
        if self.record is not None:
            return []
        events = [await self._queue.get()]
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        if isinstance(events[-1], RequestRecord):
            self.record = events[-1]
        return events

    def __iter__(self):
        while self.record is None:
            event = self._queue.get()
            if isinstance(event, RequestRecord):
                self.record = event
            yield event


async def merged(streams: list[RequestStream]) -> AsyncIterator[list[tuple[int, Any]]]:
    """The events of several streams as they come, each with its stream's index, until every
    one has its record. One stream is read directly (the common case pays for no task)."""
    if len(streams) == 1:
        while streams[0].record is None:
            yield [(0, e) for e in await streams[0].next_events()]
        return

    async def batches(stream: RequestStream) -> AsyncIterator[list]:
        while stream.record is None:
            yield await stream.next_events()

    async for i, events in interleaved([batches(s) for s in streams]):
        yield [(i, e) for e in events]


class _Ended:
    """What a source of `interleaved` sends when it is done (its error, if it failed)."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


async def interleaved(sources: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """The items of several async iterators as they come, each with its source's index, until
    every source is done; a source's error is raised here. Each source is read by a task of its
    own; closing this cancels them (each source's own cleanup runs)."""
    arrived: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, source: AsyncIterator[Any]) -> None:
        try:
            async for item in source:
                arrived.put_nowait((i, item))
        except Exception as e:  # (a cancellation is ours: nobody reads any more)
            arrived.put_nowait((i, _Ended(e)))
        else:
            arrived.put_nowait((i, _Ended()))

    pumps = [asyncio.create_task(pump(i, source)) for i, source in enumerate(sources)]
    try:
        left = len(pumps)
        while left:
            i, item = await arrived.get()
            if not isinstance(item, _Ended):
                yield i, item
            elif item.error is not None:
                raise item.error
            else:
                left -= 1
    finally:
        for task in pumps:
            task.cancel()
