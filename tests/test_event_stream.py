"""Keep-alive pings on a silent event stream (`server.event_stream.PingedStream`), over a
source that sleeps as a queued or prefilling request does, sent to a recording ASGI `send`."""

from __future__ import annotations

import asyncio

import pytest

from cadence.server.event_stream import PING, event_stream


async def source(events: list[tuple[float, str]], closed: list[str]):
    """Each frame after its delay; notes in `closed` how it ended."""
    try:
        for delay, frame in events:
            await asyncio.sleep(delay)
            yield frame
        closed.append("done")
    finally:
        closed.append("closed")


def bodies(frames, ping) -> list[bytes]:
    """What the response sends: its body chunks, after one start message, up to its end."""
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    asyncio.run(event_stream(frames, {}, ping).stream_response(send))
    assert sent[0]["type"] == "http.response.start" and sent[-1] == {
        "type": "http.response.body", "body": b"", "more_body": False}
    return [m["body"] for m in sent[1:-1]]


def test_a_silent_stream_is_pinged_and_its_frames_pass_in_order():
    closed: list[str] = []
    out = bodies(source([(0.35, "a"), (0.0, "b"), (0.25, "c")], closed), 0.1)
    assert [f for f in out if f != PING] == [b"a", b"b", b"c"] and closed == ["done", "closed"]
    before_a = out[:out.index(b"a")]
    assert before_a == [PING] * len(before_a) and 2 <= len(before_a) <= 4
    assert out[out.index(b"a") + 1] == b"b"  # no ping where nothing waited
    assert PING in out[out.index(b"b"):out.index(b"c")]  # (0.25 s of silence again)
    assert out[-1] == b"c"  # none after the last frame


@pytest.mark.parametrize("ping", [None, 0, -1])
def test_no_interval_no_pings(ping):
    closed: list[str] = []
    assert bodies(source([(0.15, "a"), (0.0, "b")], closed), ping) == [b"a", b"b"]
    assert closed == ["done", "closed"]


def test_a_client_gone_mid_wait_closes_the_source_and_the_pings_stop():
    """Cancelled while the source waits for its next frame (the client hung up): the source is
    cancelled there and its cleanup runs (a request stream's cancels its request), and no ping
    goes out after."""
    closed: list[str] = []
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def main():
        response = event_stream(source([(0.0, "a"), (10.0, "b")], closed), {}, 0.05)
        task = asyncio.create_task(response.stream_response(send))
        await asyncio.sleep(0.18)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        count = len(sent)
        await asyncio.sleep(0.15)
        return count

    count = asyncio.run(main())
    assert closed == ["closed"] and len(sent) == count
    assert [m["body"] for m in sent[1:]][:1] == [b"a"] and {m["body"] for m in sent[2:]} == {PING}


def test_a_failing_source_fails_the_stream():
    async def broken():
        yield "a"
        await asyncio.sleep(0.12)
        raise RuntimeError("engine failed")

    with pytest.raises(RuntimeError, match="engine failed"):
        bodies(broken(), 0.05)
