"""Question cleaning: what a command line or a task file typed, made safe to put in a prompt."""

from __future__ import annotations

import re
import unicodedata

from hybridkv_cli.io.errors import UsageError

_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-Z\\-_]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 except \t \n, DEL, C1


def clean_question(question: str) -> str:
    """Normalise a question typed on a command line or read from a file.

    ANSI escape sequences are removed; CRLF, CR, U+2028 and U+2029 become ``\\n``; every other
    control character (C0 except tab and newline, DEL, C1) is removed; lone surrogates (bytes
    that were not UTF-8) become U+FFFD; the text is NFC-normalised and stripped. An empty result
    is a :class:`UsageError`. Chat-template tokens such as ``<|im_start|>`` are left in the text:
    the prompt builder tokenises them as plain text (see :func:`hybridkv_cli.models.prompt.build_prompt`).
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


def strings(value, key: str, where: str) -> tuple[str, ...]:
    """A string or a non-empty list of non-empty strings (a task's or a question's ``answer``, a
    task's ``media``); a UsageError naming ``where`` otherwise."""
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v.strip() for v in values):
        raise UsageError(f"'{key}' must be a non-empty string or a list of them", where)
    return tuple(values)


def read_questions(path: str) -> list[tuple[str, tuple[str, ...]]]:
    """The questions of a ``--questions`` file: ``(question, expected answers)`` in order.

    One question per line (blank lines ignored), or JSON lines ``{"question": ..., "answer": ...}``
    (the answer optional, a string or a list of strings, as in a bench task file; a file whose
    first non-blank line starts with ``{`` is read as JSON lines). The file is read as every user
    text file is (:func:`hybridkv_cli.io.user_files.read_text`: a regular file of at most 64 MiB of
    UTF-8). Every question is cleaned (:func:`clean_question`); a bad line is a
    :class:`UsageError` naming the file and line."""
    from hybridkv_cli.io.user_files import loads, read_text

    text = read_text(path, "--questions")
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise UsageError("no questions in the file", path)
    as_json = lines[0][1].lstrip().startswith("{")
    out = []
    for n, line in lines:
        if not as_json:
            out.append((_cleaned(line, f"{path}:{n}"), ()))
            continue
        try:
            row = loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("question"), str):
                raise ValueError
        except ValueError:
            raise UsageError(f"line {n}: expected {{\"question\": TEXT, \"answer\"?: TEXT or [TEXT]}}", path) from None
        answer = row.get("answer")
        answers = () if answer is None else strings(answer, "answer", f"{path}:{n}")
        out.append((_cleaned(row["question"], f"{path}:{n}"), answers))
    return out


def _cleaned(question: str, where: str) -> str:
    try:
        return clean_question(question)
    except UsageError as e:
        raise UsageError(e.reason, where) from None


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
