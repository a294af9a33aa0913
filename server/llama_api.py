"""llama-server's own endpoints: POST /completion (and /completions) and POST /infill.

    POST /completion {"prompt": "def add(a, b):", "n_predict": 64, "n_probs": 2}
    POST /infill     {"input_prefix": "def add(a, b):\\n    ", "input_suffix": "\\n\\nprint(add(1, 2))\\n",
                      "input_extra": [{"filename": "util.py", "text": "..."}], "prompt": ""}

/completion continues a prompt (text, or token ids). /infill has the model write what goes
between `input_prefix` (then `prompt`, the start of the middle) and `input_suffix`, with the
repository's other files (`input_extra`) as context, in the layout of `checkpoints.fim`, which
is llama-server's, so the same request gives the same prompt tokens on both. Answers are in
llama-server's own (not OpenAI's) shape: `content`, `stop_type` ("eos", "word" or "limit"),
`tokens_predicted`, `tokens_evaluated`, `timings`, with `n_probs` its
`completion_probabilities`; streamed, each chunk is a `data:` line with its `content` and
`"stop": false`, and the last has `"stop": true` with the totals (no `[DONE]`, as there).

Sampling fields are cadence's, as on /v1/completions (`temperature`, `top_k`, `top_p`, `min_p`,
`seed`, `stop`, `ignore_eos`, `logit_bias`), with llama-server's `n_predict` (-1 or absent: up
to the end of the context; 0: the prompt only, which warms the prefix cache) for `max_tokens`,
and its `grammar` (GBNF) and `json_schema` (`server.guided`). What editors (llama.vscode,
llama.vim) send besides:
- `n_indent`: a line of the answer indented less than this ends it, before the line's text (the
  block being completed has ended), and `t_max_predict_ms`: a newline written after this long
  since the first token ends it. Both are watched here, over the text as it comes
  (`EditorStops`); the request is cancelled at once, and its slot freed.
- `response_fields`: the whole answer holds only these (`timings/prompt_n` names a nested one).
- `prompt` as an array of prompts (strings, token-id arrays, `{"prompt_string": text}`), and
  `n_cmpl` (or `n`): that many completions of each prompt (choices, as the OpenAI doors' `n`),
  answered as an array by `index`, prompt after prompt (one: the answer alone); streamed, each
  chunk's `index` names its completion.
- `post_sampling_probs`: `n_probs`' probabilities (`prob`, `top_probs`) are of the distribution
  each token was drawn from, after every filter and the temperature (`RequestSampling.
  post_sampling`), not the model's raw one.
- `return_progress` (streamed): before the first token, a chunk per step of the prompt's
  computation with its `prompt_progress`; `timings_per_token`: the `timings` so far in every
  chunk (`server.llama_fields`, which the OpenAI endpoints share).
- llama.cpp's order: its filters read the logits before the temperature, which comes last (on
  the OpenAI endpoints it comes first, as vLLM has it, unless a request names one of llama.cpp's
  own samplers), and its samplers beside cadence's (`server.llama_sampling`): DRY
  (`dry_multiplier`, ...; its breakers become token ids of the served vocabulary,
  `DryBreakers`), `top_n_sigma`, `typical_p`, XTC (`xtc_probability`, `xtc_threshold`) and the
  dynamic temperature (`dynatemp_range`, `dynatemp_exponent`).
  `samplers` names those that run, in that default order (one left out is off; another order
  is a 400); its `infill` sampler is not applied. `cache_prompt`, `id_slot` and
  `t_max_prompt_ms` change nothing here (llama-server ignores the last too); the answer's
  `id_slot` is the slot the request ended in (for `POST /slots/{id}?action=save`).
- llama-server's penalties, `repeat_penalty`, `presence_penalty` and `frequency_penalty`, count
  as its do: all three over the last `repeat_last_n` tokens (64 by default; 0 turns them off,
  -1 takes the whole context) of prompt and output (`parsing.llama_penalties`).
- Mirostat (`mirostat` 1 or 2, `mirostat_tau`, `mirostat_eta`), which replaces the chain as
  in llama-server: logit_bias, the temperature, Mirostat; adaptive-p (`adaptive_target`,
  `adaptive_decay`), the draw where `samplers` ends with `adaptive_p`.
- llama.cpp's samplers that cadence does not run (tail-free, min_keep)
  and llama-server's other extras: accepted where they are off, as a client that sends all
  its settings sends them (`llama_sampling.OFF`, `_OFF`), with the settings that mean nothing
  while they are off; on, each is a 400 naming it.
Other fields are refused by name. Unlike
llama-server, a prefix or suffix too long for its batch is not cut: a prompt past the context is
refused, as every prompt is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import cadence
from cadence.checkpoints import fim
from cadence.checkpoints.tokenizer import Tokenizer
from cadence.scheduler.errors import RequestTooLong, SubmissionError
from cadence.scheduler.request import GenerationParams, PromptProgress, RequestRecord, TokenEvent, TokenLogprob
from cadence.scheduler.scheduler import RequestStream
from cadence.scheduler.stream import interleaved
from cadence.server import guided, llama_fields, llama_sampling, parsing, protocol
from cadence.server.api_error import APIError
from cadence.server.event_stream import event_stream

_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "ignore_eos", "logit_bias")
# llama-server's extras that cadence does not do, accepted off (`llama_sampling.check_off`), and
# the settings of its context shift, which change no token here (a prompt past the context is
# refused, not shifted): type-checked and ignored (`llama_fields.check_ignored`).
_OFF: dict[str, llama_sampling.Off] = {
    "verbose": ((bool,), lambda v: not v, "false"),
}
_UNUSED: dict[str, tuple[type, ...]] = {"n_keep": (int,), "n_discard": (int,), "n_cache_reuse": (int,)}
_COMMON = frozenset({"model", "prompt", "stream", "n_predict", "max_tokens", "lora",
                     "return_tokens", "n_indent", "t_max_predict_ms", *llama_fields.IGNORED,
                     "sse_ping_interval",
                     "response_fields", "n_probs", "grammar", "json_schema",
                     "timings_per_token", "return_progress", "post_sampling_probs", "n_cmpl", "n",
                     *parsing.LLAMA_PENALTY_FIELDS, *_SAMPLING, *llama_sampling.FIELDS, *_OFF,
                     *_UNUSED})
_INFILL = _COMMON | {"input_prefix", "input_suffix", "input_extra"}
MAX_EXTRA_FILES = 4096


@dataclasses.dataclass(frozen=True)
class Options:
    """The fields of llama-server's endpoints beside the completion they ask for."""

    with_ids: bool = False  # return_tokens: the answer's token ids
    predict: bool = True  # false: n_predict 0, the prompt only
    n_indent: int = 0  # 0: off
    t_max_predict_ms: float = 0.0  # 0: off
    fields: tuple[str, ...] = ()  # response_fields; empty: all
    timings_per_token: bool = False  # `timings` in every streamed chunk
    ping: float | None = None  # sse_ping_interval (None: the server's)


