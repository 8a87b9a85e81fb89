"""Contracts of a (train, rollout) pair switched by `HybridActor`.

Fixtures to supply: `train_engine` and `rollout_engine`, both fp32 and built
from `gearshift_model` (any scope; tests train the engine further, and each
test builds its own `HybridActor`, so the engines are left in train mode).
Set `train_backend` and `rollout_backend` to the engines' classes: their
`conformance_xfail["pair"]` marks the tests the pair is known to fail.
"""

from __future__ import annotations

import json

import pytest
import torch

from .. import dist as gdist
from ..hybrid import HybridActor, ModeError
from ..reshard import AdapterResharder, NaiveResharder, StreamingResharder, plan_reshard
from ..rollout import SamplingParams
from ..train import TrainBatch
from ..weights import WeightError, WeightSpec
from ..train import nll_loss as nll
from .train import fixed_batch
from .util import PROMPTS, max_logprob_diff, same_outputs, widen_for_dtype

# sampled below temperature 1: the rollout engine must still report the model's own logprobs
SAMPLE = SamplingParams(n=2, temperature=0.7, max_tokens=8, seed=3)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def train_logprob_diff(train, rollouts) -> float:
    """Max |rollout logprob - train logprob| over the sampled tokens (an episode's: the model's own)."""
    batch = TrainBatch.from_sequences([r.prompt_ids for r in rollouts], [r.token_ids for r in rollouts])
    lp = train.forward_logprobs(batch).logprobs.cpu()
    diff = 0.0
    for i, r in enumerate(rollouts):
        start = len(r.prompt_ids)
        mine = lp[i, start:start + len(r.token_ids)]
        model = torch.tensor(r.extra.get("loss_mask", [1] * len(r.token_ids)), dtype=torch.bool)
        diff = max(diff, float(((mine - torch.tensor(r.logprobs)).abs() * model).max()))
    return diff


class _TwoTurns:
    """An environment answering the first turn with a fixed text, ending the episode after the second."""

    def reset(self, row):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        return " ok, and? ", self.turns >= 2, None


