"""An answer's tokens as the text a client receives: streamed as deltas, cut at a stop string.

The final text is the CLI record's ``answer`` (the tokens decoded without special tokens,
stripped) up to the first stop string, stripped again. While streaming, the text given out is
always a prefix of that final text: trailing whitespace, an unfinished UTF-8 character and a tail
that could begin a stop string are held back until the next tokens (or the end) settle them.
"""

from __future__ import annotations

from typing import Callable


class AnswerText:
    """One answer's text so far (see the module docstring)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()):
        self.decode = decode
        self.stop = stop
        self.sent = ""  # the text given out so far
        self.stopped = False  # a stop string was generated: the answer ends before it

    def _cut(self, text: str) -> str:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return text[:min(hits)]
        return text

    def update(self, tokens: list[int]) -> str:
        """The new text ``tokens`` (all of the answer's so far) settle; sets :attr:`stopped` when a
        stop string appeared."""
        text = self._cut(self.decode(tokens).lstrip())
        if self.stopped:
            safe = text.rstrip()
        else:
            safe = text.rstrip().removesuffix("\ufffd")
            for s in self.stop:  # a tail that may grow into a stop string waits
                for n in range(min(len(s) - 1, len(safe)), 0, -1):
                    if safe.endswith(s[:n]):
                        safe = safe[:-n].rstrip()  # the final text is stripped before a stop string too
                        break
        return self._advance(safe)

    def finish(self, tokens: list[int]) -> str:
        """The rest of the text once the answer is done (all its ``tokens``)."""
        return self._advance(self.final(tokens))

    def final(self, tokens: list[int]) -> str:
        """The whole answer (see the module docstring)."""
        return self._cut(self.decode(tokens).strip()).strip()

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent):  # a decode that rewrote earlier text: give nothing until it settles
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
