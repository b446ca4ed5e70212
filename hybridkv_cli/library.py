"""Compression around the caller's own model: ``with compress(model, ...) as run: model.generate(...)``.

Inside the block every ``model.generate`` call of batch size 1 gets a fresh
:class:`~hybridkv_cli.compression.cache.PolicyCache` for its prompt (the roles of the prompt
tokens read off its ``input_ids``), and the model's text attention is ours
(:func:`~hybridkv_cli.compression.cache.policy_attention`). On leaving the block -- also by an
exception -- ``generate`` and the attention implementations are what they were. The model's
weights, config and generation config are never changed.

A loop of one's own (``model(**inputs, cache=...)`` step by step) takes a cache from
:meth:`CompressionRun.new_cache`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from hybridkv_cli.compression import Policy, make_policy
from hybridkv_cli.compression.cache import PolicyCache, layer_count, policy_attention
from hybridkv_cli.engine.measure import Generation, Meter
from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.models.loaded import LoadedModel
from hybridkv_cli.runs.record import measurements

__all__ = ["CompressionRun", "compress", "media_token_ids", "roles_from_ids"]

# Config attributes naming the placeholder tokens that stand for image / video patches
# (Qwen2-VL / Qwen2.5-VL / Qwen3-VL: *_token_id; LLaVA-style configs: *_token_index).
_MEDIA_TOKEN_ATTRS = ("image_token_id", "video_token_id", "image_token_index", "video_token_index")
_CACHE_NAMES = ("cache", "past_key_values")  # transformers 5 calls it `cache`; the old name is still taken


def media_token_ids(config) -> list[int]:
    """The image / video placeholder token ids a model config names (empty for a text model)."""
    return sorted({int(v) for a in _MEDIA_TOKEN_ATTRS if isinstance(v := getattr(config, a, None), int)})


def roles_from_ids(input_ids: torch.Tensor, config) -> torch.Tensor:
    """Token roles [N] of a one-prompt ``input_ids`` ([N] or [1, N]): True at image / video
    placeholder tokens. A text model has none, so its whole prompt is context (True): every
    token may be evicted, as the media of a multimodal prompt may."""
    ids = input_ids.reshape(-1)
    media = media_token_ids(config)
    if not media:
        return torch.ones(ids.numel(), dtype=torch.bool)
    return torch.isin(ids.cpu(), torch.tensor(media))


class CompressionRun:
    """What one ``with compress(...)`` block measured: one entry per generation in it."""

    def __init__(self, model, policy: Policy, roles):
        self.model = model
        self.policy = policy
        self.roles = roles
        self.generations: list[Generation] = []
        self._prompts: list[torch.Tensor] = []  # the roles of each generation's prompt

    def new_cache(self, input_ids: torch.Tensor) -> PolicyCache:
        """A fresh compressed cache for the prompt ``input_ids`` ([1, N]), for a loop of one's own
        (``model(**inputs, cache=cache)`` and then one token per step). Its report has no timings."""
        if input_ids.dim() == 2 and input_ids.shape[0] != 1:
            raise UsageError(f"compression takes one prompt at a time (batch size 1), got {input_ids.shape[0]}",
                             "input_ids")
        n = input_ids.shape[-1]
        roles = roles_from_ids(input_ids, self.model.config) if self.roles is None else _as_roles(self.roles, n)
        cache = PolicyCache(self.policy, layer_count(self.model), roles)
        self.generations.append(Generation(tokens=[], prefill_s=0.0, step_s=[], cache=cache,
                                           device_bytes_after_prefill=0, compressed=n))
        self._prompts.append(roles)
        return cache

    def report(self, index: int = -1) -> dict:
        """The record fields of generation ``index`` (default: the last): ``method``, ``budget``,
        ``prefill_s``, ``decode``, ``kv``, ``traffic``, ``heads``, as in the CLI's JSON record,
        plus ``input`` (visual / text token counts), ``model``, ``device`` and ``dtype``."""
        if not self.generations:
            raise UsageError("nothing was generated inside the compress() block", "report")
        run, roles = self.generations[index], self._prompts[index]
        if not run.tokens and not run.step_s:  # a loop of one's own: tokens are what the cache saw past the prompt
            run = _own_loop(run, roles.numel())
        name = str(self.model.config.name_or_path or type(self.model).__name__)
        loaded = LoadedModel(model=self.model, processor=None, name=name, device=self.model.device,
                             dtype=self.model.dtype)
        visual = int(roles.sum())
        return {
            "input": {"visual_tokens": visual, "text_tokens": roles.numel() - visual},
            "method": self.policy.name,
            "budget": self.policy.budget,
            **measurements(loaded, self.policy, run),
            "model": loaded.name,
            "device": str(loaded.device),
            "dtype": str(loaded.dtype).removeprefix("torch."),
        }

    def reports(self) -> list[dict]:
        """:meth:`report` of every generation in the block, in order."""
        return [self.report(i) for i in range(len(self.generations))]

    # --- generate, compressed ----------------------------------------------------------------
    def _generate(self, stock, *args, **kwargs):
        """``stock(*args, **kwargs)`` (the model's own ``generate``) with a fresh compressed cache,
        every token timed (the caller's streamer, if any, still gets every token)."""
        if any(kwargs.pop(name, None) is not None for name in _CACHE_NAMES):
            raise UsageError("inside compress() the cache is hybridkv's: do not pass one to generate", "cache")
        for name in ("num_beams", "num_return_sequences"):
            if (kwargs.get(name) or 1) > 1:
                raise UsageError(f"compression decodes one sequence: {name} must be 1", name)
        input_ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if input_ids is None:
            raise UsageError("compress() reads token roles from input_ids: pass them to generate", "input_ids")
        cache = self.new_cache(input_ids)
        measured: list[int] = []
        meter = Meter(self.model.device)  # what cuda_peak_bytes reports: this generation's
        clock = StepClock(meter, on_first_token=lambda: measured.append(cache.device_bytes()))
        user_streamer = kwargs.pop("streamer", None)
        streamer = clock if user_streamer is None else _Tee(clock, user_streamer)
        out = stock(*args, **kwargs, cache=cache, streamer=streamer)
        n = input_ids.shape[-1]
        self.generations[-1] = meter.finish(_new_tokens(out, n), cache,
                                            measured[0] if measured else cache.device_bytes(), n)
        return out


class StepClock(BaseStreamer):
    """Hands ``meter`` every token ``generate`` emits (its first put is the prompt itself);
    ``on_first_token()`` runs when the first one arrives, before it is appended to the cache."""

    def __init__(self, meter: Meter, on_first_token):
        self.meter, self.on_first_token = meter, on_first_token
        self._prompt_seen = False

    def put(self, value):
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.meter.token()
        if self.meter.first is not None and not self.meter.steps:
            self.on_first_token()

    def end(self):
        pass


class _Tee(BaseStreamer):
    """Hands every token to both streamers."""

    def __init__(self, *streamers):
        self.streamers = streamers

    def put(self, value):
        for s in self.streamers:
            s.put(value)

    def end(self):
        for s in self.streamers:
            s.end()


def _as_roles(roles, n: int) -> torch.Tensor:
    mask = torch.as_tensor(roles, dtype=torch.bool).reshape(-1).cpu()
    if mask.numel() != n:
        raise UsageError(f"roles has {mask.numel()} entries for a prompt of {n} tokens", "roles")
    return mask


def _new_tokens(out, prompt_length: int) -> list[int]:
    """The generated ids of ``generate``'s output (a tensor, or an output with ``sequences``)."""
    sequences = out if torch.is_tensor(out) else out.sequences
    return sequences[0, prompt_length:].tolist()


def _own_loop(run: Generation, prompt_length: int) -> Generation:
    """A generation from a cache driven by the caller's loop: the tokens it saw past the prompt."""
    generated = max(0, run.cache.get_seq_length() - prompt_length)
    return Generation(tokens=[0] * generated, prefill_s=0.0, step_s=[], cache=run.cache,
                      device_bytes_after_prefill=run.cache.device_bytes(), compressed=prompt_length)


@contextlib.contextmanager
def compress(model, method: str | Policy = "hybridkv", budget: float | None = None,
             roles: Sequence[bool] | torch.Tensor | None = None, **options):
    """Compress the KV cache of ``model.generate`` calls inside the block.

    Parameters
    ----------
    model : transformers PreTrainedModel
        A Qwen2-VL, Qwen2.5-VL, Qwen3-VL or LLaVA-OneVision model, or a decoder LM (Llama / Qwen2
        families), as the caller loaded it.
    method : str or Policy
        A registered method (``hybridkv``, ``snapkv``, ...) or a ready policy.
    budget : float, optional
        Device-resident prompt KV as a share of the full cache, in (0, 1]; None: the method's default.
    roles : BoolTensor [N] or sequence of bool, optional
        The prompt's token roles (True: visual / context tokens, False: text), for every
        generation in the block. None: read off each prompt's ``input_ids`` -- True at the image
        / video placeholder ids of ``model.config``; a text model has none, so all its prompt is
        context (give roles to mark a question the methods should favour).
    **options
        The method's parameters (``window``, ``theta``, ...); one it does not take raises
        :class:`~hybridkv_cli.io.errors.UsageError`.

    Yields
    ------
    CompressionRun
        ``run.report()`` after a ``generate`` call gives its ``kv`` / ``heads`` / ``decode`` fields.

    Generation inside the block takes one prompt (batch size 1) and one sequence (no beams).
    """
    if isinstance(method, Policy):
        if budget is not None or options:
            raise UsageError("give options to make_policy, not beside a ready policy", "budget")
        policy = method
    else:
        policy = make_policy(method, budget=budget, **options)
    if getattr(model.generate, "_hybridkv_run", None) is not None:
        raise UsageError("this model is already inside a compress() block", "model")
    run = CompressionRun(model, policy, roles)
    had_own = "generate" in vars(model)  # an instance attribute of the caller's, to put back
    own = vars(model).get("generate")
    stock = model.generate

    @functools.wraps(stock)
    def generate(*args, **kwargs):
        return run._generate(stock, *args, **kwargs)

    generate._hybridkv_run = run
    with policy_attention(model):
        model.generate = generate
        try:
            yield run
        finally:
            if had_own:
                model.generate = own
            else:
                del model.generate