class PairSuite:
    """Subclass in a test module and supply `train_engine` and `rollout_engine`."""

    train_backend: type | None = None
    rollout_backend: type | None = None
    logprob_atol: float = 1e-4

    @pytest.fixture
    def train_engine(self):
        raise NotImplementedError(
            f"{type(self).__name__} must supply the fixture train_engine: a float32 train engine built from "
            f"gearshift_model (lr 1e-2 suits the suite), e.g.\n"
            f"    @pytest.fixture(scope='class')\n    @classmethod\n"
            f"    def train_engine(cls, gearshift_model):\n        return MyTrainer.build(gearshift_model, lr=1e-2)")

    @pytest.fixture
    def rollout_engine(self):
        raise NotImplementedError(
            f"{type(self).__name__} must supply the fixture rollout_engine: a float32 rollout engine built from "
            f"gearshift_model, e.g.\n    @pytest.fixture(scope='class')\n    @classmethod\n"
            f"    def rollout_engine(cls, gearshift_model):\n        return MyEngine.build(gearshift_model)")

    @pytest.fixture(autouse=True)
    def _dtype_tolerance(self, request, train_engine, rollout_engine):
        widen_for_dtype(self, request, train_engine, rollout_engine)

    @pytest.fixture
    def actor(self, train_engine, rollout_engine):
        actor = HybridActor(train_engine, rollout_engine)
        yield actor
        actor.set_mode("train")

    def test_after_sync_rollout_logprobs_agree_with_training(self, actor, record_property):
        actor.to_rollout()
        out = actor.generate(PROMPTS, SAMPLE)
        actor.to_train()
        diff = train_logprob_diff(actor.train, out)
        record_property("max_abs_logprob_diff", diff)
        print(f"rollout vs train logprobs after sync: max abs diff {diff:.3g}")
        assert diff <= self.logprob_atol

    def test_a_two_turn_episodes_logprobs_agree_with_training(self, actor, gearshift_model, record_property):
        """An episode's model tokens after an environment's answer: the engine's logprobs are the trainer's over
        the whole episode, in one forward pass."""
        from transformers import AutoTokenizer

        from ..rl.agent import Agent, AgentConfig

        tokenizer = AutoTokenizer.from_pretrained(gearshift_model)
        agent = Agent(AgentConfig(environment=_TwoTurns, max_turns=2, max_tokens=32), tokenizer,
                      max_model_len=actor.rollout.max_model_len)
        actor.to_rollout()
        out = agent.run(actor.generate, [{"prompt": "p"}] * len(PROMPTS), PROMPTS, SAMPLE)
        actor.to_train()
        assert all(x.extra["turns"] == 2 and 0 in x.extra["loss_mask"] for x in out)
        diff = train_logprob_diff(actor.train, out)
        record_property("max_abs_logprob_diff_episode", diff)
        assert diff <= self.logprob_atol

    def test_a_train_step_reaches_the_rollout_engine(self, actor):
        actor.to_rollout()
        before = actor.generate(PROMPTS, GREEDY)
        actor.to_train()
        for _ in range(3):
            actor.train_step(fixed_batch(), nll)
        actor.to_rollout()
        after = actor.generate(PROMPTS, GREEDY)
        actor.to_train()
        assert not same_outputs(before, after) or max_logprob_diff(before, after) > 1e-4
        assert train_logprob_diff(actor.train, after) <= self.logprob_atol

    def test_naive_copying_and_sharing_resharders_agree(self, train_engine, rollout_engine, gearshift_shared_tmp):
        results = []
        for resharder in (StreamingResharder(share=False), NaiveResharder(directory=str(gearshift_shared_tmp)),
                          StreamingResharder()):
            actor = HybridActor(train_engine, rollout_engine, resharder)
            report = actor.to_rollout()
            results.append(actor.generate(PROMPTS, GREEDY))
            actor.to_train()
            if not actor.plan.share:
                assert report.phase("load").bytes > 0
        for other in results[1:]:
            assert same_outputs(results[0], other)
            assert max_logprob_diff(results[0], other) == 0.0

    def test_sharing_is_used_exactly_when_the_plan_allows(self, train_engine, rollout_engine):
        actor = HybridActor(train_engine, rollout_engine)
        why = StreamingResharder.share_refusal(actor.plan, train_engine, rollout_engine)
        assert actor.plan.share == (why is None)
        if why is None:
            before = rollout_engine.resident_bytes().get("weights")
            actor.to_rollout()
            if before is not None:  # borrowed weights are the trainer's memory, not the engine's
                assert rollout_engine.resident_bytes()["weights"] == 0
            actor.to_train()
        else:
            with pytest.raises(WeightError, match="cannot share"):
                HybridActor(train_engine, rollout_engine, StreamingResharder(share=True))

    @pytest.mark.parametrize("share", [None, False], ids=["default", "copy"])
    def test_switch_report_times_every_phase(self, train_engine, rollout_engine, share, tmp_path):
        actor = HybridActor(train_engine, rollout_engine, StreamingResharder(share=share))
        report = actor.to_rollout()
        names = [p.name for p in report.phases]
        for phase in ("export", "wake_kv_cache", "reset_cache"):
            assert phase in names
        if actor.plan.share:
            assert "wake_weights" not in names and report.phase("share").bytes == 0
        else:
            assert "wake_weights" in names
            assert report.phase("load").bytes == actor.plan.bytes_received(gdist.rank())
        assert all(p.seconds >= 0 for p in report.phases)
        back = actor.to_train()
        assert back.phase("sleep") is not None
        assert actor.to_rollout().phase("export") is not None  # the same plan serves every switch
        actor.to_train()
        assert "total" in report.table()
        report.write_json(tmp_path / "r.json")
        assert json.loads((tmp_path / "r.json").read_text())["bytes"] == report.bytes
        report.write_chrome_trace(tmp_path / "trace.json")

    def test_mismatched_weights_fail_at_plan_time(self, train_engine, rollout_engine):
        spec = rollout_engine.weight_spec()
        extra = WeightSpec(spec.mesh, spec.params + (spec.params[0].__class__(
            "model.no_such.weight", (3,), torch.float32, spec.params[0].placement),))
        with pytest.raises(WeightError, match="does not have"):
            plan_reshard(train_engine.weight_spec(), extra)

    @pytest.mark.parametrize("share", [None, False], ids=["default", "copy"])
    def test_switch_latency_within_budget(self, train_engine, rollout_engine, share, gearshift_shared_tmp, request,
                                          record_property):
        from .. import registry
        from ..bench import measure_pair
        from ..budgets import budget_for

        train_name = registry.name_of("train", type(train_engine)) or type(train_engine).__name__
        rollout_name = registry.name_of("rollout", type(rollout_engine)) or type(rollout_engine).__name__
        device = "cuda" if train_engine.device.type == "cuda" else "cpu"
        budget = budget_for(device, train_name, rollout_name).with_overrides(
            request.config.getoption("--gearshift-budget"))
        if share is False and not HybridActor(train_engine, rollout_engine).plan.share:
            pytest.skip("this pair copies by default: the default case measured it")
        def measure(times: int):
            return measure_pair(train_engine, rollout_engine, switches=5 * times, naive_switches=3 * times,
                                naive_dir=str(gearshift_shared_tmp), labels=(train_name, rollout_name, "suite"),
                                share=share)

        bench = measure(1)
        limit = budget.limit(bench.copy_s, bench.engine_load_s)
        # every rank measures again, or none does: the measuring is collective with several ranks
        if not gdist.all_ranks(bench.sync_s <= limit and bench.naive_s >= budget.m * bench.sync_s):
            # medians of a few switches on a busy machine: measured again, with three times the switches,
            # before the budget is judged (on a tiny model sync and naive can be milliseconds apart)
            print(bench.table())
            bench = measure(3)
        print(bench.table())
        for key, value in {"sync_s": bench.sync_s, "naive_s": bench.naive_s, "copy_s": bench.copy_s,
                           "engine_load_s": bench.engine_load_s}.items():
            record_property(key, value)
        limit = budget.limit(bench.copy_s, bench.engine_load_s)
        assert bench.sync_s <= limit, (
            f"sync {bench.sync_s:.4f}s is over the budget {limit:.4f}s = {budget.k} x max(copy {bench.copy_s:.4f}s, "
            f"engine load {bench.engine_load_s:.4f}s) + {budget.overhead_s}s")
        assert bench.naive_s >= budget.m * bench.sync_s, (
            f"the naive resharder ({bench.naive_s:.4f}s) is not {budget.m}x slower than sync ({bench.sync_s:.4f}s)")

    def test_adapter_sync_serves_the_trainers_policy(self, train_engine, rollout_engine):
        """Where the pair can sync a LoRA adapter alone (a LoRA trainer, a rollout engine built with
        `max_lora_rank`): logprobs agree as after a full sync, a train step reaches the rollout
        engine through the adapter, only the adapter's bytes move, and a full sync after it serves
        the same policy (the adapter is dropped, not applied twice)."""
        why = AdapterResharder.refusal(train_engine, rollout_engine)
        if why is not None:
            pytest.skip(f"no adapter sync for this pair: {why}")
        actor = HybridActor(train_engine, rollout_engine, AdapterResharder())
        rounds = []
        try:
            for _ in range(2):
                report = actor.to_rollout()
                rounds.append(actor.generate(PROMPTS, SAMPLE))
                actor.to_train()
                assert train_logprob_diff(train_engine, rounds[-1]) <= self.logprob_atol
                assert 0 < report.phase("load").bytes == train_engine.export_adapter().nbytes
                assert report.phase("load").bytes < actor.plan.bytes_received(gdist.rank())
                for _ in range(3):  # the next round serves an adapter trained further
                    actor.train_step(fixed_batch(), nll)
            full = HybridActor(train_engine, rollout_engine, StreamingResharder(share=False))
            full.to_rollout()
            merged = full.generate(PROMPTS, SAMPLE)
            full.to_train()
            actor.to_rollout()  # and back: the adapter on the model the engine was built from again
            again = actor.generate(PROMPTS, SAMPLE)
            actor.to_train()
        finally:
            actor.set_mode("train")
        for older, newer in zip(rounds, rounds[1:] + [merged]):  # each round's training reached the engine
            assert not same_outputs(older, newer) or max_logprob_diff(older, newer) > 1e-4
        for out in (merged, again):
            assert train_logprob_diff(train_engine, out) <= self.logprob_atol
        assert same_outputs(merged, again) and max_logprob_diff(merged, again) <= self.logprob_atol

    def test_using_the_wrong_mode_is_a_clear_error(self, actor):
        with pytest.raises(ModeError, match="train mode"):
            actor.generate(PROMPTS, GREEDY)
        actor.to_rollout()
        with pytest.raises(ModeError, match="rollout mode"):
            actor.train_step(fixed_batch(), nll)
