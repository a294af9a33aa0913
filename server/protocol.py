"""The OpenAI wire format: request bodies into scheduler calls, responses into OpenAI's shapes.

Parsing goes through `server/parsing.py`, the one parser of every front door, and is strict
where a silent guess would surprise a client: wrong types, out-of-range values and unknown
fields are refused with the parameter named (OpenAI, too, refuses an unrecognized argument).
Fields that would change the answer if honoured and that cadence does not implement (the legacy
`functions`, `audio`, ...) are refused unless they carry their neutral
value; fields that change nothing here (`user`, `metadata`, ...) are accepted and ignored.
`response_format` (`json_object`, `json_schema`), or vLLM's and llama-server's spellings of a
constraint (`server.guided`), constrains the answer with a grammar (`scheduler.grammar`); chat's `tools`, `tool_choice` and `parallel_tool_calls` are
`server.tool_requests`', and an answer's calls come back as `tool_calls` (`server.tool_call_parser`).
Sampling fields a request leaves out take the model's published defaults
(`SamplingDefaults.with_model`), else OpenAI's (temperature 1.0, top_p 1.0); completions default
to 16 tokens as OpenAI's do, chats to the end of the context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from cadence.scheduler.errors import EngineDead, NotRunning, Overloaded, RequestTooLong, SubmissionError
from cadence.checkpoints import fim
from cadence.checkpoints.detokenizer import IncrementalDetokenizer
from cadence.checkpoints.tokenizer import Tokenizer, TokenizerError
from cadence.scheduler.request import GenerationParams, RequestRecord, TokenLogprob
from cadence.scheduler.stream import RequestStream
from cadence.server import guided, llama_fields, llama_sampling, parsing, tool_requests
from cadence.server.api_error import APIError
from cadence.server.tool_call_parser import ToolCall
from cadence.server.reasoning import split_reasoning


# OpenAI's own defaults, for a model that publishes none.
OPENAI_DEFAULTS = parsing.SamplingDefaults(max_tokens=None, temperature=1.0, top_p=1.0)
COMPLETION_MAX_TOKENS = 16
DEFAULT_MAX_N = 8  # choices per request (n, and best_of on completions): the server's --max_n

# Fields that change the answer, which cadence does not implement: refused unless neutral.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "functions": ([],), "function_call": ("none", "auto"),
    "modalities": (["text"],), "audio": (),
}
# SGLang's own request fields, which sglang-router writes into every request it forwards (with
# these values unless its client set others): accepted at the values that mean what cadence does.
_SGLANG_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "no_stop_trim": (False,), "continue_final_message": (False,),
    "return_hidden_states": (False,),
    # Reasoning is streamed as it comes, whichever value; chat honours `separate_reasoning`.
    "stream_reasoning": (True, False), "separate_reasoning": (True, False),
}
_NEUTRAL.update(_SGLANG_NEUTRAL)
# Fields that change nothing cadence does: accepted and ignored. (`reasoning_effort` and
# `verbosity` steer OpenAI's reasoning models; the open ones cadence serves think or not by their
# chat template's variables (`chat_template_kwargs`), and vLLM ignores the two likewise.)
IGNORED_FIELDS: dict[str, type] = {
    "user": str, "metadata": dict, "store": bool, "service_tier": str, "prompt_cache_key": str,
    "safety_identifier": str, "reasoning_effort": str, "verbosity": str}
MAX_PROMPTS = 256  # prompts in one batched completions request
_COMMON = frozenset({"model", "stream", "stream_options", "n", "response_format",
                     "return_tokens_as_token_ids", "return_token_ids", "prompt_logprobs",
                     "truncate_prompt_tokens", "add_special_tokens", "allowed_token_ids", "bad_words",
                     *parsing.SAMPLING_FIELDS, *parsing.LLAMA_PENALTY_FIELDS, *llama_sampling.FIELDS,
                     *guided.FIELDS})
_ALLOWED = {
    False: _COMMON | {"prompt", "suffix", "logprobs", "best_of", "echo", "parallel_tool_calls"},
    True: _COMMON | {"messages", "suffix", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                     "tool_choice", "parallel_tool_calls", "prediction", *parsing.CHAT_FIELDS},
}


@dataclasses.dataclass
class ParsedRequest:
    model: str | None
    prompts: list[str | list[int]] | None  # completions: each prompt, as text or token ids
    messages: list[dict] | None  # chat: content already joined into strings
    params: GenerationParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices returned
    best_of: int = 1  # sequences generated (completions: >= n; the n likeliest are returned)
    echo: bool = False  # completions: the prompt before each choice's text (and its logprobs)
    # The grammar its answer must follow, if any, and the field that asked for it.
    response_format: parsing.GrammarRequest | None = None
    tools: tool_requests.ToolRequest | None = None  # chat: its tools and tool_choice
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:<id>" (vLLM's field)
    template_kwargs: dict[str, Any] | None = None  # chat: more variables for the chat template
    separate_reasoning: bool = True  # chat: split the reasoning out, where the server does
    # Set when the chat is rendered, where the reasoning is split: whether the prompt left a
    # `<think>` open (`server.reasoning.opens_inside`). None: the answer is not split.
    reasoning_inside: bool | None = None
    chat_prompt: str | None = None  # set when the chat is rendered: its prompt text
    # Completions with a `suffix`, and /infill: each prompt is the prefix of a fill-in-the-middle
    # prompt (`checkpoints.fim`).
    hole: fim.Hole | None = None
    chat_end: parsing.ChatEnd = parsing.ChatEnd()  # chat: a new turn, or the final one continued
    # llama-server's endpoints: max_tokens (n_predict) is a cap, which a prompt near the end of
    # the context lowers, rather than a length the context must hold (OpenAI's and vLLM's).
    limit_is_cap: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk its choice's usage
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank, k alternatives
    chat_template: str | None = None  # chat: the request's own template (vLLM's), checked to parse
    # vLLM's return_token_ids: the prompt's token ids and each choice's generated ones go with
    # the answer (streamed: the prompt's in the first chunk, each chunk's own tokens in it).
    token_ids: bool = False
    # OpenAI's Predicted Outputs (chat): text the answer is expected to follow, drafted from in
    # speculative decoding (`GenerationParams.prediction`), never a change to the answer; its
    # ids are set when the chat is tokenized.
    prediction: str | None = None
    prediction_ids: tuple[int, ...] = ()
    truncate: int | None = None  # vLLM's truncate_prompt_tokens: each prompt's last this many
    dry_breakers: tuple[str, ...] = ()  # llama.cpp's DRY's, as text (`llama_sampling.DryBreakers`)
    add_bos: bool | None = None  # vLLM's add_special_tokens (`parsing.add_bos`)
    token_rules: parsing.TokenRules | None = None  # vLLM's allowed_token_ids or bad_words
    # A completion's max_tokens 0 with echo (OpenAI's prompt scoring): the prompt (and its
    # logprobs) alone, each choice's one sampled token hidden (`prompt_alone`).
    prompt_only: bool = False
    llama: llama_fields.Extras = llama_fields.Extras()  # llama-server's progress and timings

    @property
    def parses_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.parses_calls

    def capped(self, params: list[GenerationParams], prompt_len: int, context: int) -> list[GenerationParams]:
        """`params` for a prompt of `prompt_len` tokens: where the limit is a cap
        (`limit_is_cap`) that the context cannot hold, up to the end of the context instead."""
        if not self.limit_is_cap:
            return params
        return [p if p.max_tokens is None or prompt_len + p.max_tokens <= context
                else dataclasses.replace(p, max_tokens=None) for p in params]

    def choice_params(self) -> list[GenerationParams]:
        """Each generated sequence's parameters: its own seed (`parsing.choice_seed`), and
        with best_of > n logprobs computed for the ranking (stripped if not asked for)."""
        logprobs = self.params.logprobs
        if self.best_of > self.n and logprobs is None:
            logprobs = 0
        # The prompt's logprobs are the same for every choice: the first computes them, with
        # as many alternatives as echo's logprobs and prompt_logprobs want.
        wanted = [k for k in (self.params.logprobs if self.echo else None, self.prompt_logprobs)
                  if k is not None]
        return [dataclasses.replace(
                    self.params, logprobs=logprobs,
                    prompt_logprobs=max(wanted) if wanted and i == 0 else None,
                    sampling=dataclasses.replace(self.params.sampling,
                                                 seed=parsing.choice_seed(self.params.sampling.seed, i)))
                for i in range(self.best_of)]


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: `true` is not 1 and `false` is not 0, as they are in Python."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def parse(body: Any, chat: bool, defaults: parsing.SamplingDefaults = OPENAI_DEFAULTS,
          max_n: int = DEFAULT_MAX_N) -> ParsedRequest:
    """A request body (already `client_json.load_json`'d) into a `ParsedRequest`, or `APIError` 400.

    `defaults` are the sampling defaults of the model served (`max_tokens` is the route's);
    `max_n` bounds n and best_of."""
    try:
        return _parse(body, chat, defaults, max_n)
    except SubmissionError as e:
        raise APIError(400, str(e), param=e.param) from None


def known_fields(body: Any, allowed: Collection[str]) -> dict:
    """`body` if it is an object of only `allowed` fields, else SubmissionError. A field given
    as null is not given (OpenAI's reading): an unknown one is let be (clients send their
    newer fields' nulls, as the openai SDK's `web_search_options=None`)."""
    if not isinstance(body, dict):
        raise SubmissionError("the request body must be a JSON object")
    unknown = sorted(name for name, value in body.items() if value is not None and name not in allowed)
    if unknown:
        raise SubmissionError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    return body


def _parse(body: Any, chat: bool, defaults: parsing.SamplingDefaults, max_n: int) -> ParsedRequest:
    known_fields(body, _ALLOWED[chat] | _NEUTRAL.keys() | IGNORED_FIELDS.keys() | llama_fields.FIELDS[chat])
    body, llama = llama_fields.read(body, chat)  # llama-server's spellings, as its clients send them
    for name, kind in IGNORED_FIELDS.items():  # ignored, but only as what they are
        parsing.field(body, name, (kind,))
    for name, neutral in _NEUTRAL.items():  # (a chat's continue_final_message is its own)
        if name not in _ALLOWED[chat] and body.get(name) is not None and not any(_same(body[name], n) for n in neutral):
            raise SubmissionError(f'"{name}" is not supported by cadence (only its neutral value '
                                  f"{', '.join(map(repr, neutral)) or 'null'} is accepted)", name)
    n = parsing.field(body, "n", (int,), 1)
    if not 1 <= n <= max_n:
        raise SubmissionError(f'"n" must be in [1, {max_n}] (the server\'s --max_n), got {n}', "n")
    best_of = parsing.field(body, "best_of", (int,), n)
    if not n <= best_of <= max_n:
        raise SubmissionError(f'"best_of" must be in [n={n}, {max_n}], got {best_of}', "best_of")
    model = parsing.field(body, "model", (str,))
    prompts = messages = None
    prompt_only = not chat and _prompt_only(body)
    if chat:
        messages = parsing.chat_messages(parsing.field(body, "messages", (list,)))
        # max_completion_tokens is OpenAI's newer name; both are checked, max_tokens wins.
        params = parsing.generation_params(body, dataclasses.replace(defaults, max_tokens=None),
                                            max_tokens_fields=("max_tokens", "max_completion_tokens"))
    else:
        prompts = prompts_of(body.get("prompt"))
        if prompt_only:  # its one token is computed and never shown
            body = {**body, "max_tokens": 1}
        params = parsing.generation_params(
            body, dataclasses.replace(defaults, max_tokens=COMPLETION_MAX_TOKENS))
    if any(body.get(name) is not None for name in ("repeat_penalty", "repeat_last_n")):
        # llama-server's names bring its penalties, as its own /v1 counts them: all three
        # over the last repeat_last_n tokens.
        if body.get("repetition_penalty") is not None:
            raise SubmissionError('"repetition_penalty" (vLLM\'s, over the whole sequence) cannot go '
                                  'with llama-server\'s "repeat_penalty" or "repeat_last_n"',
                                  "repetition_penalty")
        params = parsing.llama_penalties(body, params)
    breakers = ()
    if llama_sampling.names_any(body):  # sampled as llama-server's /v1 samples: its order, its samplers
        params, breakers = llama_sampling.with_samplers(body, params)
    stream = parsing.field(body, "stream", (bool,), False)
    params = dataclasses.replace(params, logprobs=_logprobs(body, chat), progress=llama.progress and stream,
                                 max_tokens=None if llama.unlimited else params.max_tokens)
    options = parsing.field(body, "stream_options", (dict,), {})
    include_usage = parsing.field(options, "include_usage", (bool,), False)
    # vLLM's: usage on every chunk too (each choice's tokens so far), with include_usage only.
    continuous = parsing.field(options, "continuous_usage_stats", (bool,), False) and include_usage
    if stream and best_of > n:
        raise SubmissionError('"best_of" > n cannot be streamed (the best are known at the end)', "best_of")
    echo = parsing.field(body, "echo", (bool,), False) and not chat
    suffix = parsing.field(body, "suffix", (str,)) or None  # "": none
    if suffix is not None and chat:
        raise SubmissionError('"suffix" goes with a completion\'s "prompt" (fill in the middle), '
                              "not with a chat", "suffix")
    if suffix is not None and echo:
        raise SubmissionError('"echo" cannot go with "suffix" (the prompt is not the text before '
                              "the answer)", "echo")
    response_format, tools = parsing.structure(body, chat)
    tokens_as_ids = parsing.field(body, "return_tokens_as_token_ids", (bool,), False)
    template_kwargs = parsing.template_kwargs(body) if chat else None
    separate = parsing.field(body, "separate_reasoning", (bool,), True)
    return ParsedRequest(model, prompts, messages, params, stream, include_usage,
                         n, best_of, echo, response_format, tools, tokens_as_ids,
                         template_kwargs, separate,
                         hole=None if suffix is None else fim.Hole(suffix),
                         chat_end=parsing.chat_end(body) if chat else parsing.ChatEnd(),
                         continuous_usage=continuous, prompt_logprobs=_prompt_logprobs(body, stream),
                         chat_template=parsing.request_template(body) if chat else None,
                         token_ids=parsing.field(body, "return_token_ids", (bool,), False),
                         prediction=parsing.prediction(body) if chat else None,
                         truncate=parsing.truncation(body, fill=suffix is not None), dry_breakers=breakers,
                         prompt_only=prompt_only,
                         add_bos=parsing.add_bos(body, fill=suffix is not None),
                         token_rules=parsing.token_rules(body), llama=llama)


def prompts_of(value: Any, name: str = "prompt", most: int = MAX_PROMPTS) -> list[str | list[int]]:
    """Completions' `prompt` (and embeddings' `input`, as `name`): a string, an array of token
    ids, or a batch of at most `most` (an array of strings or of token-id arrays), as OpenAI and
    vLLM take it."""
    if isinstance(value, str) or parsing.token_ids(value):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) or parsing.token_ids(p) for p in value):
        if len(value) > most:
            raise SubmissionError(f'"{name}" holds {len(value)} prompts; at most {most} go in one '
                                  "request", name)
        return value
    raise SubmissionError(f'"{name}" must be a string, an array of token ids, or an array of '
                          "either (a batch)", name)


def _prompt_only(body: dict) -> bool:
    """A completion's `max_tokens: 0`: with echo, the prompt alone; else a 400."""
    if type(body.get("max_tokens")) is not int or body["max_tokens"] != 0:
        return False  # (another type is generation_params' 400)
    if body.get("echo") is not True:
        raise SubmissionError('"max_tokens": 0 needs "echo": true (it returns the prompt alone, '
                              'with its logprobs where asked)', "max_tokens")
    return True


def prompt_alone(record: RequestRecord) -> RequestRecord:
    """A `prompt_only` completion's record as its answer shows it: nothing generated, cut at
    its limit."""
    return dataclasses.replace(record, text="", output_tokens=0, finish_reason="length", stop_reason=None,
                               output_ids=[], logprobs=None if record.logprobs is None else [])


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the request wants, or None for no logprobs: chat's
    `logprobs: true` with `top_logprobs: k` (default 0), completions' `logprobs: k`. The upper
    bound is the server's `--max_logprobs` (the scheduler's check)."""
    if chat:
        wanted = parsing.field(body, "logprobs", (bool,), False)
        k = parsing.field(body, "top_logprobs", (int,))
        if k and not wanted:
            raise SubmissionError('"top_logprobs" needs "logprobs": true', "top_logprobs")
        name = "top_logprobs"
    else:
        k = parsing.field(body, "logprobs", (int,))
        wanted, name = k is not None, "logprobs"
    if not wanted:
        return None
    k = k or 0
    if k < 0:
        raise SubmissionError(f'"{name}" must be >= 0, got {k}', name)
    return k


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    """vLLM's `prompt_logprobs`: k >= 0 alternatives per prompt token (the upper bound is the
    server's `--max_logprobs`, the scheduler's check); not with a stream, as in vLLM."""
    k = parsing.field(body, "prompt_logprobs", (int,))
    if k is None:
        return None
    if k == -1:
        raise SubmissionError('"prompt_logprobs": -1 (the whole vocabulary) is not served; ask for '
                              "at most the server's --max_logprobs", "prompt_logprobs")
    if k < 0:
        raise SubmissionError(f'"prompt_logprobs" must be >= 0, got {k}', "prompt_logprobs")
    if stream:
        raise SubmissionError('"prompt_logprobs" are not available with "stream": true; they come '
                              "whole, in the answer", "prompt_logprobs")
    return k


def usage(groups: Sequence[Sequence[RequestRecord]], reasoning_tokens: int | None = None) -> dict[str, Any]:
    """One request's usage over the records of each of its prompts' sequences: each prompt
    counted once (its first sequence's, which prefilled it), every sequence's tokens; with
    `reasoning_tokens` (where the reasoning is split), or a prediction, OpenAI's
    `completion_tokens_details` (a prediction's drafts the model wrote, and those it did not)."""
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(r.output_tokens for g in groups for r in g)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(g[0].cached_tokens for g in groups)},
    }
    details: dict[str, int] = {}
    if reasoning_tokens is not None:
        details["reasoning_tokens"] = reasoning_tokens
    predicted = [r.prediction_tokens for g in groups for r in g if r.prediction_tokens is not None]
    if predicted:  # Predicted Outputs: the prediction's drafts, accepted and rejected
        details["accepted_prediction_tokens"] = sum(a for a, _ in predicted)
        details["rejected_prediction_tokens"] = sum(r for _, r in predicted)
    if details:
        out["completion_tokens_details"] = details
    return out


