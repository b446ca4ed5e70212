"""Sampled answers (``temperature`` / ``top_p`` with a seed): draws from the right distribution, the
same tokens alone or in any batch, again with the same seed; temperature 0 is the greedy answer."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from hybridkv_cli.compression import make_policy
from hybridkv_cli.engine import Job, Limits, decode
from hybridkv_cli.engine.sampling import GREEDY, Sampling, _mul32, choose, hash32, uniform
from hybridkv_cli.models.prompt import QuestionTemplate, build_prompt

sys.path.insert(0, str(Path(__file__).parent))
from demo_fixtures import demo, video  # noqa: E402,F401 - fixtures
from shared_prefix import TEMPLATE_QUESTION, compress_prefix  # noqa: E402

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draws(temperature: float, top_p: float, n: int = 20_000) -> torch.Tensor:
    """The frequency of each token of LOGITS over ``n`` seeds."""
    rows = torch.full((n,), 1.0)
    tokens = choose(LOGITS.expand(n, -1), rows * temperature, rows * top_p, torch.arange(n), torch.zeros(n, dtype=torch.long),
                    nucleus=top_p < 1)
    return torch.bincount(tokens, minlength=len(LOGITS)).double() / n


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_softmax_at_the_temperature(temperature):
    freq, probs = draws(temperature, 1.0), (LOGITS / temperature).double().softmax(-1)
    # within 5 standard errors of each token's probability over 20,000 draws
    assert torch.all((freq - probs).abs() <= 5 * (probs * (1 - probs) / 20_000).sqrt() + 1e-4), (freq, probs)


def test_top_p_draws_only_from_the_nucleus_renormalised():
    probs = LOGITS.double().softmax(-1)  # 0.561, 0.206, 0.125, 0.076, ...: 0.8 needs the first three
    freq, nucleus = draws(1.0, 0.8), probs[:3] / probs[:3].sum()
    assert freq[3:].sum() == 0
    assert torch.all((freq[:3] - nucleus).abs() <= 5 * (nucleus * (1 - nucleus) / 20_000).sqrt())
    assert draws(1.0, 1e-6)[0] == 1  # a tiny nucleus is the top token


def test_a_draw_depends_on_its_seed_and_index_only_and_temperature_zero_is_the_argmax():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    t, p = torch.tensor([1.0, 0.0, 1.5, 0.7, 0.0]), torch.tensor([1.0, 0.5, 0.9, 1.0, 1.0])
    seed, index = torch.tensor([3, 3, -7, 2**62, 9]), torch.tensor([0, 4, 2, 9, 1])
    together = choose(logits, t, p, seed, index, nucleus=True)
    alone = torch.cat([choose(logits[b:b + 1], t[b:b + 1], p[b:b + 1], seed[b:b + 1], index[b:b + 1], nucleus=bool(p[b] < 1))
                       for b in range(5)])
    assert torch.equal(together, alone)
    assert torch.equal(together[[1, 4]], logits[[1, 4]].argmax(-1))
    other = choose(logits, t, p, seed + 1, index, nucleus=True)  # another seed: other draws (some row differs)
    assert not torch.equal(together[[0, 2, 3]], other[[0, 2, 3]])


def test_the_noise_is_uniform_and_its_integer_mix_exact():
    x = torch.tensor([0, 1, 2**31, 2**32 - 1, 123456789, 4000000000])
    for c in (0x7FEB352D, 0x846CA68B):
        assert _mul32(x, c).tolist() == [v * c % 2**32 for v in x.tolist()]
    assert hash32(x).min() >= 0 and hash32(x).max() < 2**32
    u = uniform(torch.tensor([1, -5, 2**62]), torch.tensor([0, 3, 7]), 100_000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.005 and abs(u.std() - 1 / math.sqrt(12)) < 0.005


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(temperature=2.5), dict(temperature=float("nan")),
                                 dict(top_p=0), dict(top_p=1.5), dict(seed=2**64)])
def test_bad_sampling_is_refused(bad):
    with pytest.raises(ValueError):
        Sampling(**{"temperature": 1.0, **bad})


def test_the_nth_of_several_answers_draws_with_the_seed_plus_n():
    """OpenAI's n: answer i of a request draws with its seed + i (64 bits, wrapping); greedy stays greedy."""
    drawn = Sampling(1.0, 0.5, 2**64 - 2)
    assert drawn.nth(0) is drawn and drawn.nth(1).seed == 2**64 - 1 and drawn.nth(3).seed == 1
    assert drawn.nth(3).temperature == 1.0 and drawn.nth(3).top_p == 0.5
    assert Sampling(1.0, 1.0, -1).nth(1).seed64 == 0 and GREEDY.nth(5) is GREEDY


