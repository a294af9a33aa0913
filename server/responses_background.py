"""A Responses API response made in the background (OpenAI's `background: true`), apart from
any connection: created, it answers at once, "queued", and is made whether or not anyone reads it.

    job = Background(run, stream, on_done)      # starts reading the answer (a task on the loop);
                                                # on_done(job) once it has ended
    job.response                                # as it stands: "queued" until the scheduler
                                                # admits it, "in_progress" with the output so
                                                # far, then completed, incomplete, failed or
                                                # cancelled
    async for chunk in job.frames_after(after): # its stream events after sequence number
        ...                                     # `after`: those made, then the rest as they come
    await job.cancel()                          # stops it; the response as it ended

Every event the response's stream would carry is kept, numbered, from its `response.created`
on, so a client that dropped its stream picks it up again after the last `sequence_number` it
read (GET /v1/responses/{id}?stream=true&starting_after=N), while it runs and once it is stored.
A cancelled response's stream ends after its items close: OpenAI's events have no type for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from cadence.scheduler.stream import RequestStream
from cadence.server import protocol

if TYPE_CHECKING:
    from cadence.server.responses_api import _Run

def frame(kind: str, fields: dict, sequence_number: int) -> str:
    """One Responses stream event, as Server-Sent Events send it."""
    return (f"event: {kind}\ndata: "
            f"{protocol._ENCODE({'type': kind, 'sequence_number': sequence_number, **fields})}\n\n")


def replay(frames: list[str], after: int) -> list[str]:
    """The events after sequence number `after` (-1: all of them), of a finished response's."""
    return frames[max(after + 1, 0):]


class Background:
    def __init__(self, run: _Run, stream: RequestStream, on_done: Callable[[Background], None]):
        self.run, self.stream = run, stream
        self.output = run.output()
        self.frames: list[str] = []
        self.status = "queued"
        self.final: dict | None = None  # the response as it ended
        self._changed = asyncio.Event()  # set (and replaced) whenever frames are added
        self._on_done = on_done
        self.task = asyncio.get_running_loop().create_task(self._make())

    @property
    def response(self) -> dict:
        if self.final is not None:
            return self.final
        return self.run.response(self.status, self.output.snapshot())

    async def _make(self) -> None:
        try:
            async for events in self.run.updates(self.stream, self.output):
                for kind, fields in events:
                    self.frames.append(frame(kind, fields, len(self.frames)))
                    if kind == "response.in_progress":
                        self.status = "in_progress"
                self._changed.set()
                self._changed = asyncio.Event()
        finally:
            if self.stream.record is None:  # (the loop is going away: so is the request)
                self.stream.cancel()
            self.final = self.run.finished or self.run.response("cancelled", self.output.snapshot())
            self._changed.set()
            self._on_done(self)

    async def frames_after(self, after: int) -> AsyncIterator[str]:
        """Its events after sequence number `after`, as they come, until it ends."""
        sent = max(after + 1, 0)
        while True:
            changed = self._changed
            if sent < len(self.frames):
                chunk, sent = "".join(self.frames[sent:]), len(self.frames)
                yield chunk
            elif self.task.done():
                return
            else:
                await changed.wait()

    async def cancel(self) -> dict:
        """Stops it (its request cancelled at the scheduler's next iteration), and waits for its
        end; the response as it ended (one already finished is as it was)."""
        if not self.task.done():
            self.stream.cancel()
            await asyncio.shield(self.task)
        return self.response