MAX_REQUEST_ID = 256  # characters of a client's X-Request-Id


def request_id(headers: Mapping[str, str], prefix: str) -> str:
    """A request's id: the client's X-Request-Id, else a new one starting with `prefix`."""
    given = headers.get("x-request-id") or f"{prefix}-{uuid.uuid4().hex}"
    if len(given) > MAX_REQUEST_ID:
        raise APIError(400, f"X-Request-Id is longer than {MAX_REQUEST_ID} characters")
    return given


@contextlib.contextmanager
def submission_errors(prompt: str = "prompt", length: str = "max_tokens") -> Iterator[None]:
    """Submitting to the scheduler, with its refusals as the API's errors: 400 for what the
    request got wrong (too long for the context, bad parameters, untokenizable text), 429 when
    the queue or a latency target is full, 503 when the engine is dead or shutting down. The
    request's field for the prompt is `prompt` (what a refusal naming "prompt" names), and
    `length` the one to change when it is too long (where the refusal names none)."""
    try:
        yield
    except SubmissionError as e:
        param = prompt if e.param == "prompt" else e.param
        if isinstance(e, RequestTooLong):
            raise APIError(400, str(e), param=param or length, code="context_length_exceeded") from None
        raise APIError(400, str(e), param=param) from None
    except TokenizerError as e:
        raise APIError(400, str(e)) from None
    except Overloaded as e:
        raise APIError(429, str(e), type="rate_limit_error",
                       headers={"Retry-After": str(e.retry_after)}) from None
    except EngineDead as e:
        raise APIError(503, str(e), type="service_unavailable", code="engine_dead") from None
    except NotRunning as e:
        raise APIError(503, str(e), type="service_unavailable") from None


