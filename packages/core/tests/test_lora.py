"""LoRA through peft on the reference trainer: what trains, what is exported, and the contracts with an adapter."""

import json

import pytest
import torch

pytest.importorskip("peft")

from gearshift.backends.hf_rollout import HFRolloutEngine  # noqa: E402
from gearshift.backends.torch_train import TorchTrainEngine  # noqa: E402
from gearshift.conformance import PairSuite, TrainEngineSuite  # noqa: E402
from gearshift.conformance.train import fixed_batch, full_weights, nll  # noqa: E402
from gearshift.module_train import position_ids  # noqa: E402
from gearshift.train import token_logprobs  # noqa: E402

LORA = {"lora_r": 4, "lora_alpha": 8}


class TestTorchLoraTrain(TrainEngineSuite):
    train_backend = TorchTrainEngine

    @pytest.fixture
    def train_engine_factory(self, gearshift_model):
        return lambda **kw: TorchTrainEngine.build(gearshift_model, **{**LORA, **kw})


class TestTorchLoraHFPair(PairSuite):
    train_backend, rollout_backend = TorchTrainEngine, HFRolloutEngine

    @pytest.fixture(scope="class")
    @classmethod
    def train_engine(cls, gearshift_model):
        return TorchTrainEngine.build(gearshift_model, lr=1e-2, **LORA)

    @pytest.fixture(scope="class")
    @classmethod
    def rollout_engine(cls, gearshift_model):
        return HFRolloutEngine.build(gearshift_model)


def _logprobs(model, batch) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=position_ids(batch.attention_mask))
    return token_logprobs(out.logits, batch.input_ids).logprobs


def test_only_the_adapters_train_and_hold_optimizer_state(gearshift_model):
    full = TorchTrainEngine.build(gearshift_model, lr=1e-2)
    lora = TorchTrainEngine.build(gearshift_model, lr=1e-2, **LORA)
    trainable = {n: p for n, p in lora.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in lora.model.named_parameters() if not p.requires_grad}
    in_optimizer = {id(p) for group in lora.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in trainable.values()}
    for _ in range(2):
        lora.train_step(fixed_batch(), nll)
        full.train_step(fixed_batch(), nll)
    assert {id(p) for p in lora.optimizer.state} <= in_optimizer
    state_numel = sum(v.numel() for st in lora.optimizer.state.values() for v in st.values() if v.dim())
    assert state_numel == 2 * sum(p.numel() for p in trainable.values())  # Adam's two moments, adapters only
    full_numel = sum(v.numel() for st in full.optimizer.state.values() for v in st.values() if v.dim())
    assert state_numel < full_numel / 2
    for n, p in lora.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), f"frozen {n} moved"


def test_weight_spec_lists_the_base_weights_under_hugging_face_names(gearshift_model):
    full = TorchTrainEngine.build(gearshift_model)
    lora = TorchTrainEngine.build(gearshift_model, **LORA)
    assert lora.weight_spec().names() == full.weight_spec().names()
    assert dict(lora.weight_spec().aliases) == dict(full.weight_spec().aliases)
    assert [p.shape for p in lora.weight_spec()] == [p.shape for p in full.weight_spec()]
    assert not any("lora" in n or "base_layer" in n for n in lora.weight_spec().names())


def test_export_merges_each_adapter_into_its_weight(gearshift_model):
    engine = TorchTrainEngine.build(gearshift_model, lr=1e-2, lora_r=4, lora_alpha=12,
                                    lora_target_modules=["q_proj", "down_proj"])
    engine.train_step(fixed_batch(), nll)
    layer = engine.hf_model.model.layers[1].mlp.down_proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    want = layer.base_layer.weight + (b @ a) * (12 / 4)
    exported = full_weights(engine)
    torch.testing.assert_close(exported["model.layers.1.mlp.down_proj.weight"], want.detach(), rtol=0, atol=1e-6)
    assert torch.equal(exported["model.layers.1.mlp.up_proj.weight"],  # not targeted: the base itself
                       engine.hf_model.model.layers[1].mlp.up_proj.weight.detach())
    adapted = [n for n in exported if "q_proj.weight" in n or "down_proj.weight" in n]
    assert sorted(engine.lora.adapted()) == sorted(adapted)


