"""Contracts of a `RolloutEngine`.

Fixtures to supply: `rollout_engine` (built from `gearshift_model`, fp32; any
scope: every test leaves it serving the model's own weights, awake, whether it
passes or fails) and, when the engine was built from another folder,
`gearshift_model`. Set
`rollout_backend` to the engine's class: its `conformance_xfail["rollout"]`
marks the tests it is known to fail where it runs.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from ..rollout import ROLLOUT_TAGS, RolloutError, SamplingParams
from ..weights import WeightBucket, WeightError
from .util import (
    PROMPTS, as_buckets, long_prompts, max_logprob_diff, perturbed, reference_logprob_diff, reference_weights,
    same_outputs, widen_for_dtype,
)

GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=8)


class RolloutEngineSuite:
    """Subclass in a test module and supply `rollout_engine`."""

    rollout_backend: type | None = None
    #: max |engine logprob - transformers' fp32 logprob| of a sampled token (--gearshift-atol widens it)
    logprob_atol: float = 1e-4

    @pytest.fixture
    def rollout_engine(self):
        raise NotImplementedError(
            f"{type(self).__name__} must supply the fixture rollout_engine: the engine under test, built from "
            f"gearshift_model in float32, e.g.\n"
            f"    @pytest.fixture(scope='class')\n    @classmethod\n"
            f"    def rollout_engine(cls, gearshift_model):\n        return MyEngine.build(gearshift_model)")

    @pytest.fixture(autouse=True)
    def _dtype_tolerance(self, request, rollout_engine):
        widen_for_dtype(self, request, rollout_engine)

    @pytest.fixture
    def original(self, rollout_engine, gearshift_model):
        """The model folder's weights; after the test, however it ended, the engine is awake and serves them."""
        weights = reference_weights(gearshift_model, rollout_engine.weight_spec())
        yield weights
        rollout_engine.wake(list(ROLLOUT_TAGS))
        self._restore(rollout_engine, weights)

    @pytest.fixture
    def baseline(self, rollout_engine):
        # computed afresh, like every generation after an update: a prefix served from a cache was computed
        # in another pass shape and may differ in the last bits, which the exact comparisons would flag
        rollout_engine.reset_cache()
        return rollout_engine.generate(PROMPTS, GREEDY)

    def _restore(self, engine, original) -> None:
        engine.update_weights(as_buckets(original, engine.device))

    def _diff_from_fresh(self, engine, prompts, sampling, weights, model_path) -> float:
        """Max logprob gap between what the engine generates now and a computation with nothing cached.

        An fp32 engine is held to transformers' fp32 logprobs with `weights`. Another dtype, whose
        numbers drift from fp32 over long prompts, is held to itself: the same request after a
        sleep (which drops every cache) and a fresh load of `weights`.
        """
        got = engine.generate(prompts, sampling)
        if all(p.dtype == torch.float32 for p in engine.weight_spec()):
            return reference_logprob_diff(model_path, got, weights, engine.weight_spec())
        engine.sleep(["kv_cache", "weights"])
        engine.wake(["weights"])
        engine.update_weights(as_buckets(weights, engine.device))
        engine.wake(["kv_cache"])
        return max_logprob_diff(got, engine.generate(prompts, sampling))

    def test_generate_shapes(self, rollout_engine):
        sampling = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=0)
        out = rollout_engine.generate(PROMPTS, sampling)
        assert len(out) == len(PROMPTS) * 3
        assert [(r.prompt_index, r.sample_index) for r in out] == [(i, j) for i in range(len(PROMPTS)) for j in range(3)]
        for r in out:
            assert r.prompt_ids == PROMPTS[r.prompt_index]
            assert 1 <= len(r.token_ids) <= 6
            assert len(r.logprobs) == len(r.token_ids)
            assert all(lp <= 1e-6 for lp in r.logprobs)
            assert r.finish_reason in ("stop", "length")
            if r.finish_reason == "length":
                assert len(r.token_ids) == 6

    def test_greedy_is_deterministic(self, rollout_engine, baseline):
        again = rollout_engine.generate(PROMPTS, GREEDY)
        assert same_outputs(baseline, again)
        assert max_logprob_diff(baseline, again) < 1e-4
        assert all(len(r.token_ids) == GREEDY.max_tokens or r.finish_reason == "stop" for r in again)

    def test_stop_token_ids_end_generation(self, rollout_engine, baseline):
        first = baseline[0].token_ids[0]
        out = rollout_engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,)))
        assert out[0].token_ids == [first]
        assert out[0].finish_reason == "stop"

    def test_a_seed_repeats_its_samples_and_the_n_samples_differ(self, rollout_engine):
        sampling = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=11)
        first, again = rollout_engine.generate(PROMPTS, sampling), rollout_engine.generate(PROMPTS, sampling)
        assert same_outputs(first, again), "the same seed, prompts and sampling must give the same samples"
        for i in range(len(PROMPTS)):
            samples = {tuple(r.token_ids) for r in first if r.prompt_index == i}
            assert len(samples) > 1, f"the 4 samples of prompt {i} are all the same: each needs its own draw"

    def test_a_call_without_logprobs_samples_the_same_tokens(self, rollout_engine):
        sampling = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5)
        full = rollout_engine.generate(PROMPTS, sampling)
        bare = rollout_engine.generate(PROMPTS, replace(sampling, logprobs=False))
        assert [r.token_ids for r in bare] == [r.token_ids for r in full], \
            "asking for no logprobs changed the samples: it may only leave the logprobs out"
        for r in bare:  # left out, or all of them: an engine may compute them anyway
            assert len(r.logprobs) in (0, len(r.token_ids))

    def test_unseeded_sampling_draws_from_the_engines_own_generator(self, rollout_engine):
        sampling = SamplingParams(n=4, temperature=1.0, max_tokens=6)  # seed=None
        draws = []
        for _ in range(2):  # the host's generators in the same state before each call
            torch.manual_seed(1234)
            random.seed(1234)
            host = (torch.random.get_rng_state(), random.getstate(),
                    torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
            draws.append(rollout_engine.generate(PROMPTS, sampling))
            assert torch.equal(torch.random.get_rng_state(), host[0]), \
                "unseeded sampling moved the host's torch generator: draw from the engine's own"
            assert random.getstate() == host[1], "unseeded sampling moved the host's random module"
            if host[2] is not None:
                assert all(torch.equal(a, b) for a, b in zip(torch.cuda.get_rng_state_all(), host[2])), \
                    "unseeded sampling moved the host's CUDA generators: draw from the engine's own"
        assert not same_outputs(*draws), (
            "two unseeded calls from the same host random state gave the same samples: seed=None must draw from "
            "the engine's own generator (seeded by args.seed), which moves on, never from the host's")

    def test_top_k_one_samples_the_greedy_tokens(self, rollout_engine, baseline):
        out = rollout_engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, top_k=1, max_tokens=8, seed=4))
        for r in out:
            greedy = baseline[r.prompt_index]
            for j, (token, best) in enumerate(zip(r.token_ids, greedy.token_ids)):
                if token != best:
                    # another pass shape (n=2) may order two tokens whose logprobs tie within the engine's
                    # precision (bf16 logits of a random model) differently; anything further apart is an error
                    gap = abs(r.logprobs[j] - greedy.logprobs[j])
                    assert gap <= self.logprob_atol, (
                        f"top_k=1 must leave only the most likely token: prompt {r.prompt_index}, token {j} is "
                        f"{token} (logprob {r.logprobs[j]:.4f}), the greedy one {best} ({greedy.logprobs[j]:.4f})")
                    break
            else:
                assert len(r.token_ids) == len(greedy.token_ids), "top_k=1 must leave only the most likely token"

    def test_a_stop_string_ends_generation(self, rollout_engine, baseline, gearshift_model):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gearshift_model)
        # a stop string that a greedy completion reaches: the text one of its tokens adds (whole characters)
        for i, rollout in enumerate(baseline):
            greedy = rollout.token_ids
            texts = [tokenizer.decode(greedy[:j + 1], skip_special_tokens=True) for j in range(len(greedy))]
            pieces = [t[len(before):] for before, t in zip([""] + texts, texts) if t.startswith(before)]
            stop = next((p for p in pieces if p.strip() and "\ufffd" not in p), None)
            if stop is not None:
                break
        else:
            pytest.skip("no greedy completion of this model adds a whole printable character")
        end = next(j for j, t in enumerate(texts) if stop in t)
        out = rollout_engine.generate([PROMPTS[i]], SamplingParams(temperature=0.0, max_tokens=8, stop=(stop,)))
        assert out[0].finish_reason == "stop", f"stop string {stop!r} did not end generation"
        assert out[0].token_ids == greedy[:end + 1], "generation ends with the token that completes the stop string"
        assert out[0].text is None or stop not in out[0].text, "text is cut before the stop string"

    def test_logprobs_are_those_of_temperature_one_at_any_temperature(self, rollout_engine, gearshift_model):
        out = rollout_engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_tokens=8, seed=5))
        diff = reference_logprob_diff(gearshift_model, out)
        print(f"logprobs sampled at temperature 0.7 vs transformers at temperature 1: max abs diff {diff:.3g}")
        assert diff <= self.logprob_atol, "logprobs must be the model's own (temperature 1), not the sampler's"

    def test_logprobs_ignore_top_k_and_top_p(self, rollout_engine, gearshift_model):
        out = rollout_engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, top_k=20, top_p=0.8,
                                                              max_tokens=8, seed=6))
        assert reference_logprob_diff(gearshift_model, out) <= self.logprob_atol, \
            "logprobs must be those of the whole distribution, before top-k / top-p truncation"

    def test_update_weights_takes_effect_and_restores_exactly(self, rollout_engine, baseline, original):
        rollout_engine.update_weights(as_buckets(perturbed(original), rollout_engine.device))
        try:
            changed = rollout_engine.generate(PROMPTS, GREEDY)
            assert not same_outputs(baseline, changed) or max_logprob_diff(baseline, changed) > 1e-3
        finally:
            self._restore(rollout_engine, original)
        restored = rollout_engine.generate(PROMPTS, GREEDY)
        assert same_outputs(baseline, restored)
        assert max_logprob_diff(baseline, restored) == 0.0

    def test_update_weights_returns_the_bytes_handed_in(self, rollout_engine, original):
        buckets = as_buckets(original, rollout_engine.device)
        assert rollout_engine.update_weights(buckets) == sum(b.nbytes for b in buckets)

    def test_update_weights_drops_the_prefix_cache(self, rollout_engine, original, gearshift_model):
        prompts = long_prompts(rollout_engine.max_model_len)
        greedy = SamplingParams(temperature=0.0, max_tokens=4)
        rollout_engine.generate(prompts, greedy)  # fills any prefix cache
        rollout_engine.generate(prompts, greedy)  # and is served from it
        changed = perturbed(original)
        rollout_engine.update_weights(as_buckets(changed, rollout_engine.device))  # no sleep in between
        try:
            diff = self._diff_from_fresh(rollout_engine, prompts, greedy, changed, gearshift_model)
        finally:
            self._restore(rollout_engine, original)
        assert diff <= self.logprob_atol, f"served keys and values computed with the old weights (diff {diff:.3g})"

    def test_reset_cache_drops_the_prefix_cache(self, rollout_engine, original, gearshift_model):
        if not rollout_engine.can_share_weights:
            pytest.skip("only an engine that serves lent tensors can see its weights change without an update")
        prompts = long_prompts(rollout_engine.max_model_len)
        greedy = SamplingParams(temperature=0.0, max_tokens=4)
        lent = {k: v.clone().to(rollout_engine.device) for k, v in original.items()}
        rollout_engine.share_weights([WeightBucket(lent)])
        try:
            rollout_engine.generate(prompts, greedy)
            rollout_engine.generate(prompts, greedy)
            changed = perturbed(original)
            with torch.no_grad():
                for k, t in lent.items():
                    t.copy_(changed[k])
            rollout_engine.reset_cache()
            diff = self._diff_from_fresh(rollout_engine, prompts, greedy, changed, gearshift_model)
        finally:
            self._restore(rollout_engine, original)
        assert diff <= self.logprob_atol, f"reset_cache kept keys and values of the old weights (diff {diff:.3g})"

    def test_a_turn_continued_after_non_model_tokens_is_a_fresh_prompt_holding_them(self, rollout_engine, original,
                                                                                     gearshift_model):
        """The second turn of an episode: a context of a long prompt, the model's first turn and tokens the model
        did not write (a tool's answer) gives, served after the first turn filled any prefix cache, the same
        tokens and logprobs as a fresh prompt holding the same tokens."""
        prompts = long_prompts(rollout_engine.max_model_len - 24)
        greedy = SamplingParams(temperature=0.0, max_tokens=4)
        rollout_engine.reset_cache()
        first = rollout_engine.generate(prompts, greedy)
        answer = [60, 114, 62, 52, 50, 60, 47, 114, 62]  # "<r>42</r>": tokens of no model turn
        contexts = [x.prompt_ids + x.token_ids + answer for x in first]
        continued = rollout_engine.generate(contexts, greedy)  # any cached prefix of the first turn serves
        diff = self._diff_from_fresh(rollout_engine, contexts, greedy, original, gearshift_model)
        rollout_engine.reset_cache()
        fresh = rollout_engine.generate(contexts, greedy)
        assert same_outputs(continued, fresh), "a continued turn must sample what a fresh prompt does"
        assert max_logprob_diff(continued, fresh) <= self.logprob_atol
        assert diff <= self.logprob_atol, f"the continued turn's logprobs are off the model's (diff {diff:.3g})"

    def test_buckets_before_a_bad_one_stay_applied(self, rollout_engine, original, gearshift_model):
        names = list(original)
        first = [n for n in names if ".0." in n] or names[: len(names) // 2]  # a whole layer
        later = next(n for n in names if n not in first)
        changed = perturbed({n: original[n] for n in first + [later]})
        device = rollout_engine.device
        stream = iter([WeightBucket({n: changed[n].to(device) for n in first}, 0),
                       WeightBucket({later: changed[later].to(device),
                                     "model.no_such_layer.weight": original[later].to(device)}, 1)])
        try:
            with pytest.raises(WeightError, match="unknown weight") as caught:
                rollout_engine.update_weights(stream)
            assert "applied" in str(caught.value), "the error must say how many weights were applied before it"
            out = rollout_engine.generate(PROMPTS, GREEDY)
            diff = reference_logprob_diff(gearshift_model, out, {**original, **{n: changed[n] for n in first}},
                                          rollout_engine.weight_spec())
        finally:
            self._restore(rollout_engine, original)
        assert diff <= self.logprob_atol, "the first bucket must stay applied and none of the bad one land"

    def test_a_tied_head_is_taken_under_either_name(self, rollout_engine, original, baseline):
        spec = rollout_engine.weight_spec()
        if not spec.aliases:
            pytest.skip("the model has no tied weights")
        alias, name = next(iter(spec.aliases.items()))
        changed = perturbed({name: original[name]})
        rollout_engine.update_weights([WeightBucket({alias: changed[name].to(rollout_engine.device)})])
        try:
            renamed = rollout_engine.generate(PROMPTS, GREEDY)
            rollout_engine.update_weights([WeightBucket({name: changed[name].to(rollout_engine.device)})])
            direct = rollout_engine.generate(PROMPTS, GREEDY)
        finally:
            self._restore(rollout_engine, original)
        assert same_outputs(renamed, direct) and max_logprob_diff(renamed, direct) == 0.0
        assert not same_outputs(baseline, direct) or max_logprob_diff(baseline, direct) > 1e-3

    def test_generate_while_asleep_is_a_clear_error(self, rollout_engine, baseline):
        rollout_engine.sleep(["kv_cache"])
        try:
            with pytest.raises(RolloutError, match="asleep"):
                rollout_engine.generate(PROMPTS, GREEDY)
        finally:
            rollout_engine.wake(["kv_cache"])
        assert same_outputs(baseline, rollout_engine.generate(PROMPTS, GREEDY))

    def test_update_while_the_weights_sleep_is_a_clear_error(self, rollout_engine, original, baseline):
        rollout_engine.sleep(["kv_cache", "weights"])
        try:
            with pytest.raises(RolloutError, match="asleep"):
                rollout_engine.update_weights(as_buckets(original, rollout_engine.device))
        finally:
            rollout_engine.wake(["weights", "kv_cache"])
            self._restore(rollout_engine, original)
        assert same_outputs(baseline, rollout_engine.generate(PROMPTS, GREEDY))

    def test_sleep_wake_round_trip(self, rollout_engine, baseline, original):
        rollout_engine.sleep(["kv_cache"])
        rollout_engine.wake(["kv_cache"])
        assert same_outputs(baseline, rollout_engine.generate(PROMPTS, GREEDY))
        rollout_engine.sleep(["kv_cache", "weights"])
        rollout_engine.wake(["weights"])
        self._restore(rollout_engine, original)
        rollout_engine.wake(["kv_cache"])
        again = rollout_engine.generate(PROMPTS, GREEDY)
        assert same_outputs(baseline, again)
        assert max_logprob_diff(baseline, again) == 0.0

    def test_sleep_frees_memory(self, rollout_engine, original):
        awake = rollout_engine.resident_bytes()
        assert awake, "the engine does not report resident_bytes(), so released memory cannot be checked"
        assert awake.get("weights", 0) > 0
        rollout_engine.sleep(["kv_cache", "weights"])
        try:
            asleep = rollout_engine.resident_bytes()
            assert asleep["weights"] <= 0.1 * awake["weights"], f"sleep kept {asleep} of {awake}"
            assert asleep.get("kv_cache", 0) <= 0.1 * max(awake.get("kv_cache", 0), 1)
        finally:
            rollout_engine.wake(["weights", "kv_cache"])
            self._restore(rollout_engine, original)
        assert rollout_engine.resident_bytes()["weights"] >= 0.9 * awake["weights"]

    def test_empty_request_list_is_a_clear_error(self, rollout_engine, baseline):
        with pytest.raises(RolloutError, match="empty"):
            rollout_engine.generate([], GREEDY)
        assert same_outputs(baseline, rollout_engine.generate(PROMPTS, GREEDY))

    def test_prompt_longer_than_context_is_a_clear_error(self, rollout_engine, baseline):
        too_long = [65] * (rollout_engine.max_model_len + 1)
        with pytest.raises(RolloutError, match="context"):
            rollout_engine.generate([too_long], GREEDY)
        assert same_outputs(baseline, rollout_engine.generate(PROMPTS, GREEDY))

    def test_bad_weights_are_refused_and_old_ones_kept(self, rollout_engine, baseline, original):
        (name, tensor), (other, good) = list(original.items())[:2]
        changed = perturbed({other: good})  # travels beside the bad weight: must not be applied either
        with pytest.raises(WeightError, match="unknown weight"):
            rollout_engine.update_weights(
                as_buckets({**changed, "model.no_such_layer.weight": tensor}, rollout_engine.device, per_bucket=8))
        bad_shape = {**changed, name: tensor.new_zeros(tensor.shape[0] + 1, *tensor.shape[1:])}
        with pytest.raises(WeightError, match="shape"):
            rollout_engine.update_weights(as_buckets(bad_shape, rollout_engine.device, per_bucket=8))
        again = rollout_engine.generate(PROMPTS, GREEDY)
        assert same_outputs(baseline, again)
        assert max_logprob_diff(baseline, again) == 0.0
