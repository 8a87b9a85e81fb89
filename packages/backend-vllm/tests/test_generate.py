"""Sampling as the RL loop needs it: raw logprobs, seeds, stop strings, the context limit."""

import pytest

from gearshift.conformance.util import PROMPTS
from gearshift.rollout import RolloutError, SamplingParams


@pytest.fixture
def engine(vllm_engine):
    return vllm_engine


def test_logprobs_are_the_model_own_whatever_the_sampling(engine, transformers_diff):
    # temperature, top-k and top-p shape what is sampled, never the logprobs reported
    assert engine.vllm_kwargs["logprobs_mode"] == "raw_logprobs"  # as built (what tools start a plain vLLM with)
    out = engine.generate(PROMPTS, SamplingParams(n=3, temperature=0.6, top_k=5, top_p=0.9, max_tokens=8, seed=1))
    assert transformers_diff(out) <= 1e-4
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    assert transformers_diff(greedy) <= 1e-4


def test_top_k_one_is_greedy(engine):
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    top1 = engine.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=1, max_tokens=8, seed=5))
    assert [r.token_ids for r in top1] == [r.token_ids for r in greedy]


def test_a_seed_repeats_a_call_and_samples_differ_within_it(engine):
    sampling = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7)
    a, b = engine.generate(PROMPTS, sampling), engine.generate(PROMPTS, sampling)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert len({tuple(r.token_ids) for r in a}) == len(a), "samples of one call repeat each other"
    other = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=8))
    assert [r.token_ids for r in other] != [r.token_ids for r in a]


def test_a_call_seed_in_place_of_request_seeds_repeats_a_call_and_leaves_the_hosts_generators(engine, monkeypatch):
    """A seed per request (the CPU's default) and the call's seed (the GPU's) draw different samples, each
    repeatable."""
    import random

    import torch

    sampling = SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=7)
    assert engine.options.request_seeds is None and engine.request_seeds is True  # None: per request on a CPU
    by_request = engine.generate(PROMPTS, sampling)
    assert [r.token_ids for r in engine.generate(PROMPTS, sampling)] == [r.token_ids for r in by_request]
    monkeypatch.setattr(engine, "request_seeds", False)
    torch.manual_seed(99)
    random.seed(99)
    host = torch.get_rng_state(), random.getstate()
    a, b = engine.generate(PROMPTS, sampling), engine.generate(PROMPTS, sampling)
    assert torch.equal(torch.get_rng_state(), host[0]) and random.getstate() == host[1]
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert len({tuple(r.token_ids) for r in a}) == len(a), "samples of one call repeat each other"
    other = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_tokens=8, seed=8))
    assert [r.token_ids for r in other] != [r.token_ids for r in a]
    assert [r.token_ids for r in a] != [r.token_ids for r in by_request], "the requests kept seeds of their own"
    # the engine's own stream (unseeded calls) does not move with seeded calls
    unseeded = SamplingParams(n=4, temperature=1.0, max_tokens=8)
    state = engine._rng
    engine.generate(PROMPTS, sampling)
    assert engine._rng is state
    assert engine.generate(PROMPTS, unseeded) != a


def test_a_stop_string_ends_the_sample_at_the_token_that_completes_it(engine):
    def sampling(seed, stop=()):
        return SamplingParams(n=8, temperature=1.0, max_tokens=16, seed=seed, stop=stop)

    # find a sample with a printable character that first appears after its first token
    for seed in range(20):
        for r in engine.generate(PROMPTS[:1], sampling(seed)):
            texts = [engine._tokenizer.decode(r.token_ids[:k + 1]) for k in range(len(r.token_ids))]
            chars = [c for c in texts[-1] if c.isalnum() and c not in texts[0]]
            if chars:
                break
        else:
            continue
        break
    else:
        pytest.fail("no sample had a usable stop character")
    end = next(k for k, text in enumerate(texts) if chars[0] in text)
    stopped = engine.generate(PROMPTS[:1], sampling(seed, stop=(chars[0],)))[r.sample_index]
    assert stopped.token_ids == r.token_ids[:end + 1]  # same seed: the same tokens, up to the stop
    assert stopped.finish_reason == "stop"
    assert chars[0] not in stopped.text  # the text leaves the stop string out (its tokens stay in token_ids)
    assert stopped.text == engine._tokenizer.decode(stopped.token_ids, skip_special_tokens=True).split(chars[0])[0]


def test_generation_stops_at_the_end_of_the_context(engine):
    prompt = [65 + i % 26 for i in range(engine.max_model_len - 3)]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert len(out[0].token_ids) <= 3
    assert out[0].finish_reason == "length" or len(out[0].token_ids) < 3


def test_token_ids_outside_the_vocabulary_are_a_clear_error(engine):
    with pytest.raises(RolloutError, match="outside"):
        engine.generate([[1, 2, 10**6]], SamplingParams(max_tokens=2))
    assert len(engine.generate(PROMPTS, SamplingParams(max_tokens=2))) == len(PROMPTS)


def test_seeded_prompts_over_one_step_of_tokens_generate(engine):
    """More prompt tokens than vLLM schedules in one step, seeded: on a CPU a prompt split over two steps made
    vLLM rewind its generator, which a CPU generator cannot do (`CPU Generator does not use offset`)."""
    prompts = [[(7 * i + j) % 200 + 1 for j in range(90)] for i in range(40)]  # 3,600 prompt tokens
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=3)
    out = engine.generate(prompts, sampling)
    assert len(out) == 80 and all(len(r.token_ids) == 4 for r in out)
    assert [r.token_ids for r in engine.generate(prompts, sampling)] == [r.token_ids for r in out]


def test_sampled_logprobs_read_flat_and_per_token_containers_alike():
    """gearshift asks for flat logprobs (a few lists a request, not a dict and an object per token); a vLLM
    without them, or positions holding more than the sampled token, give the same values."""
    from types import SimpleNamespace

    from vllm.logprobs import FlatLogprobs, Logprob

    import vllm

    from gearshift_vllm.requests import sampled_logprobs, vllm_sampling

    assert vllm_sampling(vllm, SamplingParams(), 0, 100).flat_logprobs
    assert vllm_sampling(vllm, SamplingParams(), 0, 100).logprobs == 0  # the sampled token's only
    assert vllm_sampling(vllm, SamplingParams(logprobs=False), 0, 100).logprobs is None  # none computed
    assert sampled_logprobs(SimpleNamespace(logprobs=None), [5, 9]) == []
    tokens = [5, 9, 2]
    per_token = [{5: Logprob(-0.5, 1)}, {9: Logprob(-1.25, 3), 4: Logprob(-0.1, 1)}, {7: Logprob(-0.2, 1),
                                                                                      2: Logprob(-2.0, 2)}]
    flat_one, flat_more = FlatLogprobs(), FlatLogprobs()
    flat_one.extend([{t: step[t]} for t, step in zip(tokens, per_token)])
    flat_more.extend(per_token)
    expected = [-0.5, -1.25, -2.0]
    for container in (per_token, flat_one, flat_more):
        assert sampled_logprobs(SimpleNamespace(logprobs=container), tokens) == expected
