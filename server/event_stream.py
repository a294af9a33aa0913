"""Every door's Server-Sent Events response, kept alive while it has nothing to say.

    return event_stream(frames, headers, ping=30.0)   # a StreamingResponse of `frames`

A stream can stay silent for a long time before its first frame: queued behind full slots, or
prefilling a long prompt on a CPU. Clients and proxies give up on a silent connection (Node's
fetch after 300 s of no data), so, as llama-server does, a comment line (`:`, which every SSE
parser skips) goes out whenever a stream has been silent `ping` seconds. A request may ask
for its own interval (llama-server's `sse_ping_interval`; 0 or less: none); the server's is
`--sse_ping_interval`.

The frames are read and sent as a plain StreamingResponse sends them; beside them, a task
wakes once per interval and sends a ping only if nothing went out meanwhile. A frame costs a
clock read and an uncontended lock (its send and a ping's never interleave), not a task or a
timer: this is every streamed token's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse
from starlette.types import Send

PING = b":\n\n"


class PingedStream(StreamingResponse):
    """A StreamingResponse that sends `PING` after each `ping` seconds of silence (None or 0
    or less: never)."""

    def __init__(self, content: AsyncIterator[str], ping: float | None, **kwargs):
        super().__init__(content, **kwargs)
        self.ping = ping if ping and ping > 0 else None

    async def stream_response(self, send: Send) -> None:
        if self.ping is None:
            return await super().stream_response(send)
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        lock, last = asyncio.Lock(), [time.monotonic()]

        async def body(chunk: bytes) -> None:
            async with lock:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                last[0] = time.monotonic()

        async def keep_alive() -> None:
            while True:
                await asyncio.sleep(last[0] + self.ping - time.monotonic())
                if time.monotonic() - last[0] >= self.ping:
                    await body(PING)

        pinger = asyncio.create_task(keep_alive())
        try:
            async for chunk in self.body_iterator:
                await body(chunk if isinstance(chunk, bytes | memoryview) else chunk.encode(self.charset))
        finally:
            pinger.cancel()
            # (a ping's failed send is the connection's failure, which the frames' sends meet too)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pinger
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def event_stream(frames: AsyncIterator[str], headers: dict[str, str], ping: float | None) -> StreamingResponse:
    """`frames` as a text/event-stream response (not cached), pinged while silent."""
    return PingedStream(frames, ping, media_type="text/event-stream",
                        headers={**headers, "Cache-Control": "no-cache"})
