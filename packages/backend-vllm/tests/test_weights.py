"""Weight updates: the spec the trainer fills, streaming, partial updates, and refusing bad input cleanly."""

import gc
import weakref

import pytest
import torch

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.conformance.util import PROMPTS, as_buckets, perturbed, reference_weights, same_outputs
from gearshift.rollout import RolloutError, SamplingParams
from gearshift.weights import WeightBucket, WeightError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LAYER1_MLP = ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
              "model.layers.1.mlp.down_proj.weight"]


@pytest.fixture
def engine(serving_model_weights):
    return serving_model_weights


@pytest.fixture
def original(engine, gearshift_model):
    return reference_weights(gearshift_model, engine.weight_spec())


def test_weight_spec_is_what_the_trainer_holds(engine, gearshift_model):
    mine, theirs = engine.weight_spec(), TorchTrainEngine.build(gearshift_model).weight_spec()
    assert [(p.name, p.shape) for p in mine] == [(p.name, p.shape) for p in theirs]
    assert "lm_head.weight" not in mine.names()  # tied to the embedding in the tiny model
    assert all(p.dtype == torch.float32 and p.placement.is_replicated() for p in mine)
    assert mine.mesh.dp == 1 and mine.mesh.world_size == 1


def test_a_stream_is_taken_bucket_by_bucket(engine, original):
    alive, most = set(), [0]

    def stream():
        for i, (name, tensor) in enumerate(perturbed(original).items()):
            t = tensor.clone()
            alive.add(i)
            weakref.finalize(t, alive.discard, i)
            yield WeightBucket({name: t}, i)
            del t
            gc.collect()
            most[0] = max(most[0], len(alive))

    loaded = engine.update_weights(stream())
    assert loaded == sum(t.numel() * t.element_size() for t in original.values())
    # at most the pieces of one fused layer (q, k, v and their biases) wait for each other (packed layout)
    assert most[0] <= 7 < len(original), f"{most[0]} of {len(original)} tensors were alive at once"


def test_whole_layers_can_be_updated_alone(engine, original, transformers_diff):
    changes = perturbed({k: original[k] for k in ["model.norm.weight", *LAYER1_MLP]})
    engine.update_weights(as_buckets(changes, engine.device))
    out = engine.generate(PROMPTS, GREEDY)
    assert transformers_diff(out, changes) <= 1e-4
    assert transformers_diff(out) > 1e-3  # the change is visible


def test_the_embedding_update_reaches_the_tied_lm_head(engine, original, transformers_diff):
    # packed CPU weights: the lm_head keeps a packed copy of the embedding that a reload leaves stale
    changes = perturbed({"model.embed_tokens.weight": original["model.embed_tokens.weight"]})
    engine.update_weights(as_buckets(changes, engine.device))
    out = engine.generate(PROMPTS, GREEDY)
    assert transformers_diff(out, changes) <= 1e-4


def test_part_of_a_fused_layer_is_refused_and_the_old_weights_kept(engine, original):
    if engine.cpu_weights != "packed":
        pytest.skip("weights written in place (GPU, or plain CPU weights): a part of a fused layer is fine")
    baseline = engine.generate(PROMPTS, GREEDY)
    with pytest.raises(WeightError, match="as a whole"):
        engine.update_weights(as_buckets(perturbed({"model.layers.0.self_attn.q_proj.weight":
                                                    original["model.layers.0.self_attn.q_proj.weight"]}),
                                         engine.device))
    again = engine.generate(PROMPTS, GREEDY)
    assert same_outputs(baseline, again)
    assert [r.logprobs for r in again] == [r.logprobs for r in baseline]


def test_a_bad_bucket_mid_stream_stops_between_layers(engine, original, transformers_diff):
    good = perturbed({"model.norm.weight": original["model.norm.weight"]})
    half = perturbed({LAYER1_MLP[0]: original[LAYER1_MLP[0]]})  # gate without up: must not be applied
    stream = iter([WeightBucket(good, 0), WeightBucket(half, 1),
                   WeightBucket({"model.no_such_layer.weight": torch.zeros(3)}, 2)])
    # written in place (GPU, plain CPU weights): halves too; packed CPU weights: whole layers only
    applied = good if engine.cpu_weights == "packed" else {**good, **half}
    with pytest.raises(WeightError, match=f"unknown weight.*{len(applied)} weights from the buckets before it "
                                          f"were applied"):
        engine.update_weights(stream)
    out = engine.generate(PROMPTS, GREEDY)
    assert transformers_diff(out, applied) <= 1e-4


