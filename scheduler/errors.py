"""Typed errors a submission can fail with; front doors map them to messages and statuses."""

from __future__ import annotations


class SubmissionError(ValueError):
    """The request cannot be served as given; the message says what to change."""


class RequestTooLong(SubmissionError):
    """Prompt + max_tokens does not fit a KV slot (the context). Never silently truncated."""


class Overloaded(RuntimeError):
    """The waiting queue is full; retry later."""


class NotRunning(RuntimeError):
    """The scheduler is stopped or draining and accepts no new requests."""