def _non_negative(body: dict, name: str, types: tuple[type, ...]) -> Any:
    value = parsing.field(body, name, types, 0)
    if value < 0:
        raise SubmissionError(f'"{name}" must be >= 0, got {value}', name)
    return value


def parse_completion(body: Any, defaults: parsing.SamplingDefaults) -> tuple[protocol.ParsedRequest, Options]:
    """/completion's body (its prompts, `prompts`), or SubmissionError."""
    protocol.known_fields(body, _COMMON)
    return _parse(body, defaults, prompts(body.get("prompt")), None)


def prompts(value: Any) -> list[str | list[int]]:
    """/completion's `prompt` as llama-server reads it: text, token ids, `{"prompt_string":
    text}`, or an array of those, several prompts, each answered (prompts x n_cmpl answers, by
    index); or SubmissionError. Multimodal data, and token ids mixed with text in one prompt,
    are refused (cadence serves text; a prompt is one or the other)."""
    def one(prompt):
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt_string"), str):
            if set(prompt) != {"prompt_string"}:
                raise SubmissionError('"prompt": only {"prompt_string": text} objects are served (no '
                                      "multimodal data: cadence serves text models)", "prompt")
            return prompt["prompt_string"]
        return prompt

    if isinstance(value, list) and any(isinstance(p, int) for p in value) and not parsing.token_ids(value):
        raise SubmissionError('"prompt" mixes token ids with other values; a prompt is text or token '
                              "ids (an array of prompts holds strings, token-id arrays or "
                              '{"prompt_string": text})', "prompt")
    return protocol.prompts_of([one(p) for p in value] if isinstance(value, list) else one(value))


