"""LoRA (through peft, from the base) under ZeRO: only the adapters train, exports merge them, save_hf writes both.

At stage 3 the frozen base weights are partitioned like any other, so an export gathers
each bucket's bases and their adapters' factors, and save_hf gathers the factors for the
adapter folder. Runs in one process here and with two under torchrun (test_two_processes.py,
--runslow); the suite and the pair with LoRA are slow.
"""

import json

import pytest
import torch
from gearshift import dist as gdist
from gearshift import registry
from gearshift.backends.hf_rollout import HFRolloutEngine
from gearshift.conformance import PairSuite, TrainEngineSuite
from gearshift.conformance.train import fixed_batch, full_weights, nll
from gearshift.module_train import position_ids
from gearshift.train import token_logprobs

from gearshift_deepspeed.engine import DeepSpeedTrainEngine

pytest.importorskip("peft")

LORA = {"lora_r": 4, "lora_alpha": 8, "param_dtype": "float32"}


def hf_logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=position_ids(batch.attention_mask))
    return token_logprobs(out.logits, batch.input_ids).logprobs


@pytest.mark.slow
class TestZero3LoraTrain(TrainEngineSuite):
    train_backend = DeepSpeedTrainEngine

    @pytest.fixture
    def train_engine_factory(self, gearshift_model):
        return lambda **kw: DeepSpeedTrainEngine.build(gearshift_model, **{"zero_stage": 3, **LORA, **kw})


@pytest.mark.slow
class TestZero3LoraWithHFRollout(PairSuite):
    train_backend, rollout_backend = DeepSpeedTrainEngine, HFRolloutEngine

    @pytest.fixture(scope="class")
    def train_engine(self, gearshift_model):
        engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=3, **LORA)
        yield engine
        engine.close()

    @pytest.fixture(scope="class")
    def rollout_engine(self, gearshift_model):
        return HFRolloutEngine.build(gearshift_model)


@pytest.mark.parametrize("stage", [2, 3])
def test_lora_trains_like_the_torch_backend_and_only_the_adapters_move(gearshift_model, stage):
    batch = fixed_batch()
    engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=stage, **LORA)
    before = full_weights(engine)
    for _ in range(2):
        engine.train_step(batch, nll)
    trainable = [n for n, p in engine.ds.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    after = full_weights(engine)
    adapted = set(engine.lora.adapted())
    assert all(torch.equal(after[n], before[n]) for n in after if n not in adapted)  # frozen bases, no adapter
    assert any(not torch.equal(after[n], before[n]) for n in adapted)
    got = engine.forward_logprobs(batch).logprobs
    if gdist.world_size() == 1:  # the torch backend runs in one process only; with more, every rank has this batch
        reference = registry.create("train", "torch", model=gearshift_model, lr=1e-2, lora_r=4, lora_alpha=8)
        for _ in range(2):
            reference.train_step(batch, nll)
        diff = float((reference.forward_logprobs(batch).logprobs - got)[batch.attention_mask.bool()].abs().max())
        print(f"FIGURE zero_stage={stage} LoRA: logprobs after two steps vs the torch backend: max abs diff {diff:.3g}")
        assert diff <= 1e-5


def test_zero3_save_hf_writes_the_merged_model_and_the_adapter_peft_loads(gearshift_model, gearshift_shared_tmp):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=3, **LORA)
    for _ in range(2):
        engine.train_step(fixed_batch(), nll)
    path = gearshift_shared_tmp / "lora-out"
    engine.save_hf(str(path))
    batch = fixed_batch()
    mask = batch.attention_mask.bool()
    ours = engine.forward_logprobs(batch).logprobs
    merged = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert float((hf_logprobs(merged, batch) - ours)[mask].abs().max()) < 1e-5
    config = json.loads((path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    base = AutoModelForCausalLM.from_pretrained(gearshift_model, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(path / "adapter"))
    assert float((hf_logprobs(with_adapter, batch) - ours)[mask].abs().max()) < 1e-5


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_holds_the_adapters_only_and_resumes(gearshift_model, gearshift_shared_tmp, stage):
    path = str(gearshift_shared_tmp / f"lora-ckpt-{stage}")
    batch = fixed_batch()
    engine = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=stage, **LORA)
    for _ in range(2):
        engine.train_step(batch, nll)
    engine.save(path)
    saved = full_weights(engine)
    next_loss = engine.train_step(batch, nll)["loss"]
    tied_head = engine.hf_model.config.tie_word_embeddings
    engine.close()

    states = torch.load(next((gearshift_shared_tmp / f"lora-ckpt-{stage}" / "gearshift").glob("*model_states.pt")),
                        map_location="cpu", weights_only=False)
    kept = set(states["module"] or {}) | set(states.get("frozen_param_fragments") or {})
    # DeepSpeed leaves out frozen parameters by their named_parameters() name; a tied head's other name stays
    tied = {"lm_head.weight"} if tied_head else set()
    assert any(".lora_A." in n for n in kept)
    assert all(".lora_A." in n or ".lora_B." in n for n in kept - tied), sorted(kept - tied)[:5]

    fresh = DeepSpeedTrainEngine.build(gearshift_model, lr=1e-2, zero_stage=stage, **LORA)
    fresh.load(path)
    got = full_weights(fresh)
    assert got.keys() == saved.keys() and all(torch.equal(got[n], saved[n]) for n in saved)
    assert fresh.train_step(batch, nll)["loss"] == pytest.approx(next_loss, rel=1e-5)
    fresh.close()
