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


def read_questions(path: str) -> list[tuple[str, tuple[str, ...]]]:
    """The questions of a ``--questions`` file: ``(question, expected answers)`` in order.

    One question per line (blank lines ignored), or JSON lines ``{"question": ..., "answer": ...}``
    (the answer optional, a string or a list of strings; a file whose first non-blank line starts
    with ``{`` is read as JSON lines). Every question is cleaned (:func:`clean_question`); a bad
    line is a :class:`UsageError` naming the file and line."""
    import json
    from pathlib import Path

    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise UsageError("no such file", path) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read ({getattr(e, 'strerror', None) or e})", path) from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UsageError("no questions in the file", path)
    as_json = lines[0][1].lstrip().startswith("{")
    out = []
    for n, line in lines:
        if not as_json:
            out.append((clean_question(line), ()))
            continue
        try:
            row = json.loads(line)
            question = row["question"]
            answer = row.get("answer", ())
            answers = (answer,) if isinstance(answer, str) else tuple(answer)
            if not isinstance(question, str) or not all(isinstance(a, str) for a in answers):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"line {n}: expected {{\"question\": TEXT, \"answer\"?: TEXT or [TEXT]}}", path) from None
        out.append((clean_question(question), answers))
    return out


def split_args(args: list[str] | None, context: str | None,
               alternative: str = "(or --context FILE and the question)") -> tuple[list[str], str]:
    """(media paths, question) from a command's MEDIA... QUESTION arguments; with --context only
    the question. ``alternative`` names the other way to give an input, in the error."""
    args = args or []
    if context is not None:
        if len(args) != 1:
            raise UsageError("with --context give only the question (the context replaces the media)", "arguments")
        return [], clean_question(args[0])
    if len(args) < 2:
        raise UsageError(f"give one or more media files (or a directory) followed by the question {alternative}",
                         "arguments")
    return list(args[:-1]), clean_question(args[-1])
