"""The lmms-eval model ``hybridkv``: any supported model, any method and budget, on lmms-eval tasks.

    lmms-eval --model hybridkv --model_args pretrained=Qwen/Qwen2.5-VL-7B-Instruct,method=snapkv,budget=0.1 ...

Each request is answered along the CLI's own line -- media loaded by hybridkv's media layer at
the model's frame size, the prompt built by :func:`~hybridkv_cli.models.prompt.build_prompt`, greedy
generation through the method's compressed cache -- so an answer here is the answer ``hybridkv
ask`` gives for the same files and question. Images lmms-eval hands over as PIL images are
written to lossless PNGs first, so the CLI can be given the very same files.

Per sample, the record's ``kv`` (device / host bytes), ``decode`` (ms/token) and ``heads`` are
kept in :attr:`HybridKV.samples`, logged, and appended to the JSONL file ``kv_log`` when given;
lmms-eval's own sample log gets the input / output token counts. ``loglikelihood`` scores a
continuation through the compressed cache (:meth:`HybridKV.score`).

lmms-eval finds the class through the entry point ``lmms_eval.models`` -> :func:`manifest`
(pyproject.toml). Importing this module needs lmms-eval (``pip install 'hybridkv[eval]'``).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import torch
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.api.registry import register_model
from loguru import logger as eval_logger
from PIL import Image

from hybridkv_cli.compression import MethodOptions
from hybridkv_cli.engine.decoder import position_rows, text_positions
from hybridkv_cli.engine.stream import positions
from hybridkv_cli.io.errors import UsageError
from hybridkv_cli.library import compress
from hybridkv_cli.models.prompt import question_ids
from hybridkv_cli.models.registry import DEFAULT_MODEL
from hybridkv_cli.runs.requests import Prepared, Request
from hybridkv_cli.runs.session import AskOptions, Session

__all__ = ["HybridKV", "manifest", "sample_entry"]

MODEL_ID = "hybridkv"


def manifest():
    """The entry point lmms-eval's model registry loads: ``--model hybridkv`` is :class:`HybridKV`."""
    from lmms_eval.models.registry_v2 import ModelManifest

    return ModelManifest(model_id=MODEL_ID, simple_class_path=f"{__name__}.HybridKV")


def sample_entry(record: dict, task: str, doc_id) -> dict:
    """What is logged per sample: which one, its answer, and the record's measured fields."""
    keep = ("method", "budget", "answer", "input", "prefill_s", "decode", "kv", "traffic", "heads")
    return {"task": task, "doc_id": doc_id, **{k: record[k] for k in keep}}


def stop_at(answer: str, until) -> str:
    """``answer`` cut at the first of lmms-eval's stop strings (``until``: a string or a list)."""
    for term in [until] if isinstance(until, str) else (until or []):
        if term:
            answer = answer.split(term)[0]
    return answer


