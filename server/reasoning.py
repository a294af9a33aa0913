"""A reasoning model's thinking, split from its answer: `reasoning_content` beside `content`.

    parser = ReasoningParser(opens_inside(prompt_text))
    split = parser.feed(piece)     # for each piece of text as it is generated: Split(reasoning,
                                   # content), the chat API's `delta.reasoning_content` / `.content`
    split = parser.finish()        # at the end: whatever was held back

    reasoning, content = split_reasoning(text, inside)   # a whole answer, by the same code

Models that think (Qwen3, DeepSeek-R1 and its distillations, SmolLM3) write their reasoning
between `<think>` and `</think>`, then the answer. Their chat templates either leave the tag for
the model to write (Qwen3 with thinking on) or put `<think>` at the end of the prompt, so that the
output starts inside the reasoning and only closes it (DeepSeek-R1, Qwen3's "Thinking-2507"
models); with thinking off, Qwen3's template writes an empty `<think></think>` into the prompt and
the output is all answer. `opens_inside(prompt)` tells these apart from the rendered prompt: the
output starts inside the reasoning where the prompt ends with `<think>` (and whitespace), what
such a template adds after the conversation; a `<think>` a message mentions is not an opening.
A response format or a forced tool call (a grammar) then applies to the answer, after the
reasoning, which stays free (`answer_spec`: `scheduler.grammar.Thinking`), as vLLM's
reasoning-aware structured output does; where the prompt closed the reasoning (thinking off),
from the first token.

Contract:
- Outside: the output is answer, unless (after whitespace) it opens with `<think>`; then the
  reasoning runs to the first `</think>`, and everything after it is answer, `<think>` or not.
  Inside: the reasoning runs to the first `</think>`. An output cut off before `</think>` is all
  reasoning.
- Dropped: the tags, the newlines just inside them (`<think>\n` ... `\n</think>`), the newlines
  that follow `</think>`, and whitespace before an opening `<think>`. Everything else comes out
  once, in order, as reasoning or as answer.
- The split does not depend on how the text is cut into pieces: `split_reasoning` is one feed and
  a finish. Text goes out as soon as it is decided; held back are a trailing prefix of the tag
  awaited and the newlines that may stand just before it (or just after `</think>`).
"""

from __future__ import annotations

from typing import NamedTuple

from cadence.scheduler.grammar import Spec, Thinking

OPEN = "<think>"
CLOSE = "</think>"


def opens_inside(prompt: str) -> bool:
    """Whether a rendered prompt ends by opening the reasoning (`<think>`, then whitespace), so
    the output starts inside it."""
    return prompt.rstrip(" \t\r\n").endswith(OPEN)


def answer_spec(spec: Spec, prompt: str) -> Spec:
    """The grammar a thinking model's answer follows, given its rendered prompt: `spec` after
    the reasoning, left free (opened by the prompt, or by the model with `<think>`), unless the
    prompt closed the reasoning (Qwen3 with thinking off): then `spec` from the first token."""
    end = prompt.rstrip(" \t\r\n")
    return spec if end.endswith(CLOSE) else Thinking(spec, opened=end.endswith(OPEN))


def template_thinks(template: str | None) -> bool:
    """Whether a chat template speaks of `<think>` (the models `--reasoning_parser=auto` splits)."""
    return template is not None and OPEN in template and CLOSE in template


# `--reasoning_parser`'s values: auto splits where the chat template speaks of <think>; think
# always; none never. qwen3 and deepseek_r1 (vLLM's names) are think.
PARSERS = ("auto", "none", "think", "qwen3", "deepseek_r1")


def parser_on(choice: str, template: str | None) -> bool:
    """Whether a server with `--reasoning_parser=choice` and this chat template splits reasoning."""
    if choice not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {choice!r}")
    return choice != "none" and (choice != "auto" or template_thinks(template))


class Split(NamedTuple):
    """A piece of the output: its reasoning and its answer (either may be "")."""

    reasoning: str = ""
    content: str = ""


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    _START, _INSIDE, _NEWLINES, _ANSWER = "start", "inside", "newlines", "answer"

    def __init__(self, inside: bool):
        # start: nothing decided yet; inside: in the reasoning (at its head, newlines are still
        # dropped); newlines: just after `</think>`, dropping newlines; answer: the rest.
        self._mode = self._INSIDE if inside else self._START
        self._head = True  # inside, nothing but newlines seen since `<think>`
        self._held = ""
        self.pieces = 0  # feeds so far: tokens, as the servers feed one token's text each
        # Where the output reasoned: the pieces through the one that closed the reasoning (all
        # of them while it is open); usage's `reasoning_tokens`.
        self.reasoning_pieces = 0

    def feed(self, text: str) -> Split:
        inside = self._mode == self._INSIDE
        split = self._feed(text)
        self.pieces += 1
        if inside or self._mode == self._INSIDE:
            self.reasoning_pieces = self.pieces
        return split

    def _feed(self, text: str) -> Split:
        self._held += text
        reasoning, content = [], []
        while self._held:
            if self._mode == self._START:
                body = self._held.lstrip(" \t\r\n")
                if body.startswith(OPEN):
                    self._held, self._mode = body[len(OPEN):], self._INSIDE
                    continue
                if OPEN.startswith(body):  # whitespace, or the tag's beginning: wait
                    break
                self._mode = self._ANSWER
            elif self._mode == self._INSIDE:
                if self._head:
                    self._held = self._held.lstrip("\n")
                    if not self._held:
                        break
                    self._head = False
                end = self._held.find(CLOSE)
                if end >= 0:
                    reasoning.append(self._held[:end].rstrip("\n"))
                    self._held, self._mode = self._held[end + len(CLOSE):], self._NEWLINES
                    continue
                keep = _partial_suffix(self._held, CLOSE)
                body = self._held[:len(self._held) - keep]
                newlines = len(body) - len(body.rstrip("\n"))  # may stand just before the tag
                ready = len(body) - newlines
                reasoning.append(self._held[:ready])
                self._held = self._held[ready:]
                break
            elif self._mode == self._NEWLINES:
                self._held = self._held.lstrip("\n")
                if self._held:
                    self._mode = self._ANSWER
            else:
                content.append(self._held)
                self._held = ""
        return Split("".join(reasoning), "".join(content))

    def finish(self) -> Split:
        """What was held back: the start's whitespace or partial tag is answer; a reasoning cut
        off keeps all but its trailing newlines."""
        held, self._held = self._held, ""
        if self._mode == self._START:
            return Split(content=held)
        if self._mode == self._INSIDE:
            return Split(reasoning=held.rstrip("\n"))
        return Split()


def split_reasoning(text: str, inside: bool) -> tuple[str | None, str]:
    """A whole output's (reasoning, answer); reasoning None where the output has none."""
    parser = ReasoningParser(inside)
    parts = [parser.feed(text), parser.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    opened = inside or text.lstrip(" \t\r\n").startswith(OPEN)
    return (reasoning if opened else None), "".join(p.content for p in parts)
