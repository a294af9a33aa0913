"""An answer's text, token by token, split into the parts that typed APIs show apart: a thinking
model's reasoning, the text, and tool calls. OpenAI's Responses API (`responses_api.Output`)
and Anthropic's Messages API (`messages_api.Blocks`) build their output items and content blocks
on it:

    class Blocks(AnswerParts):
        def on_reasoning(self, text): ...   # reasoning text, as it comes
        def on_content(self, text): ...     # answer text, as it comes (not the calls' text)
        def on_call(self, entry): ...       # a call's header or arguments fragment, as it comes
                                            # (a `ToolCallParser` delta entry)
        def on_abandoned(self, index): ...  # a call whose header went out turned out no call:
                                            # its text comes again as content
        def on_call_done(self, call): ...   # a call that stands (its arguments closed and parse)

    blocks = Blocks(parser, thinker)        # ToolCallParser or None, ReasoningParser or None
    blocks = Blocks.of(parsed, call_style)  # ... as a parsed chat request asks
    blocks.feed(text, logprobs)             # each step's text (and its tokens' logprobs, if asked)
    blocks.finish_parts()                   # at the end: what the parsers held back
    record = await blocks.collect(server, request, stream)   # a whole answer fed, not streamed

The reasoning goes first through the `ReasoningParser` (where the request splits it), the rest
through the `ToolCallParser` (where the request parses calls). Every hook is a no-op here; a
subclass takes the ones it shows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request

from cadence.scheduler.request import RequestRecord, TokenLogprob
from cadence.scheduler.stream import RequestStream
from cadence.server.api_error import APIError
from cadence.server.reasoning import ReasoningParser
from cadence.server.tool_call_parser import Delta, ToolCall, ToolCallParser
from cadence.server.tool_requests import CallStyle

if TYPE_CHECKING:
    from cadence.server.app import Server
    from cadence.server.protocol import ParsedRequest


class AnswerParts:
    def __init__(self, parser: ToolCallParser | None, thinker: ReasoningParser | None = None):
        self.parser, self.thinker = parser, thinker
        self._abandoned = 0  # of the parser's abandoned calls, those passed on
        self._done = 0  # of the parser's calls, those passed on

    @classmethod
    def of(cls, parsed: ParsedRequest, call_style: CallStyle):
        """As a parsed chat request asks: its calls parsed where it parses them (in the model's
        `call_style`), its reasoning split where the server splits it (once it is rendered)."""
        inside = parsed.reasoning_inside
        return cls(call_style.parser(parsed.tools.names) if parsed.parses_tool_calls else None,
                   None if inside is None else ReasoningParser(inside))

    async def collect(self, server: Server, request: Request, stream: RequestStream) -> RequestRecord:
        """The whole answer fed (a client that hangs up meanwhile cancels it); a 500 if it failed."""
        record, = await server.collect(request, [stream],
                                       lambda _, event: self.feed(event.text, event.logprobs))
        if record.finish_reason == "error":
            raise APIError(500, f"generation failed: {record.error}", type="server_error")
        return record

    def feed(self, text: str, logprobs: list[TokenLogprob] | None = None) -> None:
        """One step's text, and its tokens' logprobs where the request asked for them (the
        base takes no logprobs: a subclass that shows them overrides this)."""
        if self.thinker is not None:
            split = self.thinker.feed(text)
            self.on_reasoning(split.reasoning)
            text = split.content
        self._answer(text)

    def finish_parts(self) -> None:
        """The end of the answer: what the parsers held back goes out."""
        if self.thinker is not None:
            split = self.thinker.finish()
            self.on_reasoning(split.reasoning)
            self._answer(split.content)
        if self.parser is not None:
            self._parsed(self.parser.finish())

    @property
    def reasoning_tokens(self) -> int:
        """The tokens through the end of the reasoning, where there was reasoning."""
        return 0 if self.thinker is None else self.thinker.reasoning_pieces

    def _answer(self, text: str) -> None:
        if self.parser is None:
            self.on_content(text)
        else:
            self._parsed(self.parser.feed(text))

    def _parsed(self, delta: Delta) -> None:
        parser = self.parser
        for index in parser.abandoned[self._abandoned:]:
            self.on_abandoned(index)
        self._abandoned = len(parser.abandoned)
        self.on_content(delta.content)
        for entry in delta.tool_calls:
            self.on_call(entry)
        for call in parser.calls[self._done:]:
            self.on_call_done(call)
        self._done = len(parser.calls)

    # -- the hooks ----------------------------------------------------------------------------

    def on_reasoning(self, text: str) -> None:
        pass

    def on_content(self, text: str) -> None:
        pass

    def on_call(self, entry: dict) -> None:
        pass

    def on_abandoned(self, index: int) -> None:
        pass

    def on_call_done(self, call: ToolCall) -> None:
        pass