@register_model(MODEL_ID)
class HybridKV(lmms):
    """An lmms-eval model answering through a hybridkv :class:`~hybridkv_cli.runs.session.Session`.

    Parameters (``--model_args``)
    -----------------------------
    pretrained : str
        What ``hybridkv --model`` takes: a hub id or checkpoint directory, ``demo``, ``smollm2``, ...
    method, budget
        The compression method and its budget (None: the method's default).
    device, dtype, frames, fps, max_pixels, max_new_tokens, defer_question
        As the CLI's flags of the same names; a task's ``max_new_tokens`` wins over the default.
    kv_log : str, optional
        A JSONL file to which each sample's KV / latency entry is appended.
    **method_options
        The method's own parameters (``window``, ``theta``, ...); one it does not take is refused.
    """

    is_simple = True

    def __init__(self, pretrained: str = DEFAULT_MODEL, method: str = "hybridkv", budget: float | None = None,
                 device: str = "auto", dtype: str = "auto", frames: int = 64, fps: float | None = None,
                 max_pixels: int | None = None, max_new_tokens: int = 128, defer_question: bool = False,
                 kv_log: str | None = None, batch_size: int = 1, **method_options) -> None:
        super().__init__()
        if int(batch_size) != 1:  # compression runs one prompt at a time
            raise UsageError(f"the hybridkv model answers one request at a time (batch_size=1), got {batch_size}",
                             "batch_size")
        given = MethodOptions.of({"budget": budget, **method_options})
        options = AskOptions(model=str(pretrained), device=str(device), dtype=str(dtype), method=str(method),
                             method_options=given, frames=int(frames), fps=fps, max_pixels=max_pixels,
                             max_new_tokens=int(max_new_tokens), defer_question=bool(defer_question))
        self.session = Session(options)  # refuses a bad method or option before the model loads
        self.loaded = self.session.model()
        self.kv_log = Path(kv_log) if kv_log else None
        self.samples: list[dict] = []

    # --- what lmms-eval calls ----------------------------------------------------------------
    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        """Greedy answers, one per request, in request order (a task asking for sampling is
        answered greedily, with a warning)."""
        results = []
        for request in requests:
            context, gen_kwargs, doc_to_visual, doc_id, task, split = request.args
            gen_kwargs = dict(gen_kwargs or {})
            if gen_kwargs.get("do_sample") or (gen_kwargs.get("temperature") or 0) > 0:
                warnings.warn("hybridkv decodes greedily: the task's sampling settings are ignored", stacklevel=2)
            visuals = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual else None
            record = self.answer(context, visuals, max_new_tokens=gen_kwargs.get("max_new_tokens"))
            entry = sample_entry(record, task, doc_id)
            self._log(entry)
            answer = stop_at(record["answer"], gen_kwargs.get("until"))
            tokens = record["input"].get("visual_tokens", record["input"].get("context_tokens", 0))
            results.append(GenerationResult(answer, TokenCounts(input_tokens=tokens + record["input"]["text_tokens"],
                                                                output_tokens=record["decode"]["tokens"])))
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), answer)
        return results

    def loglikelihood(self, requests: list[Instance]) -> list[tuple[float, bool]]:
        """Per request, the log-probability of its continuation after the prompt, and whether
        greedy decoding would produce it (see :meth:`score`)."""
        results = []
        for request in requests:
            context, continuation, doc_to_visual, doc_id, task, split = request.args
            visuals = doc_to_visual(self.task_dict[task][split][doc_id]) if doc_to_visual else None
            results.append(self.score(context, continuation, visuals))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), results[-1])
        return results

    def generate_until_multi_round(self, requests):
        raise NotImplementedError("hybridkv answers one question per sample (generate_until); "
                                  "multi-round generation is not implemented")

    # --- one request ---------------------------------------------------------------------------
    def answer(self, question: str, visuals, *, max_new_tokens: int | None = None) -> dict:
        """The CLI record for ``question`` about ``visuals`` (lmms-eval's ``doc_to_visual`` output:
        PIL images and/or file paths; none: a text prompt)."""
        return self.session.ask(Request(prepared=self.prepare(question, visuals),
                                        max_new_tokens=int(max_new_tokens) if max_new_tokens else None))

    def prepare(self, question: str, visuals) -> Prepared:
        """The CLI's prompt for ``question`` about ``visuals`` (none: a text prompt)."""
        question = question.replace("<image>", "").strip()  # lmms-eval's image placeholder; we place media ourselves
        with tempfile.TemporaryDirectory(prefix="hybridkv-lmms-") as folder:
            paths = media_paths(visuals or [], Path(folder))
            media = self.session.load_media(paths) if paths else None  # decoded here: the files may go
            return self.session.prepare(media, question, context=None if media else "")

    def score(self, question: str, continuation: str, visuals) -> tuple[float, bool]:
        """Log-probability of ``continuation`` (plain text) after the prompt for ``question`` about
        ``visuals``, and whether it is the greedy continuation. The prompt is prefilled and
        compressed by the method; the continuation is then read through the compressed cache one
        token per step, as generated tokens would be."""
        prompt = self.prepare(question, visuals).prompt
        model, ids = self.loaded.model, question_ids(self.loaded.tokenizer, continuation)
        inputs = {k: v.to(model.device) if torch.is_tensor(v) else v for k, v in prompt.inputs.items()}
        # the continuation is text after the prompt: it goes on from the prompt's last position, as
        # one forward pass over both places it (on a video, not past the video's last time step)
        rows, (at, _), n = position_rows(model), positions(model, inputs), prompt.length
        delta = 0 if at is None else int(at[0, 0, -1]) + 1 - n
        total, greedy = 0.0, True
        with torch.inference_mode(), compress(model, self.session.policy, roles=prompt.visual) as run:
            cache = run.new_cache(inputs["input_ids"])
            logits = model(**inputs, cache=cache, use_cache=True).logits[0, -1]
            for i, token in enumerate(ids):
                logp = logits.float().log_softmax(-1)
                total += float(logp[token])
                greedy = greedy and int(logp.argmax()) == token
                if i + 1 < len(ids):  # the last token's own logits are not needed
                    step, where = torch.tensor([[token]], device=model.device), text_positions(
                        rows, [(n + i, 1, delta)], model.device)
                    logits = model(input_ids=step, position_ids=where if rows > 1 else where[0],
                                   cache_position=where[0, 0], cache=cache, use_cache=True).logits[0, -1]
        return total, greedy

    def _log(self, entry: dict) -> None:
        self.samples.append(entry)
        kv, decode = entry["kv"], entry["decode"]
        eval_logger.info(f"hybridkv {entry['task']}#{entry['doc_id']}: device {kv['device_bytes']} B, host "
                         f"{kv['host_bytes']} B, {decode['ms_per_token_mean'] or 0:.2f} ms/token")
        if self.kv_log is not None:
            self.kv_log.parent.mkdir(parents=True, exist_ok=True)
            with self.kv_log.open("a", encoding="utf-8") as f:
                f.write(json.dumps(entry, default=_plain) + "\n")


def _plain(value):
    """JSON for what a head report may hold besides plain values (device counters as tensors)."""
    return value.tolist() if torch.is_tensor(value) else str(value)


def media_paths(visuals, folder: Path) -> list[str]:
    """Files for ``visuals``: paths as given, PIL images written to ``folder`` as PNG (lossless,
    so the CLI answers the same pixels)."""
    paths = []
    for i, visual in enumerate(visuals):
        if isinstance(visual, Image.Image):
            path = folder / f"image{i:04d}.png"
            visual.save(path)
            paths.append(str(path))
        elif isinstance(visual, (str, Path)):
            paths.append(str(visual))
        elif isinstance(visual, dict) and isinstance(visual.get("path") or visual.get("video"), str):
            paths.append(visual.get("path") or visual["video"])  # some tasks hand {"video": path}
        else:
            raise UsageError(f"cannot read a visual of type {type(visual).__name__} (PIL images and file paths only)",
                             "doc_to_visual")
    return paths
