"""A command-line door's entry, whole: `cadence-generate`'s prompts and `cadence-batch`'s own
lines, parsed (`server.parsing`), rendered, tokenized and their grammar compiled on the
calling thread.

    ids, params, tools, inside = to_request(entry, tokenizer, defaults)   # SubmissionError if invalid
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from cadence.checkpoints.tokenizer import Tokenizer
from cadence.scheduler.errors import SubmissionError
from cadence.scheduler.grammar import Grammar, GrammarCompiler, GrammarError
from cadence.scheduler.request import GenerationParams
from cadence.server.client_json import check_json_value
from cadence.server.parsing import (CHAT_FIELDS, SAMPLING_FIELDS, STRUCTURE_FIELDS, GrammarRequest, SamplingDefaults,
                                    chat_end, check_chat_fields, embedding_ids, field, generation_params,
                                    grammar_request, prompt_ids, render_chat, request_template, structure,
                                    template_kwargs, token_ids)
from cadence.server.reasoning import answer_spec, opens_inside
from cadence.server.tool_requests import ToolRequest, call_style


def grammar_of(fmt: GrammarRequest | None, tools: ToolRequest | None, tokenizer: Tokenizer,
               grammars: GrammarCompiler | None, thinking_prompt: str | None = None) -> Grammar | None:
    """`grammar_request`'s grammar, compiled on this thread; a GrammarError names the field at
    fault. (The HTTP server awaits `GrammarCompiler.compile_async` instead.) With a
    `thinking_prompt` (a thinking model's rendered chat), after its reasoning
    (`reasoning.answer_spec`)."""
    wanted = grammar_request(fmt, tools, tokenizer, grammars)
    if wanted is None:
        return None
    spec = wanted.spec if thinking_prompt is None else answer_spec(wanted.spec, thinking_prompt)
    try:
        return grammars.compile(spec)
    except GrammarError as e:
        raise GrammarError(str(e), wanted.param) from None


def _embedding_entry(entry: dict, tokenizer: Tokenizer, pooling: str, extra_fields: tuple[str, ...],
                     max_seq_len: int | None) -> EntryRequest:
    known = ("input", "priority", *extra_fields)
    unknown = sorted(set(entry) - set(known))
    if unknown:
        raise SubmissionError(f"an embedding's entry (input) takes only {', '.join(known)}; got "
                              f"{', '.join(map(repr, unknown))}", unknown[0])
    text = entry["input"]
    if not ((isinstance(text, str) and text) or token_ids(text)):
        raise SubmissionError('"input" must be a non-empty string or array of token ids', "input")
    ids = embedding_ids(text, tokenizer, max_seq_len)
    return EntryRequest(ids, GenerationParams(pooling=pooling, priority=field(entry, "priority", (int,))), None)


class EntryRequest(NamedTuple):
    """A command-line door's entry, ready to submit."""

    ids: list[int]
    params: GenerationParams
    tools: ToolRequest | None  # a chat's tools, whose calls its answer is parsed for
    # A chat's reasoning split (`server.reasoning`): whether its prompt left <think> open; None:
    # not split (not a chat, or not asked).
    reasoning_inside: bool | None = None


def to_request(
    entry: Any,
    tokenizer: Tokenizer,
    defaults: SamplingDefaults = SamplingDefaults(),
    *,
    chat: bool = False,
    extra_fields: tuple[str, ...] = (),
    max_seq_len: int | None = None,
    grammars: GrammarCompiler | None = None,
    splits_reasoning: bool = False,
    pooling: str | None = None,
) -> EntryRequest:
    """Tokenized prompt, generation parameters and tools of one entry; `SubmissionError` if
    invalid.

    An entry has exactly one of "prompt" (a string) or "messages" (a chat, rendered with the
    model's chat template), and optionally the fields in `SAMPLING_FIELDS` and in
    `STRUCTURE_FIELDS` (OpenAI's response_format, and a chat's tools; their grammar compiled
    by `grammars`). `chat` wraps a plain "prompt" as one user message. `extra_fields` are keys
    the caller handles itself (such as a batch job's "id"). A chat may carry
    "chat_template_kwargs" (`template_kwargs`); with `splits_reasoning`, its answer's reasoning
    is to be split out (`EntryRequest.reasoning_inside`). With `max_seq_len`, a prompt that
    cannot fit is refused before it is tokenized. Context-length checks on the tokens are the
    scheduler's (`RequestTooLong`).

    With `pooling` (a door that embeds), an entry may instead have "input" (a string, or token
    ids) and "priority": an embedding of that input, pooled so.
    """
    if not isinstance(entry, dict):
        raise SubmissionError(f"a request must be a JSON object, got {type(entry).__name__}")
    check_json_value(entry)
    if pooling is not None and "input" in entry:
        return _embedding_entry(entry, tokenizer, pooling, extra_fields, max_seq_len)
    known = ("prompt", "messages", *CHAT_FIELDS, *SAMPLING_FIELDS, *STRUCTURE_FIELDS, *extra_fields)
    unknown = sorted(set(entry) - set(known))
    if unknown:
        raise SubmissionError(f"unknown field(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(known)}")
    if ("prompt" in entry) == ("messages" in entry):
        raise SubmissionError('a request needs exactly one of "prompt" or "messages"')
    params = generation_params(entry, defaults)
    is_chat = chat or "messages" in entry
    fmt, tools = structure(entry, is_chat)
    check_chat_fields(entry, is_chat)
    variables, template = template_kwargs(entry), request_template(entry)
    if "messages" in entry:
        text = render_chat(entry["messages"], tokenizer, tools, variables, chat_end(entry), template)
    else:
        text = field(entry, "prompt", (str,))
        if text is None:
            raise SubmissionError('"prompt" must be a string', "prompt")
        if chat:
            text = render_chat([{"role": "user", "content": text}], tokenizer, tools, variables,
                               chat_end(entry), template)
    ids = prompt_ids(text, tokenizer, max_seq_len)
    thinks = is_chat and splits_reasoning
    grammar = grammar_of(fmt, tools, tokenizer, grammars, text if thinks else None)
    parses = tools is not None and tools.parses_calls
    params = dataclasses.replace(params, grammar=grammar,
                                 shown_specials=call_style(tokenizer).shown if parses else ())
    return EntryRequest(ids, params, tools if parses else None,
                        opens_inside(text) if thinks else None)
