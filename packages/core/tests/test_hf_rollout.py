"""The hf rollout engine computes each prompt once for all of its samples."""

import pytest
import torch

from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.rollout import SamplingParams


@pytest.fixture(scope="module")
def engine(gearshift_model):
    return HFRolloutEngine.build(gearshift_model)


PROMPTS = [[5, 17, 3, 9, 22, 4], [8, 2], [11, 30, 7, 1]]  # lengths differ: left padding counts


def _tokens_through_the_model(engine, fn):
    seen = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].numel()), with_kwargs=True)
    try:
        out = fn()
    finally:
        hook.remove()
    return out, sum(seen)


def test_samples_of_a_prompt_share_its_prefill_and_match_the_prompt_repeated(engine):
    n = 4
    sampling = SamplingParams(n=n, max_tokens=5, temperature=1.0, seed=11)
    shared, shared_tokens = _tokens_through_the_model(engine, lambda: engine.generate(PROMPTS, sampling))
    repeated_prompts = [p for p in PROMPTS for _ in range(n)]
    repeated, repeated_tokens = _tokens_through_the_model(
        engine, lambda: engine.generate(repeated_prompts, SamplingParams(n=1, max_tokens=5, temperature=1.0, seed=11)))
    # the same draws from the same logits: every sample and its logprobs as if each prompt were given n times
    assert [r.token_ids for r in shared] == [r.token_ids for r in repeated]
    for a, b in zip(shared, repeated):
        assert a.prompt_ids == b.prompt_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    assert [(r.prompt_index, r.sample_index) for r in shared] == [(i, s) for i in range(len(PROMPTS)) for s in range(n)]
    # the prompts went through the model once, not n times (all but their last token: that one runs per sample)
    width = max(map(len, PROMPTS))
    assert repeated_tokens - shared_tokens == (n - 1) * len(PROMPTS) * (width - 1)


def test_greedy_samples_of_one_prompt_agree(engine):
    out = engine.generate([PROMPTS[0]], SamplingParams(n=3, max_tokens=4, temperature=0.0))
    assert out[0].token_ids == out[1].token_ids == out[2].token_ids
    alone = engine.generate([PROMPTS[0]], SamplingParams(n=1, max_tokens=4, temperature=0.0))
    assert out[0].token_ids == alone[0].token_ids


def test_a_call_without_logprobs_keeps_no_logits_and_samples_the_same(engine):
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=7)
    full = engine.generate(PROMPTS, sampling)
    kept = []
    generate = engine.model.generate
    engine.model.generate = lambda **kw: kept.append(kw["output_logits"]) or generate(**kw)
    try:
        bare = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=7, logprobs=False))
    finally:
        del engine.model.generate
    assert kept == [False]
    assert [r.token_ids for r in bare] == [r.token_ids for r in full]
    assert all(r.logprobs == [] for r in bare) and all(len(r.logprobs) == len(r.token_ids) for r in full)