def parse_infill(body: Any, defaults: parsing.SamplingDefaults) -> tuple[protocol.ParsedRequest, Options]:
    """/infill's body: a completion of its prefix with a `fim.Hole`, or SubmissionError."""
    protocol.known_fields(body, _INFILL)
    prefix = parsing.field(body, "input_prefix", (str,))
    suffix = parsing.field(body, "input_suffix", (str,))
    for name, value in (("input_prefix", prefix), ("input_suffix", suffix)):
        if value is None:
            raise SubmissionError(f'"{name}" is required (a string, may be empty)', name)
    chunks = parsing.field(body, "input_extra", (list,), [])
    if len(chunks) > MAX_EXTRA_FILES or not all(
            isinstance(c, dict) and not set(c) - {"text", "filename"} and isinstance(c.get("text"), str)
            and isinstance(c.get("filename", ""), str) for c in chunks):
        raise SubmissionError(f'"input_extra" must be an array of up to {MAX_EXTRA_FILES} '
                              '{"text": string, "filename": string (optional)}', "input_extra")
    extra = tuple(fim.ExtraFile(c["text"], c.get("filename", "tmp")) for c in chunks)
    hole = fim.Hole(suffix, parsing.field(body, "prompt", (str,), ""), extra)
    return _parse(body, defaults, [prefix], hole)


def _with_lora(body: dict, params: GenerationParams) -> GenerationParams:
    """`params` with llama-server's per-request adapters, `"lora": [{"id": i, "scale": s}, ...]`
    (ids in --lora's order, an adapter left out at scale 0): the (id, scale) pairs of nonzero
    scale, checked as `RequestSampling` checks them."""
    entries = parsing.field(body, "lora", (list,), [])
    if not all(isinstance(e, dict) and set(e) == {"id", "scale"} and isinstance(e["id"], int)
               and not isinstance(e["id"], bool) and e["id"] >= 0 and isinstance(e["scale"], (int, float))
               and not isinstance(e["scale"], bool) for e in entries):
        raise SubmissionError('"lora" must be an array of {"id": adapter index >= 0, "scale": a '
                              'number}', "lora")
    pairs = tuple((e["id"], float(e["scale"])) for e in entries)
    try:
        dataclasses.replace(params.sampling, lora=pairs)  # (every pair checked, zeros too)
    except ValueError as e:
        raise SubmissionError(f'"lora": {e}', "lora") from None
    lora = tuple((i, scale) for i, scale in pairs if scale != 0)
    return dataclasses.replace(params, sampling=dataclasses.replace(params.sampling, lora=lora))


def _parse(body: dict, defaults: parsing.SamplingDefaults, prompts: list[str | list[int]],
           hole: fim.Hole | None) -> tuple[protocol.ParsedRequest, Options]:
    """The fields both endpoints share."""
    llama_fields.check_ignored(body, {**llama_fields.IGNORED, **_UNUSED})
    llama_sampling.check_off(body, _OFF)
    limit = parsing.field(body, "n_predict", (int,))
    if limit is not None and limit < -1:
        raise SubmissionError(f'"n_predict" must be -1 (no limit) or more, got {limit}', "n_predict")
    given = parsing.field(body, "max_tokens", (int,))  # llama-server's alias; n_predict wins
    if given is not None and given < 1:
        raise SubmissionError(f'"max_tokens" must be >= 1, got {given}', "max_tokens")
    entry = {name: body.get(name) for name in _SAMPLING}
    # n_predict 0 computes the prompt (for the prefix cache) and one token no one sees.
    entry["max_tokens"] = given if limit is None else {-1: None, 0: 1}.get(limit, limit)
    if entry["seed"] == -1:  # llama-server's "any seed": the server's default
        entry["seed"] = None
    params = parsing.generation_params(entry, dataclasses.replace(defaults, max_tokens=None))
    params, breakers = llama_sampling.with_samplers(body, parsing.llama_penalties(body, params))
    params = _with_lora(body, params)
    probs = _non_negative(body, "n_probs", (int,))
    stream = parsing.field(body, "stream", (bool,), False)
    progress = parsing.field(body, "return_progress", (bool,), False) and stream  # (checked either way)
    post = parsing.field(body, "post_sampling_probs", (bool,), False)
    params = dataclasses.replace(params, logprobs=probs or None, progress=progress,
                                 sampling=dataclasses.replace(params.sampling, post_sampling=post))
    constraint = guided.constraint(body)  # llama-server's grammar or json_schema
    alias = parsing.field(body, "n", (int,), 1)  # n_cmpl's other name (n_cmpl wins)
    n = parsing.field(body, "n_cmpl", (int,), alias)
    for name, value in (("n", alias), ("n_cmpl", n)):
        if value < 1:
            raise SubmissionError(f'"{name}" must be >= 1, got {value}', name)
    parsed = protocol.ParsedRequest(
        model=parsing.field(body, "model", (str,)), prompts=prompts, messages=None,
        params=params, stream=stream, include_usage=False, n=n, best_of=n,
        response_format=None if constraint is None else parsing.GrammarRequest(*constraint), hole=hole,
        limit_is_cap=True, dry_breakers=breakers)
    options = Options(with_ids=parsing.field(body, "return_tokens", (bool,), False),
                      predict=limit != 0, n_indent=_non_negative(body, "n_indent", (int,)),
                      t_max_predict_ms=float(_non_negative(body, "t_max_predict_ms", (int, float))),
                      fields=llama_sampling.names(body, "response_fields"),
                      timings_per_token=parsing.field(body, "timings_per_token", (bool,), False),
                      ping=llama_fields.ping_interval(body))
    return parsed, options


