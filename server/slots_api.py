"""llama-server's slot actions: `POST /slots/{id_slot}?action=save|restore|erase`, with files in
`--slot_save_path` (its `--slot-save-path`).

    POST /slots/0?action=save     {"filename": "chat.bin"}  -> {"id_slot", "filename", "n_saved",
                                                                "n_written", "timings": {"save_ms"}}
    POST /slots/0?action=restore  {"filename": "chat.bin"}  -> {"id_slot", "filename", "n_restored",
                                                                "n_read", "timings": {"restore_ms"}}
    POST /slots/0?action=erase                              -> {"id_slot", "n_erased"}

What a slot holds in cadence is the prefix cache's (`scheduler.slot_files`): saving writes the
KV of the whole pages of the sequence that let the slot go last, as far as the caches hold it;
restoring puts a file's pages back into the cache, where any later prompt that starts with those
tokens finds them, whatever slot it runs in; erasing drops that sequence's pages from the caches
where no request holds them. The calls on the pool run on the scheduler's loop, between
iterations (`Scheduler.call_in_loop`); the file is read and written off it.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cadence.scheduler.errors import EngineDead, NotRunning
from cadence.scheduler.slot_files import SlotFile, forget
from cadence.server.api_error import APIError

ACTIONS = ("save", "restore", "erase")
# A file name in the save folder: no folder, no parent, nothing hidden, nothing unprintable.
_FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}")


class SlotFilesAPI:
    def __init__(self, server: Any):  # server.app.Server
        self.server = server
        self.folder = Path(server.config.slot_save_path) if server.config.slot_save_path else None

    def routes(self, route) -> list[Route]:
        return [route("/slots/{id_slot}", self.action, ["POST"])]

    async def action(self, request: Request) -> Response:
        server = self.server
        server._check(request)
        if self.folder is None:
            raise APIError(501, "this server keeps no slot files: start it with --slot_save_path",
                           type="not_supported_error")
        sched = server.scheduler
        pool = sched.pools[0]  # the pool that admits and caches prompts
        if not pool.pages.caching:
            raise APIError(501, "slot files are the prefix cache's pages: this server runs with "
                                "--noprefix_caching", type="not_supported_error")
        slot = request.path_params["id_slot"]
        if not re.fullmatch(r"[0-9]{1,9}", slot) or int(slot) >= pool.num_slots:
            raise APIError(400, f"invalid slot id {slot!r}: the slots are 0..{pool.num_slots - 1}",
                           param="id_slot")
        slot = int(slot)
        action = request.query_params.get("action")
        if action not in ACTIONS:
            raise APIError(400, f"action must be one of {', '.join(ACTIONS)}, got {action!r}", param="action")
        start = time.monotonic()
        body = await server.read_body(request, optional=True)
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise APIError(400, 'the body must be an object: {"filename": ...}')
        filename = body.get("filename")
        if (filename is not None or action != "erase") and not (
                isinstance(filename, str) and _FILENAME.fullmatch(filename)):
            raise APIError(400, '"filename" must be a file name in the save folder (letters, digits, '
                                f"'_', '-' and '.', not starting with '.' or '-'), got {filename!r}",
                           param="filename")
        if action == "erase":  # (a filename, if sent, is not used)
            return JSONResponse({"id_slot": slot, "n_erased": await self._on_loop(lambda: forget(pool, slot))})
        path = self.folder / filename
        namespace = sched.config.cache_namespace
        if action == "save":
            saved = await self._on_loop(lambda: SlotFile.take(pool, slot, namespace))
            try:
                written = await asyncio.to_thread(saved.write, path)
            except OSError as e:  # (a folder of that name, a full disk, ...)
                raise APIError(400, f"cannot write {filename!r}: {e.strerror or e}", param="filename") from None
            return JSONResponse({"id_slot": slot, "filename": filename, "n_saved": len(saved.tokens),
                                 "n_written": written,
                                 "timings": {"save_ms": (time.monotonic() - start) * 1e3}})
        try:
            size = path.stat().st_size if path.is_file() else None
        except OSError:
            size = None
        if size is None:
            raise APIError(404, f"no slot file {filename!r} in the save folder", param="filename",
                           code="not_found")
        try:
            saved = await asyncio.to_thread(SlotFile.read, path)
        except ValueError as e:
            raise APIError(400, str(e), param="filename") from None
        restored = await self._on_loop(lambda: saved.restore(pool, namespace))
        return JSONResponse({"id_slot": slot, "filename": filename, "n_restored": restored,
                             "n_read": size,
                             "timings": {"restore_ms": (time.monotonic() - start) * 1e3}})

    async def _on_loop(self, fn):
        """`fn`'s result, run on the scheduler's loop; its ValueError a 400."""
        try:
            return await asyncio.wrap_future(self.server.scheduler.call_in_loop(fn))
        except (EngineDead, NotRunning) as e:
            raise APIError(503, str(e), type="service_unavailable") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
