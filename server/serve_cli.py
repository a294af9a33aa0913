"""`cadence-serve`: the OpenAI-compatible HTTP server.

    cadence-serve --model=smollm2-135m --port=8000
    CADENCE_API_KEY=... cadence-serve --host=0.0.0.0          # or --api_key_file=/run/secrets/key

Loads the model, starts listening at once (GET /health answers 503 while the engine compiles
its programs), then serves /v1/completions, /v1/chat/completions, /v1/models and /metrics.
SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish for up to
--drain_timeout seconds, and exits 0; during warm-up it exits at once. A warm-up that fails is
logged and the server exits with status 1. Binds to loopback unless --host says otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn
from absl import app, flags, logging

from cadence.checkpoints.errors import CheckpointError
from cadence.server import runtime
from cadence.server.app import DEFAULT_MAX_BODY_BYTES, ServerConfig, create_app
from cadence.server.flags import (GRAMMAR_TIMEOUT, LORA, MAX_LORAS, MODEL_FLAG, REASONING_PARSER, SLOT_SAVE_PATH,
                                  pooling)

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on.")
_API_KEY = flags.DEFINE_string(
    "api_key", None, "If set, clients must send 'Authorization: Bearer KEY'. Prefer the "
    "CADENCE_API_KEY environment variable or --api_key_file: argv is visible to every user.")
_API_KEY_FILE = flags.DEFINE_string("api_key_file", None, "A file holding the API key (one line).")
_PROTECT_METRICS = flags.DEFINE_bool("protect_metrics", False, "With an API key, /metrics needs it too.")
_DRAIN = flags.DEFINE_float("drain_timeout", 30.0, "Seconds to let in-flight requests finish on shutdown.")
_PING = flags.DEFINE_float(
    "sse_ping_interval", 30.0, "Seconds a streamed answer may stay silent (queued, or prefilling a "
    "long prompt) before a keep-alive comment line goes out, as llama-server's; 0: never. A "
    "request's own sse_ping_interval wins.")
_MAX_BODY = flags.DEFINE_string(
    "max_body_size", f"{DEFAULT_MAX_BODY_BYTES // 2**20}MiB",
    "Largest request body accepted (bytes, or with a unit: 512KiB, 4MiB); larger ones get 413.")
_SERVED_NAMES = flags.DEFINE_list(
    "served_model_name", None, "The model's names in the API (vLLM's --served-model-name): a "
    "request's \"model\" may give any of them, answers and /v1/models carry the first. Default: "
    "--model as given for a known model's name, else the file's or folder's name (a GGUF's "
    "without .gguf: /models/qwen2.5-0.5b.Q4_K_M.gguf serves as 'qwen2.5-0.5b.Q4_K_M').")
_MAX_N = flags.DEFINE_integer(
    "max_n", 8, "Most choices one request may ask for (n, best_of on completions, n_cmpl on "
    "llama-server's /completion); the later choices of a request take its prompt's KV from the "
    "first.", lower_bound=1)

_ORIGINS = flags.DEFINE_list(
    "allowed_origins", ["*"], "Origins whose web pages may call the API from a browser (CORS), "
    "as vLLM's --allowed-origins and llama-server allow: '*' any (the default, as theirs), a "
    "list of origins (https://chat.example.com), or empty (--allowed_origins=) for none. "
    "Preflight requests need no API key; the requests themselves do.")
_SLOTS = flags.DEFINE_bool(
    "slots", True, "Serve GET /slots, each KV slot and the request holding it (llama-server's "
    "endpoint, token counts rather than its prompt text); --noslots turns it off (404).")
_RUNTIME_LORA = flags.DEFINE_bool(
    "runtime_lora", False,
    "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA "
    "updating): adapters read from paths on this machine into --max_loras's free slots. Off, "
    "as vLLM's, since a request names a path to read.")
_TRUST_TEMPLATES = flags.DEFINE_bool(
    "trust_request_chat_template", False,
    "Let a chat request bring its own Jinja chat template (vLLM's chat_template field and "
    "--trust-request-chat-template). Templates run sandboxed, but one can cost a worker thread "
    "time; off, such a request is a 400.")


def api_key() -> str | None:
    """--api_key, else --api_key_file, else $CADENCE_API_KEY; None: no key required."""
    if _API_KEY.value is not None and _API_KEY_FILE.value is not None:
        raise ValueError("pass --api_key or --api_key_file, not both")
    if _API_KEY_FILE.value is not None:
        key = Path(_API_KEY_FILE.value).read_text().strip()
        if not key:
            raise ValueError(f"--api_key_file={_API_KEY_FILE.value} is empty")
        return key
    return _API_KEY.value or os.environ.get("CADENCE_API_KEY") or None


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use, or an address this
    machine does not have, is a one-line error at once rather than after the load and warm-up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart's TIME_WAIT
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def main(argv: list[str]) -> int:
    del argv
    try:
        sock = listen(_HOST.value, _PORT.value)
        config = ServerConfig(api_key=api_key(), protect_metrics=_PROTECT_METRICS.value,
                              max_body_bytes=runtime.parse_size(_MAX_BODY.value), drain_timeout=_DRAIN.value,
                              max_n=_MAX_N.value, grammar_timeout=GRAMMAR_TIMEOUT.value,
                              reasoning_parser=REASONING_PARSER.value,
                              trust_request_chat_template=_TRUST_TEMPLATES.value,
                              allowed_origins=tuple(_ORIGINS.value), slots=_SLOTS.value,
                              slot_save_path=SLOT_SAVE_PATH.value, sse_ping_interval=_PING.value)
        if SLOT_SAVE_PATH.value:  # (as llama-server, made if missing)
            Path(SLOT_SAVE_PATH.value).mkdir(parents=True, exist_ok=True)
        names = runtime.served_names(MODEL_FLAG.value, _SERVED_NAMES.value)
        if _RUNTIME_LORA.value and MAX_LORAS.value <= len(LORA.value):
            raise ValueError("--runtime_lora loads adapters into free bank slots: give --max_loras "
                             f"more than --lora's {len(LORA.value)}")
        if _RUNTIME_LORA.value and runtime.multi_process():
            raise ValueError("--runtime_lora writes this process's banks; the others of "
                             "--num_processes would not follow: load adapters with --lora")
        rt = runtime.build_from_flags(warm=False)
    except (CheckpointError, ValueError, OSError) as e:
        print(f"cadence-serve: error: {e}", file=sys.stderr)
        return 2
    server: uvicorn.Server | None = None
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:  # the warm-up thread: make uvicorn shut down
        fatal.append(reason)
        print(f"cadence-serve: error: {reason}; exiting", file=sys.stderr)
        server.should_exit = True

    config = dataclasses.replace(config, pooling=pooling(rt.model.config),
                                 lora_adapters=tuple(a.name for a in rt.adapters),
                                 lora_slots=rt.engines[-1].config.lora_slots, runtime_lora=_RUNTIME_LORA.value)
    application = create_app(
        rt.scheduler, rt.model.tokenizer, names, config=config,
        warmup=rt.warm_up, generation=rt.model.generation, on_fatal=on_fatal, ranking=rt.model.ranking)
    server = uvicorn.Server(uvicorn.Config(
        application, host=_HOST.value, port=_PORT.value, log_level="warning",
        timeout_graceful_shutdown=max(1, int(_DRAIN.value))))
    print(f"cadence: listening on http://{_HOST.value}:{sock.getsockname()[1]}", file=sys.stderr)
    # uvicorn re-raises the signal that stopped it once it has shut down gracefully, to the
    # handler it found: make that one a no-op, so a drained SIGTERM ends in a clean exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    if fatal:
        return 1
    if application.state.server.warming:
        # XLA's compiler cannot be interrupted, and a Python exit would wait for it: leave now.
        print("cadence-serve: stopped during warm-up", file=sys.stderr)
        logging.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def run() -> None:
    app.run(main)


if __name__ == "__main__":
    run()
