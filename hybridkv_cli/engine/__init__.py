"""The engine: one generation's life, ``prefill(model, prompt, policy, upto) -> Prefix`` then
``decode(load_model, jobs, limits) -> Iterator[Outcome]`` (see :mod:`.prefix` and :mod:`.jobs`)."""

from hybridkv_cli.engine.jobs import Job, Limits, Outcome, decode, generate, prompt_job
from hybridkv_cli.engine.measure import Generation, Meter, now
from hybridkv_cli.engine.prefix import Prefix, prefill

__all__ = ["Generation", "Job", "Limits", "Meter", "Outcome", "Prefix", "decode", "generate", "now", "prefill", "prompt_job"]
