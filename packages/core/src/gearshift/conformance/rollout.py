"""Contracts of a `RolloutEngine`.

Fixtures to supply: `rollout_engine` (built from `gearshift_model`, fp32; any
scope: every test leaves it serving the model's own weights, awake) and, when
the engine was built from another folder, `gearshift_model`.
"""

from __future__ import annotations

import pytest

from ..rollout import RolloutError, SamplingParams
from ..weights import WeightError
from .util import PROMPTS, as_buckets, max_logprob_diff, perturbed, reference_weights, same_outputs

GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=8)


class RolloutEngineSuite:
    """Subclass in a test module and supply `rollout_engine`."""

    expected_failures: dict[str, str] = {}

    @pytest.fixture
    def original(self, rollout_engine, gearshift_model):
        return reference_weights(gearshift_model, rollout_engine.weight_spec())

    @pytest.fixture
    def baseline(self, rollout_engine):
        return rollout_engine.generate(PROMPTS, GREEDY)

    def _restore(self, engine, original) -> None:
        engine.update_weights(as_buckets(original, engine.device))

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