class EditorStops:
    """llama-server's two ends for editors, over an answer's text as it comes (`feed` each
    token's text, `finish` at the end): with `n_indent`, a line after the first whose first
    character other than a space or tab comes at a smaller indentation ends the answer before
    that character; with `t_max_predict_ms`, text with a newline, arriving that long after the
    first token, ends it after that text. A line's indentation is held back until it is judged."""

    def __init__(self, options: Options):
        self._indent, self._limit_s = options.n_indent, options.t_max_predict_ms / 1e3
        self._first: float | None = None
        self._held = ""  # the current line's indentation, not yet judged
        self._judging = False  # at the start of a line after a newline (with n_indent)
        self.done = False

    def feed(self, text: str, now: float) -> str:
        """The part of `text` the answer keeps; `done` once it has ended."""
        if self._first is None:
            self._first = now
        kept = []
        for ch in text:
            if self._judging:
                if ch in " \t":
                    self._held += ch
                    continue
                kept.append(self._held)
                self._judging = False
                if len(self._held) < self._indent:
                    self.done = True
                    return "".join(kept)
                self._held = ""
            kept.append(ch)
            if ch == "\n" and self._indent:
                self._judging, self._held = True, ""
        if "\n" in text and self._limit_s and now - self._first > self._limit_s:
            self.done = True  # (all of this text is the answer's, a held indentation too)
            kept.append(self._held)
            self._held = ""
        return "".join(kept)

    def finish(self) -> str:
        """What is still held at the end (a last line's indentation)."""
        held, self._held = self._held, ""
        return held


class _Step(NamedTuple):
    text: str  # what the answer keeps of this step's text
    ids: list[int]
    probs: list[TokenLogprob] | None  # with n_probs


class _End(NamedTuple):
    record: RequestRecord
    text: str  # the answer, as kept
    ids: list[int]  # the tokens that made it (through the one that ended it)
    probs: list[TokenLogprob] | None
    limited: bool  # ended by EditorStops
    slot: int  # the slot it ended in, whose KV `POST /slots/{id}?action=save` takes (-1: not one)


