"""The OpenAI endpoints' streamed answers: a completion's or a chat's streams, as Server-Sent
Events in OpenAI's chunk shapes (`protocol`'s), for `app.Server.generate`:

    frames = sse_frames(server, parsed, groups, request_id, chat, echoes)   # AsyncIterator[str]
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from cadence.scheduler.request import PromptProgress, RequestRecord, TokenEvent
from cadence.scheduler.stream import RequestStream, merged
from cadence.server import llama_fields, protocol, reasoning
from cadence.server.api_error import APIError
from cadence.server.protocol import Echo, ParsedRequest
from cadence.server.tool_call_parser import Delta

if TYPE_CHECKING:
    from cadence.server.app import Server


async def sse_frames(server: Server, parsed: ParsedRequest, groups: list[list[RequestStream]],
                     request_id: str, chat: bool, echoes: list[Echo | None]) -> AsyncIterator[str]:
    """A parsed completion's or chat's streams (`Server.submit`'s groups, one per prompt;
    `echoes`: each prompt's, with echo) as SSE frames, each choice's chunks under its index
    (prompt by prompt, then choice: streamed requests have no best_of, so stream i is choice
    i). Every event waiting when the loop gets to this request goes out in one write: when the
    loop runs behind the scheduler (many streams, a fast device), tokens are coalesced instead
    of each paying for a send. One choice failing ends the response with the error. With an
    echo (completions), each choice's first chunk is its prompt (and with `prompt_only`, its
    only one but the end). As the request asks:
    - tools (chat, calls parsed): each choice's text goes through its `ToolCallParser`:
      content as content, calls as `tool_calls` deltas, and "tool_calls" as the finish reason
      of an answer with calls that was not cut off;
    - `tokens_as_ids`: logprobs name tokens by id;
    - `reasoning_inside` (chat; None: not split): each choice's text goes first through a
      `ReasoningParser`, its reasoning streamed as `reasoning_content`, the rest as content;
    - `continuous_usage`: every chunk carries its choice's usage so far (vLLM's);
    - `token_ids` (vLLM's return_token_ids): every token's chunk goes out carrying its ids,
      and the prompt's ids go in the response's first chunk (chat) or each choice's
      (completions);
    - `model`: names its chunks' model (an adapter's, where it is one);
    - llama-server's (`parsed.llama`, `llama_fields`): before each choice's first token, chunks
      with its `prompt_progress`; its `timings` in each choice's last chunk, or in every one."""
    tools = parsed.tools if parsed.parses_tool_calls else None
    include_usage, tokens_as_ids, continuous = parsed.include_usage, parsed.tokens_as_ids, parsed.continuous_usage
    reasoning_inside, token_ids, model = parsed.reasoning_inside, parsed.token_ids, parsed.model
    llama = parsed.llama
    created, name = int(time.time()), server.models.answer(model)
    streams = [s for group in groups for s in group]
    # Each stream's prompt: its echo, and the stream that computes the prompt's logprobs.
    echo_of = [echo for echo, group in zip(echoes, groups) for _ in group]
    head_of = [group[0] for group in groups for _ in group]
    first = [True] * len(streams)
    text_frames = [protocol.TextFrames(request_id, name, chat, created, i) for i in range(len(streams))]
    thinkers = [None if reasoning_inside is None else reasoning.ReasoningParser(reasoning_inside)
                for _ in streams]
    thought_frames = [protocol.TextFrames(request_id, name, chat, created, i, reasoning=True)
                      if thinker else None for i, thinker in enumerate(thinkers)]
    logprobs = [protocol.LogprobFormat(server.tokenizer, chat, tokens_as_ids) for _ in streams]
    parsers = [server.call_style.parser(tools.names) if tools else None for _ in streams]
    records: list[RequestRecord | None] = [None] * len(streams)
    counted = [0] * len(streams)  # each choice's tokens so far
    # Whose prompt ids are still to go out (return_token_ids): a chat's once, with whichever
    # choice's chunk goes first; a completion's in each choice's first chunk.
    prompt_due = set(range(1 if chat else len(streams))) if token_ids else set()

    def prompt_of(i: int) -> list[int] | None:
        due = 0 if chat else i
        if due not in prompt_due:
            return None
        prompt_due.discard(due)
        return list(streams[i].request.prompt_ids)

    def framed(i: int, chunk: dict) -> None:  # with continuous usage, its choice's so far
        if continuous:
            chunk["usage"] = protocol.usage_so_far(streams[i].request.prompt_len, counted[i])
        if llama.each and "timings" not in chunk:
            chunk["timings"] = llama_fields.timings_so_far(streams[i].request, counted[i], time.monotonic())
        frames.append(protocol.frame(chunk))

    def emit(i: int, thought: str, text: str, lp: dict | None = None, always: bool = False,
             delta: Delta | None = None, ids: list[int] | None = None) -> None:
        """Choice i's reasoning and answer text (the answer through its tool-call parser, or
        that parser's `delta` as given), as chunks: plain text frames where nothing else
        goes with them, else one chunk (a chat's first, one with logprobs (`always`: sent
        even empty), or one with calls). At the end nothing empty is sent."""
        calls = None
        if delta is None and parsers[i] is not None:
            delta = parsers[i].feed(text)
        if delta is not None:
            text, calls = delta.content, delta.tool_calls
        whole = always or calls or (chat and first[i] and (records[i] is None or text or thought))
        if whole or ((continuous or llama.each) and (text or thought)):  # (usage, timings: a whole chunk)
            framed(i, protocol.chunk(
                request_id, name, chat, text if text or not thought else None, None, created,
                first[i], lp, i, calls, reasoning=thought or None, token_ids=ids,
                prompt_ids=prompt_of(i)))
            first[i] = False
            return
        if thought:
            frames.append(thought_frames[i](thought))
        if text:
            frames.append(text_frames[i](text))

    try:
        async for batch in merged(streams):
            frames = []
            for i, event in batch:
                echo = echo_of[i]
                if echo is not None and first[i]:
                    lp = (logprobs[i].prompt(echo, head_of[i].request.prompt_logprobs,
                                             streams[i].request.params.logprobs)
                          if streams[i].request.logprobs is not None else None)
                    framed(i, protocol.chunk(request_id, name, chat, echo.text, None, created,
                                             logprobs=lp, index=i, prompt_ids=prompt_of(i)))
                    first[i] = False
                if isinstance(event, PromptProgress):
                    framed(i, {**protocol.chunk(request_id, name, chat, None, None, created, True, index=i),
                               "prompt_progress": llama_fields.progress(event)})
                    continue
                if isinstance(event, TokenEvent) and parsed.prompt_only:
                    continue  # (its one token, hidden)
                if isinstance(event, TokenEvent):
                    counted[i] += len(event.token_ids)
                    thought, text = "", event.text
                    if thinkers[i] is not None:
                        thought, text = thinkers[i].feed(text)
                    lp = None if event.logprobs is None else logprobs[i](event.logprobs)
                    # with logprobs or token ids, every token's chunk goes out, text or not
                    emit(i, thought, text, lp, always=event.logprobs is not None or token_ids,
                         ids=list(event.token_ids) if token_ids else None)
                    continue
                if parsed.prompt_only and event.finish_reason != "error":
                    event = protocol.prompt_alone(event)
                records[i] = event
                called = False
                if event.finish_reason != "error":  # what the parsers held back, at the end
                    if thinkers[i] is not None:
                        emit(i, *thinkers[i].finish())
                    if parsers[i] is not None:
                        emit(i, "", "", delta=parsers[i].finish())
                        called = bool(parsers[i].calls)
                reason = protocol.finish_reason(event, called)
                if event.finish_reason == "error":
                    error = APIError(500, f"generation failed: {event.error}", type="server_error")
                    frames.append(protocol.frame(error.body()) + "data: [DONE]\n\n")
                    break
                counted[i] = event.output_tokens
                last = protocol.chunk(request_id, name, chat, None if chat else "", reason, created,
                                      index=i, stop_reason=event.stop_reason)
                if llama.timings:
                    last["timings"] = llama_fields.timings(event, event.output_tokens)
                framed(i, last)
                if all(r is not None for r in records):
                    if include_usage:
                        done = iter(records)
                        frames.append(protocol.frame(protocol.usage_chunk(
                            request_id, name, chat, [[next(done) for _ in g] for g in groups],
                            created, None if reasoning_inside is None else
                            sum(t.reasoning_pieces for t in thinkers))))
                    frames.append("data: [DONE]\n\n")
            if frames:
                yield "".join(frames)
            if any(r is not None and r.finish_reason == "error" for r in records):
                break
    finally:
        for stream in streams:
            if stream.record is None:  # the client went away mid-stream, or a choice failed
                stream.cancel()