def test_a_list_is_applied_bucket_by_bucket_like_a_stream(engine, original, transformers_diff):
    good = perturbed({"model.norm.weight": original["model.norm.weight"]})
    bad = {"model.embed_tokens.weight": torch.zeros(3, 3)}
    with pytest.raises(WeightError, match="shape.*1 weights from the buckets before it were applied"):
        engine.update_weights([WeightBucket(good, 0), WeightBucket(bad, 1)])
    assert transformers_diff(engine.generate(PROMPTS, GREEDY), good) <= 1e-4


def test_updating_sleeping_weights_is_refused(engine, original):
    engine.sleep(["weights", "kv_cache"])
    with pytest.raises(RolloutError, match="asleep"):
        engine.update_weights(as_buckets(original, engine.device))
    with pytest.raises(RolloutError, match="asleep"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake(["weights"])
    engine.update_weights(as_buckets(original, engine.device))
    with pytest.raises(RolloutError, match="kv_cache"):
        engine.generate(PROMPTS, GREEDY)
    engine.wake(["kv_cache"])
    assert len(engine.generate(PROMPTS, GREEDY)) == len(PROMPTS)


@pytest.mark.gpu
def test_sleep_releases_device_memory_and_wake_takes_it_back(engine, original):
    held = engine.resident_bytes()
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(["weights", "kv_cache"])
    torch.cuda.synchronize()
    free_asleep = torch.cuda.mem_get_info()[0]
    engine.wake(["weights", "kv_cache"])
    engine.update_weights(as_buckets(original, engine.device))
    free_again = torch.cuda.mem_get_info()[0]
    print(f"device memory: held {held}, freed by sleep {free_asleep - free_awake}, "
          f"taken back {free_asleep - free_again}")
    assert free_asleep - free_awake >= 0.9 * held["kv_cache"]
    assert free_asleep - free_again >= 0.9 * held["kv_cache"]


def test_every_weight_lands_straight_in_vllm_storage_with_the_plain_layout(engine, original, transformers_diff):
    if engine.cpu_weights == "packed":
        assert engine._landing == {}  # every load re-packs: nothing is written around vLLM's loader
        return
    assert set(engine._landing) == set(engine.weight_spec().names())  # fused q/k/v, gate/up, padded vocab
    changed = perturbed(original)
    engine.update_weights(as_buckets(changed, engine.device))
    assert transformers_diff(engine.generate(PROMPTS, GREEDY), changed) <= 1e-4


def test_a_uniform_tensor_lands_directly_only_beside_siblings_that_verified():
    """A zero bias matches a view whatever order vLLM keeps its elements in: it is trusted only if the
    weights of its module were found in place (BLOOM's query_key_value is re-ordered on load)."""
    from gearshift_vllm.weights import verified_landing

    weight = torch.arange(12.0).reshape(6, 2)
    served = {"a.qkv.weight": weight.reshape(2, 3, 2).transpose(0, 1).reshape(6, 2),  # re-ordered rows
              "a.qkv.bias": torch.zeros(6), "a.norm.weight": torch.ones(4),
              "b.proj.weight": weight.clone(), "b.proj.bias": torch.zeros(6)}
    checkpoint = [("a.qkv.weight", weight), ("a.qkv.bias", torch.zeros(6)), ("a.norm.weight", torch.ones(4)),
                  ("b.proj.weight", weight), ("b.proj.bias", torch.zeros(6))]
    assert set(verified_landing(served, checkpoint)) == {"a.norm.weight", "b.proj.weight", "b.proj.bias"}


def test_the_prefix_cache_is_dropped_once_after_generation_however_often_it_is_asked(engine, original):
    calls = []
    reset = engine._llm.reset_prefix_cache
    engine._llm.reset_prefix_cache = lambda *a, **k: calls.append(1) or reset(*a, **k)
    try:
        engine.generate([PROMPTS[0]], GREEDY)
        engine.update_weights(as_buckets(perturbed(original), engine.device))  # drops what the old weights cached
        engine.reset_cache()  # the switch's own reset, right after the sync: nothing was cached since
        assert len(calls) == 1
        changed = engine.generate([PROMPTS[0]], GREEDY)
        engine.update_weights(as_buckets(original, engine.device))
        assert len(calls) == 2
        # what was cached with the perturbed weights is gone: the same prompt gives the original's answer again
        again = engine.generate([PROMPTS[0]], GREEDY)
        engine.update_weights(as_buckets(perturbed(original), engine.device))
        assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids == changed[0].token_ids
        assert len(calls) == 3 and again
    finally:
        del engine._llm.reset_prefix_cache