def test_a_sampled_answer_is_the_same_alone_in_any_batch_and_again(demo, video):
    """Through the engine on the demo: a seed's answer alone, beside others joining as room frees
    (batch of 2 over 5 jobs), and again, token for token; temperature 0 is the greedy answer."""
    p = build_prompt(demo.processor, video, TEMPLATE_QUESTION)
    template = QuestionTemplate.of(demo.processor.tokenizer, p, TEMPLATE_QUESTION)
    prefix = compress_prefix(demo.model, p, make_policy("hybridkv"), template)
    suffix = template.suffix(demo.processor.tokenizer, "What happens in the video?")
    samplings = [Sampling(1.5, 1.0, 1), Sampling(1.5, 0.9, 2), GREEDY, Sampling(1.5, 1.0, 3), Sampling(0.0, 0.5, 4),
                 Sampling(0.0, 1.0, 0, -2.0, 0.0), Sampling(1.5, 1.0, 1, -2.0, -2.0)]

    def run(chosen: list, batch: int) -> list[list[int]]:
        jobs = [(i, lambda i=i, s=s: Job(i, suffix, prefix=prefix, sampling=s)) for i, s in enumerate(chosen)]
        done = {o.job.tag: o.generation.tokens for o in decode(lambda: demo.model, jobs, max_new_tokens=12,
                                                                  limits=Limits(batch_size=batch))}
        return [done[i] for i in range(len(chosen))]

    batched = run(samplings, 2)
    assert batched == [run([s], 1)[0] for s in samplings] == run(samplings, 5)
    assert batched[2] == batched[4]  # temperature 0: greedy, whatever its top_p and seed
    assert len({tuple(t) for t in (batched[0], batched[1], batched[3], batched[2])}) > 1
    # a penalty changes the answer (a negative one: the demo's greedy answer holds no repeat to lower)
    assert batched[5] != batched[2] and batched[5][3] == batched[5][2]


def test_penalties_lower_the_tokens_an_answer_has_generated():
    """OpenAI's penalties: a token the answer holds loses the presence penalty once and the
    frequency penalty per time it was generated; the counts advance with each chosen token."""
    from hybridkv_cli.engine.sampling import BatchSampling

    logits = torch.zeros(3, 10)
    logits[:, 5], logits[:, 6] = 3.0, 2.0  # 5 by a margin of 1 over 6
    penalised = [GREEDY, Sampling(0.0, 1.0, 0, 1.5, 0.0), Sampling(0.0, 1.0, 0, 0.0, 0.6)]
    batch = BatchSampling(torch.device("cpu"), penalised, [[5], [5], [5]], 10)
    assert batch.choose(logits).tolist() == [5, 6, 5]  # presence 1.5 > 1; frequency 0.6 x 1 < 1
    assert batch.choose(logits).tolist() == [5, 5, 6]  # both held once: presence cancels; 5 twice: 1.2 > 1
    assert batch.counts[2, 5] == 2 and batch.counts[2, 6] == 1 and batch.drawn.tolist() == [3, 3, 3]
    batch.keep([0], torch.tensor([0]))
    assert batch.counts is None  # nobody penalised: no counts kept


def test_a_batch_draw_reads_nothing_on_the_host():
    """The step's choice stays on the device: no value read, no data-dependent shape."""
    from hybridkv_kernels.op_watch import OpWatch

    from hybridkv_cli.engine.sampling import BatchSampling

    batch = BatchSampling(torch.device("cpu"), [Sampling(1.0, 0.9, 1), GREEDY, Sampling(0.5, 1.0, 2, 0.5, 1.0)],
                          [[3], [1, 2, 3, 4], [7, 7]], 500)
    logits = torch.randn(3, 500)
    with OpWatch() as watch:
        tokens = batch.choose(logits)
    assert not watch.syncs(), watch.syncs()
    assert batch.drawn.tolist() == [2, 5, 3] and tokens[1] == logits[1].argmax()
