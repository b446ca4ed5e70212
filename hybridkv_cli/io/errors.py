"""Errors a user sees as one line: the input it concerns and the reason."""

from __future__ import annotations


class HybridKVError(Exception):
    """A failure the CLI reports as ``<input>: <reason>`` without a traceback.

    ``exit_code`` is 2 for usage errors (bad arguments) and 1 for runtime errors
    (the input could not be processed).
    """

    exit_code = 1

    def __init__(self, reason: str, source: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.source = source

    def __str__(self) -> str:
        return f"{self.source}: {self.reason}" if self.source else self.reason


class UsageError(HybridKVError):
    """Bad arguments: the user must change the command line."""

    exit_code = 2


class MediaError(HybridKVError):
    """An input file (media, or a text context) is missing, unreadable, undecodable or of an
    unsupported type."""


class ModelError(HybridKVError):
    """A model could not be loaded (not cached offline, bad directory, ...)."""


class MediaWarning(UserWarning):
    """A non-fatal notice about an input (skipped file, capped frame count, repaired output file).
    Message: ``<path>: <what>``."""


class ContextLengthError(HybridKVError):
    """The prompt (+ the tokens to generate) does not fit the model's context window."""


class OutOfMemoryError(HybridKVError):
    """The device (or host) ran out of memory on this input."""


def one_line(value, limit: int | None = 400) -> str:
    """``value`` as one line (whitespace runs collapsed) of at most ``limit`` characters (None: any)."""
    text = " ".join(str(value).split())
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."
