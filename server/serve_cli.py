"""`cadence-serve`: the OpenAI-compatible HTTP server.

    cadence-serve --model=smollm2-135m --port=8000

Loads the model, starts listening at once (GET /health answers 503 while the engine compiles
its programs), then serves /v1/completions, /v1/chat/completions, /v1/models and /metrics.
SIGTERM or Ctrl-C stops accepting connections, drains in-flight requests, and exits.
"""

from __future__ import annotations

import sys

import uvicorn
from absl import app, flags

from checkpoints.errors import CheckpointError
from server import runtime
from server.app import create_app

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_API_KEY = flags.DEFINE_string("api_key", None, "If set, clients must send 'Authorization: Bearer KEY'.")
_DRAIN = flags.DEFINE_float("drain_timeout", 30.0, "Seconds to let in-flight requests finish on shutdown.")


def main(argv: list[str]) -> int:
    del argv
    try:
        rt = runtime.build_from_flags(warm=False)
    except (CheckpointError, ValueError) as e:
        print(f"cadence-serve: error: {e}", file=sys.stderr)
        return 2
    application = create_app(
        rt.scheduler, rt.model.tokenizer, runtime.MODEL_FLAG.value, api_key=_API_KEY.value,
        warmup=lambda: runtime.warm_up(rt.engine),
    )
    print(f"cadence: listening on http://{_HOST.value}:{_PORT.value}", file=sys.stderr)
    uvicorn.run(application, host=_HOST.value, port=_PORT.value, log_level="warning",
                timeout_graceful_shutdown=int(_DRAIN.value))
    return 0


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
