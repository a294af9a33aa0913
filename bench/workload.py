"""The mixed workload: short chats and long documents, built from real English text.

    spec = WorkloadSpec(classes=(ClassSpec.chat(concurrency=4), ClassSpec.document(rate=0.1)), seed=0)
    requests = spec.requests("document")      # an endless, seeded sequence of RequestSpec
    arrivals = spec.arrivals("document", 60)  # Poisson arrival times (open-loop classes)

The text is the Python standard library's own documentation strings, read from the stdlib's
source files with `ast` (no module is imported), so every machine with Python has it. Prompt
lengths are targeted with a server-independent approximation (`approx_tokens`: 4 characters a
token); the true counts come from the server's `usage` and are what every metric uses.

Reproducibility: the same seed, spec and Python version give the same prompts, output lengths
and arrival times (the corpus digest is recorded so a run on another Python can be told apart).
Closed-loop classes draw from their sequence in order; which worker sends which request depends
on timing, the contents of the n-th request do not.

Imports only the standard library and numpy: this is part of the client side.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import itertools
import os
import re
import sysconfig
from collections.abc import Iterator

import numpy as np

CHARS_PER_TOKEN = 4.0
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages",
              "dist-packages", "ensurepip", "__pycache__", "config-3"}

CHAT_INSTRUCTIONS = (
    "Explain the following in plain words for a new programmer:",
    "What does this mean, and when would I use it?",
    "Summarize this in two sentences:",
    "Give an example of how this is used:",
)
DOCUMENT_INSTRUCTION = "Read the following documentation and write a short summary of its main points."


def approx_tokens(text: str) -> int:
    """Server-independent token estimate used only to size prompts (never for metrics)."""
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def _paragraphs(doc: str) -> Iterator[str]:
    for block in re.split(r"\n\s*\n", doc):
        text = " ".join(block.split())
        if len(text) < 60 or ">>>" in text:
            continue
        letters = sum(c.isalpha() or c == " " for c in text)
        if letters / len(text) >= 0.85:  # prose, not tables or code
            yield text


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[str, ...]:
    """English paragraphs from the docstrings of public stdlib modules, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith(("_", "config-")))
        files += [os.path.join(directory, n) for n in names if n.endswith(".py") and not n.startswith("_")]
    paragraphs: list[str] = []
    for path in sorted(files):
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    paragraphs.extend(_paragraphs(doc))
    if len(paragraphs) < 100:
        raise RuntimeError(f"found only {len(paragraphs)} docstring paragraphs under {root}; "
                           "the benchmark needs the Python standard library's sources")
    return tuple(paragraphs)


def corpus_digest() -> str:
    h = hashlib.sha256()
    for p in corpus():
        h.update(p.encode())
    return h.hexdigest()[:16]


def text_of(tokens: int, rng: np.random.Generator) -> str:
    """Consecutive paragraphs from a random place in the corpus, cut to ~`tokens` tokens."""
    paragraphs = corpus()
    i = int(rng.integers(len(paragraphs)))
    budget = int(tokens * CHARS_PER_TOKEN)
    out: list[str] = []
    used = 0
    while used < budget:
        p = paragraphs[i % len(paragraphs)]
        if used + len(p) > budget:
            p = p[: budget - used].rsplit(" ", 1)[0] or p[: budget - used]
        out.append(p)
        used += len(p) + 2
        i += 1
    return "\n\n".join(out)


