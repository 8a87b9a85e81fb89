"""Model FLOPs from a config agree with what torch's FLOP counter counts in a real forward and backward, for
dense and mixture-of-experts architectures; the device peak table and its override; MFU in a learning step."""

import contextlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.flops import PEAK_ENV, ModelFlops, engine_train_flops, peak_flops, peak_of_name
from gearshift.models.tiny import _config, build_tokenizer, small


def _grouped_mm(a, b, *args, out_shape=None, **kwargs):
    """FLOPs of `torch._grouped_mm` (transformers' fused experts), which torch's counter leaves out: each row
    of the 2-D side meets one expert's matrix, or (the weights' gradient) each expert its own rows."""
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    raise AssertionError(f"a grouped product of shapes {a} and {b}")


def _counted(model, ids: torch.Tensor, backward: bool) -> int:
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: _grouped_mm}) as counter:
        logits = model(input_ids=ids).logits
        if backward:
            logits.float().sum().backward()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


# GQA (qwen2), a head of its own and learned positions (gpt2), multi-query with a parallel block (falcon),
# partial rotary without head_dim (phi), routed experts fused (qwen3_moe) and as modules (mixtral)
@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "falcon", "phi", "qwen3_moe", "mixtral"])
def test_forward_and_train_flops_are_those_torch_counts(tokenizer, arch):
    from transformers import AutoModelForCausalLM

    config = _config(arch, dict(small(), vocab_size=320), tokenizer, "float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # every pair computed
    flops = ModelFlops.of_config(config)
    ids = torch.randint(0, 300, (3, 17))
    assert flops.forward([17] * 3, causal=False) == _counted(model, ids, backward=False)
    assert flops.train([17] * 3, causal=False) == _counted(model, ids, backward=True)


def test_a_causal_forward_counts_the_pairs_its_mask_keeps(tokenizer):
    flops = ModelFlops.of_config(_config("qwen2", small(), tokenizer, "float32"))
    per_token = 2 * (flops.body_params + flops.head_params)
    pair = 4 * flops.attention_width * flops.attention_layers
    assert flops.forward([5]) == per_token * 5 + pair * 15  # 5 x 6 / 2 pairs
    assert flops.forward([5], causal=False) == per_token * 5 + pair * 25
    assert flops.forward([5, 3]) == flops.forward([5]) + flops.forward([3])
    assert flops.forward([5], head=False) == flops.forward([5]) - 2 * flops.head_params * 5
    assert flops.train([5], frozen=True) == 2 * flops.forward([5])


def test_routed_experts_count_at_their_share(tokenizer):
    dense = ModelFlops.of_config(_config("qwen3", small(), tokenizer, "float32"))
    moe = ModelFlops.of_config(_config("qwen3_moe", small(), tokenizer, "float32"))  # 4 experts, 2 a token
    assert moe.head_params == dense.head_params and moe.attention_width == dense.attention_width
    h, i = small()["hidden_size"], small()["intermediate_size"] // 2
    attention = dense.body_params - 3 * h * small()["intermediate_size"] * small()["num_hidden_layers"]
    assert moe.body_params == attention + (2 * 3 * h * i + h * 4) * small()["num_hidden_layers"]


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA H20", 148.0), ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA B200", 2250.0),
    ("Tesla T4", None),
])
def test_the_peak_table_tells_devices_apart(name, tflops):
    assert peak_of_name(name) == (tflops * 1e12 if tflops else None)


def test_the_peak_comes_from_the_environment_when_set(monkeypatch):
    monkeypatch.delenv(PEAK_ENV, raising=False)
    assert peak_flops("cpu") is None
    monkeypatch.setenv(PEAK_ENV, "100")
    assert peak_flops("cpu") == 100e12
    monkeypatch.setenv(PEAK_ENV, "fast")
    with pytest.raises(ValueError, match=PEAK_ENV):
        peak_flops("cpu")


def test_an_engine_counts_lora_and_a_model_without_config(gearshift_model, tmp_path, capsys):
    full = TorchTrainEngine.build(gearshift_model, lr=1e-2)
    lora = TorchTrainEngine.build(gearshift_model, lr=1e-2, lora_r=4, lora_alpha=8)
    flops = ModelFlops.of_model(gearshift_model)
    assert engine_train_flops(full, [7, 9]) == flops.train([7, 9])
    assert engine_train_flops(lora, [7, 9]) == flops.train([7, 9], frozen=True)
    full.args = type(full.args)(**{**full.args.__dict__, "model": str(tmp_path)})  # a folder with no config
    assert engine_train_flops(full, [7]) is None and engine_train_flops(full, [7]) is None
    assert capsys.readouterr().out.count("no model FLOPs") == 1


def test_a_learning_step_reports_its_train_rate_and_mfu_where_the_peak_is_known(gearshift_model, monkeypatch):
    from gearshift.rl.config import build_config
    from gearshift.rl.learner import Learner
    from gearshift.rollout import Rollout

    cfg = build_config(None, {"run": {"prompts_per_step": 2}, "rollout": {"n": 4}})
    kept = [Rollout([40 + i, 43, 49], [50 + j] * (j + 2), [], "length", prompt_index=i, sample_index=j)
            for i in range(2) for j in range(4)]
    rewards = [float(k % 2) for k in range(8)]

    def learn():
        learner = Learner(cfg, TorchTrainEngine.build(gearshift_model, lr=1e-2))
        return learner.learn(kept, rewards, 0, timed=lambda name: contextlib.nullcontext())

    monkeypatch.delenv(PEAK_ENV, raising=False)
    metrics = learn()
    assert metrics["perf/train_tflops"] > 0 and "perf/mfu" not in metrics
    monkeypatch.setenv(PEAK_ENV, "0.001")  # 1 GFLOP/s: the share is the rate over it
    metrics = learn()
    assert metrics["perf/mfu"] == pytest.approx(metrics["perf/train_tflops"] / 0.001, rel=1e-9)
