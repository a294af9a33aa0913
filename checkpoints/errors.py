"""The one typed error every checkpoint and tokenizer loader raises, and the tokenizer's own.

A `CheckpointError` message is a single line that names the file or tensor at fault and says
what to do about it (convert again, pick another file, use a supported architecture). Front
doors catch it and print or return the message as is; it subclasses `ValueError` because the
fault is always in the input, never in the engine.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint, config or tokenizer file cannot be loaded as asked; the message says why."""


class TokenizerError(CheckpointError):
    """Unusable tokenizer files, or bad text/messages/ids; a ValueError, so a 4xx upstream."""