@dataclasses.dataclass(frozen=True)
class ClassSpec:
    """One workload class. Exactly one of `concurrency` (closed loop) or `rate` (open loop,
    Poisson arrivals, requests/s) is set. Lengths are inclusive [low, high] ranges, drawn
    uniformly; prompt lengths are approximate tokens (see `approx_tokens`)."""

    name: str
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    concurrency: int | None = None
    rate: float | None = None
    kind: str = "chat"  # "chat" (a question about a paragraph) or "document" (summarize a document)

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError(f"class {self.name!r}: give exactly one of concurrency (closed loop) "
                             f"or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 0:
            raise ValueError(f"class {self.name!r}: concurrency must be >= 0")
        if self.rate is not None and self.rate < 0:
            raise ValueError(f"class {self.name!r}: rate must be >= 0")
        for label, (lo, hi) in (("prompt", self.prompt_tokens), ("output", self.output_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"class {self.name!r}: {label} range must satisfy 1 <= low <= high")
        if self.kind not in ("chat", "document"):
            raise ValueError(f"class {self.name!r}: kind must be 'chat' or 'document'")

    @classmethod
    def chat(cls, concurrency: int | None = None, rate: float | None = None,
             prompt_tokens=(50, 400), output_tokens=(64, 256)) -> ClassSpec:
        return cls("chat", tuple(prompt_tokens), tuple(output_tokens), concurrency, rate, "chat")

    @classmethod
    def document(cls, concurrency: int | None = None, rate: float | None = None,
                 prompt_tokens=(2000, 7000), output_tokens=(32, 128)) -> ClassSpec:
        return cls("document", tuple(prompt_tokens), tuple(output_tokens), concurrency, rate, "document")

    @property
    def open_loop(self) -> bool:
        return self.rate is not None

    def scaled(self, factor: float) -> ClassSpec:
        """The same class at `factor` times the load (rate, or concurrency rounded, >= 1)."""
        if self.open_loop:
            return dataclasses.replace(self, rate=self.rate * factor)
        if self.concurrency == 0:
            return self
        return dataclasses.replace(self, concurrency=max(1, round(self.concurrency * factor)))


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    id: str
    cls: str
    prompt: str
    approx_prompt_tokens: int
    max_tokens: int
    # A whole conversation, (role, content) pairs, sent instead of `prompt` as one user message
    # (`bench.conversations`: a system prompt and the history of earlier turns).
    messages: tuple[tuple[str, str], ...] | None = None


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    classes: tuple[ClassSpec, ...]
    seed: int = 0
    warmup_s: float = 10.0  # requests sent before this are excluded from the metrics
    duration_s: float = 60.0  # the observation window, after the warm-up
    drain_timeout_s: float = 300.0  # how long in-flight requests may finish after the window

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"workload classes need distinct names, got {names}")
        if self.warmup_s < 0 or self.duration_s <= 0:
            raise ValueError("warmup_s must be >= 0 and duration_s > 0")

    def get(self, name: str) -> ClassSpec:
        return next(c for c in self.classes if c.name == name)

    def _rng(self, name: str, stream: int) -> np.random.Generator:
        index = [c.name for c in self.classes].index(name)
        return np.random.default_rng([self.seed, index, stream])

    def requests(self, name: str) -> Iterator[RequestSpec]:
        """The class's endless request sequence: the same for the same seed."""
        spec, rng = self.get(name), self._rng(name, 0)
        for n in itertools.count():
            tokens = int(rng.integers(spec.prompt_tokens[0], spec.prompt_tokens[1] + 1))
            max_tokens = int(rng.integers(spec.output_tokens[0], spec.output_tokens[1] + 1))
            if spec.kind == "document":
                head = DOCUMENT_INSTRUCTION + "\n\n"
                prompt = head + text_of(max(1, tokens - approx_tokens(head)), rng)
            else:
                head = CHAT_INSTRUCTIONS[int(rng.integers(len(CHAT_INSTRUCTIONS)))] + "\n\n"
                prompt = head + text_of(max(1, tokens - approx_tokens(head)), rng)
            yield RequestSpec(f"{name}-{self.seed}-{n}", name, prompt, approx_tokens(prompt), max_tokens)

    def arrivals(self, name: str, until_s: float) -> list[float]:
        """Poisson arrival times in [0, until_s) for an open-loop class (seconds from start)."""
        spec = self.get(name)
        if not spec.open_loop or spec.rate == 0:
            return []
        rng, t, out = self._rng(name, 1), 0.0, []
        while True:
            t += float(rng.exponential(1.0 / spec.rate))
            if t >= until_s:
                return out
            out.append(t)

    def scaled(self, factor: float, only: str | None = None) -> WorkloadSpec:
        """Every class at `factor` times its load, or (`only`) that class alone."""
        return dataclasses.replace(self, classes=tuple(
            c.scaled(factor) if only in (None, c.name) else c for c in self.classes))

    def describe(self) -> dict:
        return {**dataclasses.asdict(self), "corpus": "Python stdlib docstrings",
                "corpus_digest": corpus_digest(), "chars_per_token_estimate": CHARS_PER_TOKEN}