async def cancel_on_disconnect(request: Any, streams: Sequence[RequestStream]) -> None:
    """Cancels `streams` if the client of `request` (a Starlette Request) hangs up before they
    end; run it as a task beside them, cancelled when they are done."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for stream in streams:
        stream.cancel()


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """One choice's usage in the middle of its stream (vLLM's continuous usage stats)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(record: RequestRecord, calls: bool = False) -> str:
    """OpenAI's finish reason: "length" when cut off, else "tool_calls" for an answer with
    calls, else "stop". (Aborted or failed requests never reach a client as a normal answer.)"""
    if record.finish_reason == "length":
        return "length"
    return "tool_calls" if calls else "stop"


class LogprobFormat:
    """A request's `TokenLogprob`s in OpenAI's shapes, in order (a stream's chunks one after
    another, or a whole answer at once):

        chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
                     "logprob", "bytes"}]}], "refusal": null}
        completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
                     "text_offset"}  (offsets into the completion's text, counted across calls)

    A sampled token's "token" is the text it added to the output (`TokenLogprob.text`), so the
    tokens spell the content exactly; "bytes" are its own bytes in the vocabulary, so a
    character split across tokens is in their bytes. An alternative's text is its bytes decoded
    alone (U+FFFD for a partial character). With `as_ids` (a request's
    `return_tokens_as_token_ids`, vLLM's), every token and alternative is named "token_id:<id>"
    instead, which tells apart ids whose texts are the same; offsets still count the text."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, as_ids: bool = False):
        self._tokenizer, self._chat, self._as_ids, self._offset = tokenizer, chat, as_ids, 0

    def _alone(self, token_id: int) -> str:
        """A token's text decoded alone (U+FFFD for a partial character)."""
        return self._tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")

    def _alternative(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self._as_ids else self._alone(token_id)

    def _sampled(self, entry: TokenLogprob) -> str:
        return f"token_id:{entry.token_id}" if self._as_ids else entry.text

    def prompt(self, echo: Echo, entries: list[TokenLogprob | None] | None, k: int) -> dict:
        """Completions' echo: the prompt's tokens, with their logprobs and `k` alternatives
        (the first has none: null), in the same shape and offsets as the output's."""
        entries = entries or [None] * len(echo.ids)
        return self([TokenLogprob(t, None if e is None else e.logprob, text, None if e is None else e.top[:k])
                     for t, e, text in zip(echo.ids, entries, echo.texts)])

    def ranked(self, entries: list[TokenLogprob | None], k: int) -> list[dict[str, dict] | None]:
        """vLLM's `prompt_logprobs`: per prompt token (the first: null), its own id's and its `k`
        likeliest alternatives' {"logprob", "rank", "decoded_token"} by id (a JSON key: the id
        as a string), its own first; an alternative's rank is its place in the list, which for
        the prompt token itself, where it is one, differs from its count only in ties. The
        decoded token is its text alone, with or without `as_ids` (as vLLM's)."""
        def entry(token_id: int, logprob: float, rank: int) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": self._alone(token_id)}

        out: list[dict[str, dict] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            ranked = {str(e.token_id): entry(e.token_id, e.logprob, e.rank)}
            for rank, (t, v) in enumerate(e.top[:k], 1):
                ranked[str(t)] = entry(t, v, rank)
            out.append(ranked)
        return out

    def __call__(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        raw = self._tokenizer.token_bytes
        if self._chat:
            return {"content": [
                {"token": self._sampled(e), "logprob": e.logprob, "bytes": list(raw(e.token_id)),
                 "top_logprobs": [{"token": self._alternative(t), "logprob": v, "bytes": list(raw(t))}
                                  for t, v in e.top]}
                for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(self._offset)
            self._offset += len(e.text)
        return {"tokens": [self._sampled(e) for e in entries],
                "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [None if e.top is None else {self._alternative(t): v for t, v in e.top}
                                 for e in entries],
                "text_offset": offsets}


def chunk(request_id: str, model: str, chat: bool, text: str | None, reason: str | None,
          created: int, first: bool = False, logprobs: dict | None = None,
          index: int = 0, tool_calls: list[dict] | None = None,
          reasoning: str | None = None, stop_reason: str | int | None = None,
          token_ids: list[int] | None = None, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """One streamed chunk of choice `index`. `token_ids`: the tokens it carries, and
    `prompt_ids` the prompt's, in its first chunk (vLLM's return_token_ids: a chat's at the
    chunk's top, a completion's in its choice)."""
    if chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        kind = "text_completion"
    if reason is not None:
        choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out = {"id": request_id, "object": kind, "created": created, "model": model, "choices": [choice]}
    if prompt_ids is not None:
        (out if chat else choice)["prompt_token_ids"] = prompt_ids
    return out


# json.dumps(..., ensure_ascii=False) builds an encoder per call; these are what it builds.
_ENCODE = json.JSONEncoder(ensure_ascii=False).encode
_ENCODE_STRING = json.encoder.encode_basestring  # a str's JSON, as _ENCODE gives it (C)


def frame(obj: dict) -> str:
    """One Server-Sent Event carrying `obj` as JSON."""
    return f"data: {_ENCODE(obj)}\n\n"


class TextFrames:
    """The SSE frames of one stream's text chunks, `frame(chunk(..., text, None, ...))` exactly
    (with `reasoning`, a chat's `frame(chunk(..., None, ..., reasoning=text))`): everything but
    the text is serialized once per stream, so a token costs one string escape (this runs for
    every token of every stream, on the event loop)."""

    _MARK = "\x00cadence text\x00"

    def __init__(self, request_id: str, model: str, chat: bool, created: int, index: int = 0,
                 reasoning: bool = False):
        whole = frame(chunk(request_id, model, chat, None if reasoning else self._MARK, None, created,
                            index=index, reasoning=self._MARK if reasoning else None))
        self._head, self._tail = whole.split(_ENCODE_STRING(self._MARK))

    def __call__(self, text: str) -> str:
        return self._head + _ENCODE_STRING(text) + self._tail


def assistant_calls(content: str | None, calls: Sequence[ToolCall]) -> dict[str, Any]:
    """An assistant message that calls tools (OpenAI's shape)."""
    return {"role": "assistant", "content": content, "tool_calls": [c.message() for c in calls]}


def usage_chunk(request_id: str, model: str, chat: bool, groups: Sequence[Sequence[RequestRecord]],
                created: int, reasoning_tokens: int | None = None) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": [],
            "usage": usage(groups, reasoning_tokens)}


def best(records: Sequence[RequestRecord], n: int) -> list[RequestRecord]:
    """best_of: the `n` sequences of highest cumulative logprob (vLLM's ranking), in the order
    they were generated. Every record must carry logprobs (`ParsedRequest.choice_params`)."""
    if len(records) == n:
        return list(records)
    ranked = sorted(range(len(records)), key=lambda i: -sum(e.logprob for e in records[i].logprobs))
    return [records[i] for i in sorted(ranked[:n])]


@dataclasses.dataclass(frozen=True)
class Echo:
    """A completion's prompt as echo returns it, spelled once per request: its ids, what each
    adds to the text as the detokenizer streams it (special tokens add nothing), the text."""

    ids: Sequence[int]
    texts: list[str]

    @classmethod
    def of(cls, tokenizer: Tokenizer, ids: Sequence[int]) -> Echo:
        detok = IncrementalDetokenizer(tokenizer)
        texts = [detok.add(t) for t in ids]
        texts[-1] += detok.flush()
        return cls(ids, texts)

    @property
    def text(self) -> str:
        return "".join(self.texts)


def merge_logprobs(first: dict, second: dict) -> dict:
    """Two completions logprobs objects, one after the other (echo: the prompt's, the output's)."""
    return {key: first[key] + second[key] for key in first}


@dataclasses.dataclass(frozen=True)
class Answer:
    """What one prompt of a request returns: its choices' records (best_of's best, in the
    order they were generated), every sequence generated for it (usage counts them all; the
    first computed the prompt's logprobs), and with echo its prompt."""

    records: Sequence[RequestRecord]
    generated: Sequence[RequestRecord]
    echo: Echo | None = None
    prompt_ids: Sequence[int] = ()  # for `full_response`'s `token_ids`


def full_response(request_id: str, model: str, chat: bool, answers: Sequence[Answer],
                  tokenizer: Tokenizer | None = None, logprobs: int | None = None,
                  tools: tool_requests.ToolRequest | None = None,
                  tokens_as_ids: bool = False, reasoning_inside: bool | None = None,
                  reasoning_tokens: int | None = None, prompt_logprobs: int | None = None,
                  token_ids: bool = False) -> dict[str, Any]:
    """The whole answer: a choice per record, the answers' (prompts') one after another,
    indexed across them (OpenAI's order for a batch: prompt by prompt, then choice). `tokenizer`
    spells their logprobs, if they have any and the request asked for `logprobs` alternatives
    (None: computed for best_of's ranking only, if at all). With echo, an answer's prompt text
    goes before each of its choices' (and with logprobs its tokens'). With `prompt_logprobs`
    (vLLM's), its prompt's ranked logprobs go in each of its choices (completions) or once in
    the response (chat). With `tools` (chat) whose calls are parsed, a choice's calls are its
    message's `tool_calls`, in the format of `tokenizer`'s template. `tokens_as_ids`: `LogprobFormat`'s `as_ids`. `reasoning_inside`
    (chat; None: not split): a choice's reasoning is split out of its text first
    (`server.reasoning`), its message's `reasoning_content`; the tools parse the rest.
    `reasoning_tokens`: usage's, over every sequence generated. `token_ids` (vLLM's
    return_token_ids): each choice's generated `token_ids`, and its prompt's
    `prompt_token_ids` in each choice (completions) or once in the response (chat)."""
    created = int(time.time())
    choices = []
    ranked = None
    for answer in answers:
        echo = answer.echo
        scored = next((r.prompt_logprobs for r in answer.generated if r.prompt_logprobs), None)
        if prompt_logprobs is not None:
            ranked = LogprobFormat(tokenizer, chat, tokens_as_ids).ranked(scored, prompt_logprobs)
        for record in answer.records:
            lp = None
            if logprobs is not None and record.logprobs is not None:
                spell = LogprobFormat(tokenizer, chat, tokens_as_ids)
                head = spell.prompt(echo, scored, logprobs) if echo else None
                lp = spell(record.logprobs)
                lp = merge_logprobs(head, lp) if head else lp
            if echo:
                record = dataclasses.replace(record, text=echo.text + record.text)
            index = len(choices)
            if chat:
                thought, text = (None, record.text) if reasoning_inside is None else (
                    split_reasoning(record.text, reasoning_inside))
                choice = {"index": index, "message": {"role": "assistant", "content": text},
                          "finish_reason": finish_reason(record), "logprobs": lp}
                if tools is not None and tools.parses_calls:
                    content, calls = tool_requests.call_style(tokenizer).parse(text, tools.names)
                    if calls:
                        choice["message"] = assistant_calls(content, calls)
                        choice["finish_reason"] = finish_reason(record, calls=True)
                if reasoning_inside is not None:
                    choice["message"]["reasoning_content"] = thought
            else:
                choice = {"index": index, "text": record.text, "finish_reason": finish_reason(record),
                          "logprobs": lp}
                if ranked is not None:
                    choice["prompt_logprobs"] = ranked
                if token_ids:
                    choice["prompt_token_ids"] = list(answer.prompt_ids)
            if token_ids:
                choice["token_ids"] = list(record.output_ids)
            choice["stop_reason"] = record.stop_reason  # vLLM's: the stop string or token id that ended it
            choices.append(choice)
    kind = "chat.completion" if chat else "text_completion"
    response = {"id": request_id, "object": kind, "created": created, "model": model,
                "choices": choices, "usage": usage([a.generated for a in answers], reasoning_tokens)}
    if chat and ranked is not None:
        response["prompt_logprobs"] = ranked
    if chat and token_ids:
        response["prompt_token_ids"] = list(answers[0].prompt_ids)
    return response
