"""Questions about one compressed prefix, through the engine as ``-Q`` and ``.hkv`` inputs use it."""

from __future__ import annotations

from hybridkv_cli.engine import Job, Limits, decode, prefill
from hybridkv_cli.models.prompt import QuestionTemplate
from hybridkv_cli.runs.session import TEMPLATE_QUESTION  # noqa: F401 - re-exported for the tests


def compress_prefix(model, prompt, policy, template: QuestionTemplate):
    """``prompt`` prefilled up to its question, shared by every question asked after it."""
    prefix = prefill(model, prompt, policy, prompt.question_start, shared=True)
    prefix.template = template
    return prefix


def answer_all(model, prefix, suffixes: list[list[int]], max_new_tokens: int, limits: Limits = Limits()) -> list:
    """The generation of each suffix (in order), decoded from copies of ``prefix`` under ``limits``."""
    jobs = [(i, lambda i=i, s=s: Job(i, s, prefix=prefix)) for i, s in enumerate(suffixes)]
    done = {}
    for outcome in decode(lambda: model, jobs, max_new_tokens=max_new_tokens, limits=limits):
        if outcome.error is not None:
            raise outcome.error
        done[outcome.job.tag] = outcome.generation
    return [done[i] for i in range(len(suffixes))]


def answer(model, prefix, suffix: list[int], max_new_tokens: int):
    """One suffix's generation from a copy of ``prefix``."""
    return answer_all(model, prefix, [suffix], max_new_tokens)[0]
