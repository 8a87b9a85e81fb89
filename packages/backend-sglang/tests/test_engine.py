"""What the sglang backend adds to the suite: sampling details, the update path, memory release, the host."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gearshift.conformance.util import PROMPTS, as_buckets, perturbed, reference_logprob_diff, reference_weights
from gearshift.rollout import RolloutError, SamplingParams
from gearshift.weights import WeightBucket, WeightError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def tokens(rollouts):
    return [r.token_ids for r in rollouts]


def test_same_seed_same_samples_and_samples_differ(serving_model_weights):
    engine = serving_model_weights
    sampling = SamplingParams(n=4, temperature=1.0, top_k=50, max_tokens=12, seed=11)
    first, again = engine.generate(PROMPTS, sampling), engine.generate(PROMPTS, sampling)
    assert tokens(first) == tokens(again)
    assert len({tuple(r.token_ids) for r in first if r.prompt_index == 0}) > 1, "the n samples of a prompt differ"
    unseeded = SamplingParams(n=4, temperature=1.0, max_tokens=12)
    assert tokens(engine.generate(PROMPTS, unseeded)) != tokens(engine.generate(PROMPTS, unseeded))


def test_a_call_without_logprobs_asks_sglang_for_none(serving_model_weights, monkeypatch):
    engine = serving_model_weights
    asked = []
    generate = engine._engine.generate
    monkeypatch.setattr(engine._engine, "generate", lambda **kw: asked.append(kw["return_logprob"]) or generate(**kw))
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3)
    full, bare = engine.generate(PROMPTS, sampling), engine.generate(PROMPTS, replace(sampling, logprobs=False))
    assert asked == [True, False]
    assert tokens(bare) == tokens(full) and all(r.logprobs == [] for r in bare)


def test_unseeded_sampling_leaves_the_host_generators_alone(serving_model_weights):
    import random

    torch.manual_seed(5)
    random.seed(5)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(5)
    random.seed(5)
    serving_model_weights.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=6))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_stop_strings_end_generation(serving_model_weights, gearshift_model):
    engine = serving_model_weights
    free = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24))[0]
    stop = engine._tokenizer.decode(free.token_ids[3:5])
    if not stop.strip() or stop not in free.text:
        pytest.skip("the greedy completion has no printable two-token piece to stop on")
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=24, stop=(stop,)))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < len(free.token_ids)
    assert stop not in out.text
    assert reference_logprob_diff(gearshift_model, [out]) <= 1e-4


def test_max_tokens_is_capped_by_the_context(serving_model_weights):
    engine = serving_model_weights
    prompt = [65] * (engine.max_model_len - 3)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50))[0]
    assert len(out.token_ids) <= 3


def test_update_error_from_sglang_is_a_weight_error_and_the_engine_keeps_serving(serving_model_weights, monkeypatch):
    engine = serving_model_weights
    baseline = engine.generate(PROMPTS, GREEDY)
    refusal = (False, "refused for the test")
    monkeypatch.setattr(engine._engine, "update_weights_from_tensor", lambda *a, **k: refusal)
    monkeypatch.setattr(engine, "_landed", None)  # direct_load=False: the update goes through SGLang's call
    assert engine.load_path.startswith("flattened buckets")
    with pytest.raises(WeightError, match="refused for the test"):
        engine.update_weights(as_buckets(reference_weights(engine.model_path, engine.weight_spec()), engine.device))
    monkeypatch.undo()
    assert tokens(engine.generate(PROMPTS, GREEDY)) == tokens(baseline)


def test_a_bucket_layout_the_scheduler_never_received_is_refused_and_the_engine_keeps_serving(
        serving_model_weights):
    engine = serving_model_weights
    baseline = engine.generate(PROMPTS, GREEDY)
    with pytest.raises(AssertionError, match="never received"):
        engine._engine.collective_rpc("gearshift_load", payload="", buffer=engine._flat.buffer_id, layout=10**6,
                                      update=engine._updates)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == tokens(baseline)


def _record_calls(engine, monkeypatch) -> list:
    """(name, what was loaded, the flush asked) of every call the engine makes into SGLang from now on."""
    calls = []
    for name in ("begin_weight_update", "update_weights_from_tensor", "collective_rpc", "end_weight_update",
                 "flush_cache"):
        real = getattr(engine._engine, name)
        monkeypatch.setattr(engine._engine, name, lambda *a, _real=real, _name=name, **k: (calls.append(
            (_name, a[:1] if _name == "collective_rpc" else k.get("load_format"),
             k.get("flush" if _name == "collective_rpc" else "flush_cache"))), _real(*a, **k))[1])
    return calls


@pytest.mark.parametrize("direct", [True, False])
def test_one_flush_per_update_after_the_last_bucket(serving_model_weights, gearshift_model, monkeypatch, direct):
    engine = serving_model_weights
    if not direct:
        monkeypatch.setattr(engine, "_landed", None)  # direct_load=False
    calls = _record_calls(engine, monkeypatch)
    buckets = as_buckets(reference_weights(gearshift_model, engine.weight_spec()), engine.device, per_bucket=3)
    assert len(buckets) > 2
    engine.update_weights(iter(buckets))
    names = [c[0] for c in calls]
    if direct:  # the tiny model's buckets go as one group, and that call flushes the cache in the scheduler after
        assert calls == [("collective_rpc", ("gearshift_load",), True)]
        return
    sessions = ["begin_weight_update"] if engine._sessions else []
    load = "update_weights_from_tensor"
    assert names == sessions + [load] * len(buckets) + ["end_weight_update"] * len(sessions) + ["flush_cache"]
    assert all(c[1:] == ("flattened_bucket", False) for c in calls if c[0] == load)


def test_a_scheduler_that_cannot_flush_after_the_load_leaves_the_flush_to_the_host(serving_model_weights,
                                                                                  gearshift_model, monkeypatch):
    from gearshift_sglang.direct import NOT_FLUSHED

    engine = serving_model_weights
    original = reference_weights(gearshift_model, engine.weight_spec())
    real = engine._engine.collective_rpc

    def busy(method, flush=False, **kwargs):  # loads, then answers as a scheduler still winding a batch down
        real(method, flush=False, **kwargs)
        if flush:
            raise AssertionError(NOT_FLUSHED)

    monkeypatch.setattr(engine._engine, "collective_rpc", busy)
    calls = _record_calls(engine, monkeypatch)
    engine.update_weights(iter(as_buckets(perturbed(original), engine.device)))
    assert [c[0] for c in calls] == ["collective_rpc", "flush_cache"]
    monkeypatch.undo()
    engine.update_weights(iter(as_buckets(original, engine.device)))


def test_an_update_while_the_kv_cache_sleeps_flushes_nothing(serving_model_weights, gearshift_model, monkeypatch):
    engine = serving_model_weights
    engine.sleep(["kv_cache"])  # flushes the prefix cache; nothing can fill it until it wakes
    try:
        calls = _record_calls(engine, monkeypatch)
        engine.update_weights(iter(as_buckets(reference_weights(gearshift_model, engine.weight_spec()),
                                              engine.device)))
        assert calls == [("collective_rpc", ("gearshift_load",), False)]
    finally:
        monkeypatch.undo()
        engine.wake(["kv_cache"])


def test_own_load_is_sglangs_per_tensor_update_and_restores_the_outputs(serving_model_weights, gearshift_model,
                                                                        monkeypatch):
    """The switch bench's baseline: SGLang's update_weights_from_tensor with named tensors, as its users call it."""
    from gearshift.bench.switch import OwnLoad

    engine = serving_model_weights
    assert isinstance(engine, OwnLoad)
    baseline = engine.generate(PROMPTS, GREEDY)
    reference = reference_weights(gearshift_model, engine.weight_spec())
    engine.update_weights(as_buckets(perturbed(reference), engine.device))
    assert tokens(engine.generate(PROMPTS, GREEDY)) != tokens(baseline)
    formats, real = [], engine._engine.update_weights_from_tensor
    monkeypatch.setattr(engine._engine, "update_weights_from_tensor", lambda named, **k: (
        formats.append((k.get("load_format"), type(named[0]))), real(named, **k))[1])
    buckets = as_buckets(reference, engine.device, per_bucket=3)
    assert engine.own_load(iter(buckets)) == sum(b.nbytes for b in buckets)
    assert formats == [(None, tuple)] * len(buckets)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == tokens(baseline)


def test_released_memory_round_trip_through_sglang(serving_model_weights, gearshift_model):
    """With release_memory on, sleep and wake go through SGLang's release/resume (which free nothing on CPU)."""
    engine = serving_model_weights
    baseline = engine.generate(PROMPTS, GREEDY)
    before, engine.release_memory = engine.release_memory, True
    try:
        engine.sleep(["kv_cache", "weights"])
        assert engine._released == {"kv_cache", "weights"}
        with pytest.raises(RolloutError, match="asleep"):
            engine.update_weights([WeightBucket({})])
        engine.wake(["weights"])
        engine.update_weights(as_buckets(reference_weights(gearshift_model, engine.weight_spec()), engine.device))
        engine.wake(["kv_cache"])
        assert not engine._released
        again = engine.generate(PROMPTS, GREEDY)
    finally:
        engine.release_memory = before
    assert tokens(again) == tokens(baseline)
    assert [r.logprobs for r in again] == [r.logprobs for r in baseline]


