"""A :class:`Request`: what the command line, the library and the server ask of the engine.

A request names what is asked about -- media files (an :class:`~hybridkv_cli.runs.inputs.Item`,
or one ``.hkv`` file), a text context, a prompt built already (:class:`Prepared`) or a prefix
compressed already -- its questions, how they are read (in the prompt, or after one shared
compression: ``shared``), its policy and token limit, and a tag the caller gets back.
:meth:`Session.answer <hybridkv_cli.runs.session.Session.answer>` plans requests into engine
jobs and yields one :class:`Answer` per question as it finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridkv_cli.compression import Policy
from hybridkv_cli.engine import Prefix
from hybridkv_cli.engine.hkv import is_cache_path
from hybridkv_cli.engine.sampling import Sampling
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models.prompt import Prompt
from hybridkv_cli.runs.inputs import Item


@dataclass
class Prepared:
    """One input made ready: its media (None: a text prompt), the built prompt, the question,
    and the name errors give it."""

    media: MediaInput | None
    prompt: Prompt
    question: str
    source: str


@dataclass(eq=False)
class Request:
    """What to answer (see the module docstring). Exactly one of ``item`` (media paths or a
    ``.hkv`` file; with no paths, a text prompt about ``context``), ``prepared`` or ``prefix``.

    ``shared``: the media are compressed once and every question read after it (``-Q``, the
    server); otherwise each question is read in its prompt (compressed with it, or after it with
    ``--defer-question``). A ``prefix`` and a ``.hkv`` file are always shared; a ``prepared``
    prompt never is (it has its question). ``policy``: None for the session's;
    ``max_new_tokens`` and ``sampling``: None for the session's.
    """

    tag: Any = None
    questions: tuple[str, ...] = ()
    item: Item | None = None
    context: str | None = None
    prepared: Prepared | None = None
    prefix: Prefix | None = None
    shared: bool = False
    policy: Policy | None = None
    max_new_tokens: int | None = None
    sampling: Sampling | None = None
    logprobs: int | None = None  # each answer token's log probability and this many alternatives (None: none)
    label: str | None = None  # the name its errors give (None: the item's key, or the prompt's source)
    history: tuple[tuple[str, str], ...] = ()  # earlier turns (question, answer) before its questions (the server)

    def __post_init__(self):
        if sum(x is not None for x in (self.item, self.prepared, self.prefix)) != 1:
            raise ValueError("a request has one of item, prepared or prefix")
        if self.prepared is not None:
            self.questions = (self.prepared.question,)
        cache_file = self.item is not None and len(self.item.paths) == 1 and is_cache_path(self.item.paths[0])
        self.shared = self.prefix is not None or cache_file or (self.shared and self.prepared is None)
        if self.history and not self.shared:
            raise ValueError("earlier turns are read after a shared prefix")

    @property
    def source(self) -> str:
        """The name its errors give: its ``label``, the input's key, ``--context``, or the
        prompt's source."""
        if self.label is not None:
            return self.label
        if self.prepared is not None:
            return self.prepared.source
        if self.item is not None:
            return self.item.key if self.item.paths else "--context"
        return ""


@dataclass
class Answer:
    """One question of a request answered: its ``record``, or the ``error`` that stopped it.
    ``index`` is the question's (None: the request failed before any question was read -- its
    media or its compression -- and no other answer of it follows)."""

    request: Request
    index: int | None
    record: dict | None = None
    error: BaseException | None = None
