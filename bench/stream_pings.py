"""What a streamed frame costs on the event loop with keep-alive pings on
(`server.event_stream.PingedStream`) and off: frames from a source that yields at once, sent to
an ASGI `send` that returns at once, so the response's own work is all that is timed.

    python -m cadence.bench.stream_pings --frames=20000 --rounds=5 --out=bench/results/llama-clients-cpu/pings.json

Prints microseconds per frame, off and on (the median of `--rounds`), and writes them with the
machine (`bench.report.machine`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

from absl import app, flags

from cadence.bench.report import machine
from cadence.server.event_stream import event_stream

_FRAMES = flags.DEFINE_integer("frames", 20000, "Frames per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Rounds per setting.")
_OUT = flags.DEFINE_string("out", None, "Where to write the JSON results.")


async def _frames(n: int):
    for _ in range(n):
        await asyncio.sleep(0)  # (a source that waits on something, as a request stream does)
        yield "data: {}\n\n"


async def _per_frame_us(ping: float | None, n: int) -> float:
    async def send(message):
        pass

    start = time.perf_counter()
    await event_stream(_frames(n), {}, ping).stream_response(send)
    return (time.perf_counter() - start) / n * 1e6


def main(argv: list[str]) -> None:
    del argv
    results = {}
    for label, ping in (("off", None), ("on", 30.0)):
        rounds = [asyncio.run(_per_frame_us(ping, _FRAMES.value)) for _ in range(_ROUNDS.value)]
        results[label] = {"ping_s": ping, "us_per_frame": rounds, "median": statistics.median(rounds)}
        print(f"pings {label}: {results[label]['median']:.2f} us a frame (median of {len(rounds)})")
    if _OUT.value:
        record = {"machine": machine(), "frames": _FRAMES.value, **results}
        Path(_OUT.value).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    app.run(main)