class LlamaAPI:
    """llama-server's native endpoints: POST /completion (and /completions) and /infill, GET
    /props and /slots."""

    def __init__(self, server: Any):  # server.app.Server
        self.server = server

    def routes(self, route: Callable[[str, Any, list[str]], Route]) -> list[Route]:
        return [route("/infill", lambda r: self.generate(r, parse_infill, "infill"), ["POST"]),
                *(route(path, lambda r: self.generate(r, parse_completion, "cmpl"), ["POST"])
                  for path in ("/completion", "/completions")),
                route("/props", self.props, ["GET"]),
                route("/lora-adapters", self.lora_adapters, ["GET", "POST"]),
                *([route("/slots", self.slots, ["GET"])] if self.server.config.slots else [])]

    async def props(self, request: Request) -> Response:
        """GET /props in llama-server's shape: what its web UI and the clients written against
        it read to learn a slot's context (`n_ctx`), the slots, the chat template and the
        sampling a request gets by default. Changing them (POST) is not served."""
        server = self.server
        server._authorize(request)
        tok, sched, d = server.tokenizer, server.scheduler, server.defaults
        params = {"n_predict": -1, "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                  "min_p": 0.0, "seed": d.seed, "n_probs": 0, "stop": [], "ignore_eos": False,
                  "repeat_last_n": parsing.REPEAT_LAST_N, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                  "frequency_penalty": 0.0, **llama_sampling.SAMPLER_FIELDS, "dry_multiplier": 0.0,
                  "dry_base": llama_sampling.DRY_BASE, "dry_allowed_length": 2, "dry_penalty_last_n": 64,
                  "dry_sequence_breakers": list(llama_sampling.DRY_BREAKERS),
                  **llama_sampling.MIROSTAT_FIELDS, **llama_sampling.ADAPTIVE_FIELDS,
                  "samplers": list(llama_sampling.ORDER)}
        return JSONResponse({
            "default_generation_settings": {"n_ctx": sched.max_seq_len, "params": params},
            "total_slots": sched.num_slots, "model_alias": server.model_name,
            "model_path": server.model_name,
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": server.config.slots, "endpoint_props": False, "endpoint_metrics": True,
            "chat_template": tok.chat_template or "", "bos_token": tok.bos_token or "",
            "eos_token": tok.eos_token or "", "build_info": f"cadence {cadence.__version__}",
            "is_sleeping": False})

    async def lora_adapters(self, request: Request) -> Response:
        """GET /lora-adapters (llama-server's): each loaded adapter, its bank slot as `id`, its
        name as `path` (cadence keeps no path) and its `scale` in the global mix. POST
        [{"id", "scale"}, ...] sets that mix (an adapter left out at 0): what a request on the
        model itself runs with unless it gives its own `lora`. It starts empty, where
        llama-server starts every adapter at 1: here adapters are asked for by name."""
        server = self.server
        models = server.models
        if request.method == "POST":
            body = await server.read_body(request)
            if not isinstance(body, list):  # (null would read as "lora" left out)
                raise APIError(400, 'the body must be an array of {"id", "scale"} objects', param="lora")
            try:
                mix = _with_lora({"lora": body}, GenerationParams()).sampling.lora
            except SubmissionError as e:
                raise APIError(400, str(e).replace('"lora" must be', "the body must be"), param=e.param) from None
            models.check_lora(mix)
            models.mix = mix
            return JSONResponse({"success": True})
        server._authorize(request)
        scales = dict(models.mix)
        return JSONResponse([{"id": slot, "path": name, "scale": scales.get(slot, 0.0)}
                             for name, slot in sorted(models.adapters.items(), key=lambda item: item[1])])

    async def slots(self, request: Request) -> Response:
        """GET /slots in llama-server's shape: each KV slot (of every pool: `pool`, and `id`
        within it), whether a request holds it (`is_processing`, its id as `id_task`, and
        `next_token`'s counts), with cadence's own fields beside them: the request's `state`,
        `priority` and prompt tokens (`n_prompt_tokens`, `n_prompt_tokens_processed`). Not its
        prompt text, which llama-server shows. `?fail_on_no_slot=1`: 503 when no slot is free."""
        server = self.server
        server._authorize(request)
        sched = server.scheduler
        slots = sched.slots()
        speculative = bool(sched.pools[-1].engine.config.speculative_tokens)
        body = [{"id": s.slot, "pool": s.pool, "id_task": s.request_id if s.request_id else -1,
                 "n_ctx": sched.max_seq_len, "speculative": speculative,
                 "is_processing": s.request_id is not None, "state": s.state, "priority": s.priority,
                 "n_prompt_tokens": s.prompt_tokens, "n_prompt_tokens_processed": s.prefilled,
                 "next_token": {"has_next_token": s.request_id is not None, "has_new_line": False,
                                "n_remain": s.remaining, "n_decoded": s.decoded, "stopping_word": ""}}
                for s in slots]
        if request.query_params.get("fail_on_no_slot") not in (None, "", "0", "false") and not any(
                s.request_id is None for s in slots):
            raise APIError(503, "no slot available (fail_on_no_slot)", type="service_unavailable")
        return JSONResponse(body)

    async def generate(self, request: Request, parse: Callable, prefix: str) -> Response:
        server = self.server
        body = await server.read_body(request)
        try:
            parsed, options = parse(body, server.defaults)
        except SubmissionError as e:
            raise APIError(400, str(e), param=e.param) from None
        server.models.check(parsed.model)
        most = server.scheduler.engine.config.max_logprobs
        if (parsed.params.logprobs or 0) > most:
            raise APIError(400, f'"n_probs" must be at most {most} (the server\'s --max_logprobs), '
                                f"got {parsed.params.logprobs}", param="n_probs")
        if parsed.n > server.config.max_n:
            raise APIError(400, f'"n_cmpl" must be at most {server.config.max_n} (the server\'s '
                                f"--max_n), got {parsed.n}", param="n_cmpl")
        request_id = protocol.request_id(request.headers, prefix)
        # llama-server's order: each prompt's n_cmpl completions, prompt after prompt
        streams = [s for group in await server.submit(parsed, request_id) for s in group]
        headers = {"X-Request-Id": request_id}
        if parsed.stream:
            return event_stream(self._all_chunks(streams, options), headers, server.ping(options.ping))
        watcher = asyncio.create_task(protocol.cancel_on_disconnect(request, streams))

        async def end_of(stream: RequestStream) -> _End:
            return [step async for step in self._steps(stream, options)][-1]

        try:
            ends = await asyncio.gather(*map(end_of, streams))
        finally:
            watcher.cancel()
        failed = next((end.record for end in ends if end.record.finish_reason == "error"), None)
        if failed is not None:
            raise APIError(500, f"generation failed: {failed.error}", type="server_error")
        answers = []
        for index, end in enumerate(ends):
            answer = self.final(end, options, index=index)
            if end.probs is not None:
                answer["completion_probabilities"] = self._probs(end.probs, parsed.params.sampling.post_sampling)
            answers.append(_selected(answer, options.fields) if options.fields else answer)
        # one completion: its answer; several (prompts x n_cmpl): an array, by index (llama-server's)
        return JSONResponse(answers[0] if len(answers) == 1 else answers, headers=headers)

    async def _steps(self, stream: RequestStream,
                     options: Options) -> AsyncIterator[_Step | PromptProgress | _End]:
        """Each token's `_Step` (after the prompt's progress, where asked), then the `_End`. A
        request the editor's stops end is cancelled there; tokens already on their way are
        dropped."""
        stops, text, ids = EditorStops(options), [], []
        probs = [] if stream.request.params.logprobs is not None else None
        try:
            async for event in stream:
                if isinstance(event, PromptProgress):
                    yield event
                    continue
                if isinstance(event, TokenEvent):
                    if stops.done or not options.predict:
                        continue
                    kept = stops.feed(event.text, event.time)
                    text.append(kept)
                    ids += event.token_ids
                    if probs is not None:
                        probs += event.logprobs
                    if stops.done:  # (before the step goes out: a slow reader holds no slot)
                        stream.cancel()
                    yield _Step(kept, event.token_ids, event.logprobs)
                    continue
                rest = "" if stops.done else stops.finish()
                if rest:
                    text.append(rest)
                    yield _Step(rest, [], None)
                r = stream.request  # (disaggregated, it ends in the decode pool: no slot file's)
                slot = -1 if r.slot is None or self.server.scheduler.disaggregated else r.slot
                yield _End(event, "".join(text), ids, probs, stops.done, slot)
        finally:
            if stream.record is None:  # the client went away
                stream.cancel()

    def final(self, end: _End, options: Options, streamed: bool = False, index: int = 0) -> dict[str, Any]:
        """The whole answer of completion `index`, or a stream's last chunk (`streamed`:
        content ""), in llama-server's shape."""
        record, n = end.record, len(end.ids)
        return {"index": index, "content": "" if streamed else end.text,
                "tokens": end.ids if options.with_ids and not streamed else [],
                "id_slot": end.slot, "stop": True, "model": self.server.model_name,
                "tokens_predicted": n, "tokens_evaluated": record.prompt_tokens,
                "has_new_line": "\n" in end.text, "truncated": False,
                # n_predict 0 (nothing predicted) ends where its limit is, whatever its hidden token was
                "stop_type": "limit" if end.limited or not options.predict else stop_type(record),
                "stopping_word": record.stop_reason if isinstance(record.stop_reason, str)
                and options.predict else "",
                "tokens_cached": record.prompt_tokens + n, "timings": llama_fields.timings(record, n)}

    def _probs(self, entries: list[TokenLogprob], post: bool = False) -> list[dict]:
        """llama-server's `completion_probabilities`: each token's id, text, bytes and logprob,
        with its `n_probs` likeliest alternatives; `post` (post_sampling_probs): probabilities
        (`prob`, `top_probs`) of the distribution it was drawn from, the alternatives it held
        (those of probability 0 left out, as there)."""
        raw = self.server.tokenizer.token_bytes
        name, value = ("prob", math.exp) if post else ("logprob", float)

        def token(token_id: int, logprob: float, text: bytes) -> dict:
            return {"id": token_id, "token": text.decode("utf-8", errors="replace"),
                    "bytes": list(text), name: value(logprob)}

        return [{**token(e.token_id, e.logprob, e.text.encode("utf-8")),
                 f"top_{name}s": [token(i, v, raw(i)) for i, v in e.top if math.isfinite(v)]}
                for e in entries]

    async def _all_chunks(self, streams: list[RequestStream], options: Options) -> AsyncIterator[str]:
        """Each completion's chunks (`_chunks`, under its index) as they come."""
        if len(streams) == 1:
            async for chunk in self._chunks(streams[0], options):
                yield chunk
            return
        # (a client gone: each stream cancelled as its `_chunks` closes)
        async for _, chunk in interleaved([self._chunks(s, options, i) for i, s in enumerate(streams)]):
            yield chunk

    async def _chunks(self, stream: RequestStream, options: Options, index: int = 0) -> AsyncIterator[str]:
        """A chunk per step (its text may be empty, held back for a stop string or an
        indentation, as there), then the totals. Token ids go in every chunk, as llama-server
        sends them; with return_progress, a chunk per `PromptProgress` before them, and with
        timings_per_token, the timings so far in each."""
        predicted, evaluated = 0, len(stream.request.prompt_ids)
        async for step in self._steps(stream, options):
            if isinstance(step, PromptProgress):
                yield protocol.frame({"index": index, "content": "", "tokens": [], "stop": False, "id_slot": -1,
                                      "tokens_predicted": 0, "tokens_evaluated": evaluated,
                                      "prompt_progress": llama_fields.progress(step)})
                continue
            if isinstance(step, _End):
                if step.record.finish_reason == "error":
                    yield protocol.frame(APIError(500, f"generation failed: {step.record.error}",
                                          type="server_error").body())
                else:
                    yield protocol.frame(self.final(step, options, streamed=True, index=index))
                return
            predicted += len(step.ids)
            chunk = {"index": index, "content": step.text, "tokens": step.ids, "stop": False,
                     "id_slot": -1, "tokens_predicted": predicted, "tokens_evaluated": evaluated}
            if step.probs:
                post = stream.request.params.sampling.post_sampling
                chunk["completion_probabilities"] = self._probs(step.probs, post)
            if options.timings_per_token:
                chunk["timings"] = llama_fields.timings_so_far(stream.request, predicted, time.monotonic())
            yield protocol.frame(chunk)