def test_weights_asleep_only_drop_the_prefix_cache(serving_model_weights, gearshift_model):
    engine = serving_model_weights
    prompts = [list(range(30, 30 + engine.max_model_len // 2))]
    engine.generate(prompts, GREEDY)
    original = reference_weights(gearshift_model, engine.weight_spec())
    changed = perturbed(original)
    engine.sleep(["weights"])
    engine.wake(["weights"])
    engine.update_weights(as_buckets(changed, engine.device))
    diff = reference_logprob_diff(gearshift_model, engine.generate(prompts, GREEDY), changed)
    assert diff <= 1e-4


def test_no_kernel_stand_in_op_was_called(serving_model_weights, kernel_trace):
    """The CPU path (everything the tests above ran) calls none of the sgl_kernel names the stand-in holds."""
    from gearshift_sglang import kernel

    if kernel.real_kernel_available() or torch.cuda.is_available():
        pytest.skip("a real sgl_kernel is in use")
    serving_model_weights.generate(PROMPTS, SamplingParams(n=2, temperature=0.8, top_p=0.9, max_tokens=8, seed=1))
    calls = kernel_trace.read_text().split() if kernel_trace.exists() else []
    assert not calls, f"SGLang called stand-in ops: {calls}"


def test_host_state_is_put_back(serving_model_weights, host_before_engine):
    import asyncio
    import multiprocessing
    import signal

    serving_model_weights.generate(PROMPTS, GREEDY)
    before = host_before_engine
    assert signal.getsignal(signal.SIGTERM) is before["sigterm"]
    assert multiprocessing.get_start_method(True) == before["start_method"]
    assert type(asyncio.get_event_loop_policy()) is before["policy"]
    changed = {k for k in set(os.environ) ^ set(before["environ"]) | {k for k in before["environ"]
               if os.environ.get(k) != before["environ"][k]} if not k.startswith("SGLANG_")}
    assert changed <= {"GEARSHIFT_SGL_KERNEL_TRACE", "PYTEST_CURRENT_TEST"}, f"variables left changed: {sorted(changed)}"
    assert torch.get_num_threads() == before["threads"]
    cache = Path(serving_model_weights.cache_dir)
    assert (cache / "tmp").is_dir()
