"""Loading and unloading LoRA adapters while serving (vLLM's runtime LoRA updating), where the
server was started with --runtime_lora:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

A load reads the adapter (a PEFT folder or a GGUF adapter, as --lora does) off the event loop,
writes it into a free slot of every engine's bank (`Engine.set_adapter`: the bank keeps its
shape, so nothing compiles), and only then names it, so no request can ask for it half
written. An unload is refused (409) while a request uses the adapter; the slot's next adapter
counts the slot's version on, so the prefix cache never serves one adapter's KV to the next.
Success answers as vLLM's do, in plain text.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from cadence.checkpoints.adapters import load_adapter
from cadence.checkpoints.errors import CheckpointError
from cadence.server.api_error import APIError


class LoraAPI:
    def __init__(self, server):
        self.server = server
        self._loading = asyncio.Lock()  # one load at a time: each takes a slot, then fills it

    def routes(self, route) -> list:
        return [route("/v1/load_lora_adapter", self.load, ["POST"]),
                route("/v1/unload_lora_adapter", self.unload, ["POST"])]

    async def load(self, request: Request) -> Response:
        server = self.server
        name, path = self._fields(await server.read_body(request), ("lora_name", "lora_path"))
        models, engines = server.models, server.scheduler.engines
        async with self._loading:
            if name in models.every:
                raise APIError(400, f"the name '{name}' is taken ({', '.join(models.every)})",
                               param="lora_name")
            try:
                slot = models.free_slot()
                adapter = await asyncio.to_thread(load_adapter, Path(path).expanduser(),
                                                  engines[0].model_config, name)
                for engine in engines:  # (the slot is free until named: no request reads it)
                    await asyncio.to_thread(engine.set_adapter, slot, adapter)
            except (CheckpointError, ValueError, OSError) as e:
                raise APIError(400, str(e), param="lora_path") from None
            models.add(name, slot)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        server = self.server
        (name,) = self._fields(await server.read_body(request), ("lora_name",))
        if name not in server.models.adapters:
            raise APIError(404, f"no LoRA adapter '{name}' is loaded", param="lora_name",
                           code="model_not_found")
        server.models.remove(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @staticmethod
    def _fields(body, names: tuple[str, ...]) -> list[str]:
        if not isinstance(body, dict) or not all(isinstance(body.get(n), str) and body[n] for n in names):
            raise APIError(400, f"the body must be a JSON object with {', '.join(names)} (strings)")
        return [body[n] for n in names]
