"""Question cleaning: what a command line or a task file typed, made safe to put in a prompt."""

from __future__ import annotations

import re
import unicodedata

from hybridkv_cli.errors import UsageError

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 except \t \n, DEL, C1


def clean_question(question: str) -> str:
    """Normalise a question typed on a command line or read from a file.

    ANSI escape sequences are removed; CRLF, CR, U+2028 and U+2029 become ``\\n``; every other
    control character (C0 except tab and newline, DEL, C1) is removed; lone surrogates (bytes
    that were not UTF-8) become U+FFFD; the text is NFC-normalised and stripped. An empty result
    is a :class:`UsageError`. Chat-template tokens such as ``<|im_start|>`` are left in the text:
    the prompt builder tokenises them as plain text (see :func:`hybridkv_cli.prompt.build_prompt`).
    """
    q = "".join("\ufffd" if 0xD800 <= ord(c) <= 0xDFFF else c for c in question)
    q = _ANSI.sub("", q)
    q = q.replace("\r\n", "\n").replace("\r", "\n").replace("\u2028", "\n").replace("\u2029", "\n")
    q = _CONTROL.sub("", q)
    q = unicodedata.normalize("NFC", q).strip()
    if not q:
        raise UsageError("the question is empty" + (" (after removing control characters)" if question.strip() else ""),
                         "QUESTION")
    return q
