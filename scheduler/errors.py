"""Typed errors a submission can fail with; front doors map them to messages and statuses."""

from __future__ import annotations


class SubmissionError(ValueError):
    """The request cannot be served as given; the message says what to change, and `param`
    names the request field at fault when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestTooLong(SubmissionError):
    """Prompt + max_tokens does not fit a KV slot (the context). Never silently truncated."""


class Overloaded(RuntimeError):
    """The waiting queue is full, or the request would miss its class's latency target
    (`scheduler.priority`); retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class NotRunning(RuntimeError):
    """The scheduler is stopped or draining and accepts no new requests."""


class EngineDead(NotRunning):
    """The engine failed and could not rebuild its state: this process serves nothing more.

    Every request that was waiting or running when it died has ended with an error; restart
    the process (its /health answers 503, so an orchestrator will)."""