def _selected(answer: dict, paths: tuple[str, ...]) -> dict:
    """llama-server's `response_fields`: each path ("timings/prompt_n") found, under its own
    name; the others left out."""
    out = {}
    for path in paths:
        node: Any = answer
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            out[path] = node
    return out


def fill_ids(tokenizer: Tokenizer, fim_tokens: fim.FimTokens | None, max_seq_len: int,
             prefix: str | list[int], hole: fim.Hole) -> list[int]:
    """A fill-in-the-middle prompt's ids (`checkpoints.fim`), if the model can infill. Errors
    name /infill's field, or completions' (a hole without files is `suffix`'s)."""
    param = "input_prefix" if hole.extra is not None else "suffix"
    if fim_tokens is None:
        raise SubmissionError(fim.missing_message(tokenizer), param)
    texts = hole.texts() + ([prefix] if isinstance(prefix, str) else [])
    try:
        parsing.check_prompt_size("".join(texts), tokenizer, max_seq_len)
    except RequestTooLong as e:
        raise RequestTooLong(str(e), param) from None
    return fim.infill_ids(tokenizer, fim_tokens, prefix, hole)


def stop_type(record: RequestRecord) -> str:
    """llama-server's reason: "limit" (n_predict or the context), "word" (a stop string), or
    "eos" (the model ended, or its grammar did)."""
    if record.finish_reason == "length":
        return "limit"
    return "word" if isinstance(record.stop_reason, str) else "eos"
