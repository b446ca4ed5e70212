"""The library entry point: one question about one media input (or a text), answered and measured.

``ask`` is a one-input :class:`~hybridkv_cli.runs.session.Session` around a model the caller loaded:
the same prompt building, context check, generation and record as ``hybridkv ask``.
"""

from __future__ import annotations

from hybridkv_cli.compression import Policy, make_policy
from hybridkv_cli.engine.sampling import GREEDY, Sampling
from hybridkv_cli.engine.stream import Streaming
from hybridkv_cli.media import MediaInput
from hybridkv_cli.models.loaded import LoadedModel
from hybridkv_cli.runs.requests import Request
from hybridkv_cli.runs.session import AskOptions, Session


def ask(
    loaded: LoadedModel,
    media: MediaInput | None,
    question: str,
    *,
    context: str | None = None,
    method: str | Policy = "hybridkv",
    max_new_tokens: int = 128,
    defer_question: bool = False,
    streaming: Streaming = Streaming(),
    system: str | None = None,
    sampling: Sampling = GREEDY,
    **options,
) -> dict:
    """Answer ``question`` about ``media``, or about the text ``context`` when ``media`` is None,
    with the KV cache compressed by ``method``.

    Parameters
    ----------
    loaded : LoadedModel
        From :func:`hybridkv_cli.models.registry.load_model`.
    media : MediaInput or None
        From :func:`hybridkv_cli.media.load_media`; None for a text prompt about ``context``
        (whose tokens then take the role visual tokens have in a media prompt).
    method : str or Policy
        A registered method name or a ready policy.
    defer_question : bool
        Compress the cache before the question is read (see :func:`hybridkv_cli.engine.jobs.prompt_job`).
    streaming : Streaming
        When and how a long prompt is prefilled in chunks (:mod:`hybridkv_cli.engine.stream`;
        default: a prompt longer than 16k tokens).
    system : str or None
        A system prompt, rendered before the media (``hybridkv ask --system``); None: the chat
        template's own.
    sampling : Sampling
        How answer tokens are chosen (:class:`~hybridkv_cli.engine.sampling.Sampling`:
        temperature, top-p, seed); default greedy.
    **options
        The method's parameters (``budget``, ``window``, ``theta``, ...); one the method does not
        take raises :class:`~hybridkv_cli.io.errors.UsageError`.

    Returns
    -------
    dict
        The result record documented in README ("JSON output").
    """
    policy = method if isinstance(method, Policy) else make_policy(method, **options)
    session = Session(AskOptions(model=loaded.name, max_new_tokens=max_new_tokens, defer_question=defer_question,
                                 streaming=streaming, sampling=sampling), loaded=loaded)
    return session.ask(Request(prepared=session.prepare(media, question, context=context, system=system),
                               policy=policy))