def test_save_hf_writes_the_merged_model_and_the_adapter_peft_loads(gearshift_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = TorchTrainEngine.build(gearshift_model, lr=1e-2, **LORA)
    for _ in range(3):
        engine.train_step(fixed_batch(), nll)
    engine.save_hf(str(tmp_path / "out"))
    batch = fixed_batch()
    mask = batch.attention_mask.bool()
    ours = engine.forward_logprobs(batch).logprobs
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert float((_logprobs(merged, batch) - ours)[mask].abs().max()) < 1e-5
    config = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["base_model_name_or_path"] == gearshift_model
    base = AutoModelForCausalLM.from_pretrained(gearshift_model, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, str(tmp_path / "out" / "adapter"))
    assert float((_logprobs(with_adapter, batch) - ours)[mask].abs().max()) < 1e-5


def test_checkpoint_holds_the_adapters_not_the_base(gearshift_model, tmp_path):
    engine = TorchTrainEngine.build(gearshift_model, lr=1e-2, **LORA)
    engine.train_step(fixed_batch(), nll)
    engine.save(str(tmp_path / "ckpt"))
    state = torch.load(tmp_path / "ckpt" / "train_state.pt", weights_only=True)
    assert state["model"] and all(".lora_" in k for k in state["model"])
    resumed = TorchTrainEngine.build(gearshift_model, lr=1e-2, **LORA)
    resumed.load(str(tmp_path / "ckpt"))
    batch = fixed_batch()
    assert resumed.train_step(batch, nll)["loss"] == pytest.approx(engine.train_step(batch, nll)["loss"], rel=1e-6)
    other = TorchTrainEngine.build(gearshift_model, lr=1e-2, lora_r=4, lora_target_modules=["q_proj"])
    with pytest.raises(RuntimeError, match="LoRA adapters"):
        other.load(str(tmp_path / "ckpt"))


def test_a_critic_with_lora_trains_its_adapters_and_value_head(gearshift_model):
    critic = TorchTrainEngine.build(gearshift_model, lr=1e-2, value_head=True, **LORA)
    trainable = [n for n, p in critic.model.named_parameters() if p.requires_grad]
    assert {n for n in trainable if ".lora_" not in n} == {"value_head.weight", "value_head.bias"}
    assert "lm.model.layers.0.self_attn.q_proj.weight" in critic.weight_spec().names()


def test_lora_mistakes_are_clear_errors(gearshift_model):
    with pytest.raises(ValueError, match="no_such_proj"):
        TorchTrainEngine.build(gearshift_model, lora_r=4, lora_target_modules=["no_such_proj"])
    with pytest.raises(ValueError, match="tied to"):  # the tiny model's head is its embedding
        TorchTrainEngine.build(gearshift_model, lora_r=4, lora_target_modules=["lm_head"])


def test_grpo_with_lora_checkpoints_resumes_and_exports(gearshift_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from gearshift import Trainer
    from gearshift.rl.checkpoint import latest

    def reward(completion):  # a random model earns it too, so advantages are not all zero
        return len(completion) / 3

    sections = dict(rollout={"n": 4, "max_tokens": 3, "backend": "hf"}, train={"backend": "torch", "lr": 1e-2},
                    run={"steps": 2, "prompts_per_step": 4, "output_dir": str(tmp_path / "run"),
                         "checkpoint_every": 1, "progress": False, "samples_per_step": 0, "tensorboard": False,
                         "plot": False, "resume": "auto"})
    first = Trainer(model={"path": gearshift_model, "lora": {"r": 4, "alpha": 8}}, reward=reward, **sections)
    history = first.train()
    assert history[0]["mismatch/logprob_max"] < 1e-4  # the merged weights the rollout got agree with training
    state = torch.load(latest(tmp_path / "run" / "checkpoints") / "policy" / "train_state.pt", weights_only=True)
    assert state["model"] and all(".lora_" in k for k in state["model"])
    first.save(str(tmp_path / "export"))
    assert (tmp_path / "export" / "adapter" / "adapter_model.safetensors").exists()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"))
    policy = first.controller.policy
    torch.testing.assert_close(dict(merged.named_parameters())["model.layers.0.self_attn.q_proj.weight"],
                               full_weights(policy)["model.layers.0.self_attn.q_proj.weight"])
    sections["run"]["steps"] = 3
    resumed = Trainer(model={"path": gearshift_model, "lora": {"r": 4, "alpha": 8}}, reward=reward, **sections)
    assert len(resumed.train()) == 1 and resumed.controller.step == 3  # went on from step 2


def test_lora_config_keys_and_mistakes():
    from gearshift.rl.config import ConfigError, load_config

    cfg = load_config(None, ["model.lora.r=8", "model.lora.alpha=32", "model.lora.target_modules=[q_proj,v_proj]"])
    assert cfg.model.lora.train_options() == {"lora_r": 8, "lora_alpha": 32, "lora_dropout": 0.0,
                                              "lora_target_modules": ["q_proj", "v_proj"]}
    assert load_config(None, []).model.lora.train_options() == {}  # r=0: the trainer gets no LoRA option
    with pytest.raises(ConfigError, match=r"model.lora.r=-1.*\n.*model.lora.dropout=1.5"):
        load_config(None, ["model.lora.r=-1", "model.lora.dropout=1.5"]).validate()


def test_adapter_sync_mistakes_are_clear_errors(gearshift_model, tmp_path):
    from gearshift import Trainer
    from gearshift.reshard import AdapterResharder
    from gearshift.rl.config import ConfigError, load_config
    from gearshift.weights import WeightError

    assert load_config(None, ["model.lora.r=8", "model.lora.sync=adapter"]).resharder() == "adapter"
    assert load_config(None, ["model.lora.r=8"]).resharder() == "stream"
    for overrides, message in ((["model.lora.sync=adapter"], "needs LoRA: set model.lora.r"),
                               (["model.lora.r=8", "model.lora.sync=both"], "use merged or adapter"),
                               (["model.lora.r=8", "model.lora.sync=adapter", "switch.share=on"], "cannot serve from"),
                               (["model.lora.r=8", "model.lora.sync=adapter", "switch.resharder=naive"],
                                "not switch.resharder='naive'")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides).validate()
    # a rollout backend that serves no adapters: refused before any engine is built
    with pytest.raises(ConfigError, match="rollout.backend=hf cannot serve LoRA adapters"):
        Trainer(model={"path": gearshift_model, "lora": {"r": 4, "sync": "adapter"}}, rollout={"backend": "hf"},
                train={"backend": "torch"}, run={"output_dir": str(tmp_path / "run")}).train()
    with pytest.raises(ValueError, match="HFRolloutEngine cannot serve LoRA adapters"):
        HFRolloutEngine.build(gearshift_model, max_lora_rank=4)
    # the resharder says why a pair cannot take the adapter alone
    lora = TorchTrainEngine.build(gearshift_model, **LORA)
    plain = TorchTrainEngine.build(gearshift_model)
    rollout = HFRolloutEngine.build(gearshift_model)
    assert "cannot serve LoRA adapters" in AdapterResharder.refusal(lora, rollout)
    with pytest.raises(WeightError, match="cannot sync the adapter alone"):
        AdapterResharder().plan(lora, rollout)
    assert plain.export_adapter() is None and plain.lora_rank == 0
    adapter = lora.export_adapter()
    assert adapter.rank == 4 and adapter.config["lora_alpha"] == 8
    assert adapter.nbytes == sum(p.numel() * 4 for n, p in lora.model.named_parameters() if ".lora_" in n)
    assert set(adapter.tensors) == set(__import__("safetensors.torch").torch.load_file(
        adapter.write(tmp_path / "adapter") / "adapter_model.safetensors"))
