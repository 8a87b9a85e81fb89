"""Tiny models of two architectures, built locally, load like any Hugging Face model."""

import pytest
import torch

from gearshift.models import PRESETS, build_model, resolve_model


@pytest.mark.parametrize("arch,cls", [("qwen2", "Qwen2ForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_built_models_load_through_auto_classes(tmp_path, arch, cls):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_model(tmp_path / arch, preset="tiny", arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == cls
    ids = tok("12+7=", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "12+7="
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


def test_same_recipe_same_weights_and_reuse(tmp_path):
    from safetensors.torch import load_file

    a = build_model(tmp_path / "a", preset="tiny", seed=3)
    b = build_model(tmp_path / "b", preset="tiny", seed=3)
    wa, wb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    stamp = tmp_path / "a" / "model.safetensors"
    before = stamp.stat().st_mtime_ns
    build_model(tmp_path / "a", preset="tiny", seed=3)  # the same recipe is not rebuilt
    assert stamp.stat().st_mtime_ns == before


def test_presets_and_errors(tmp_path):
    assert {"tiny", "small", "bench100m", "qwen2-0.5b"} <= set(PRESETS)
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # a folder is taken as is
    with pytest.raises(ValueError, match="neither a folder nor a preset"):
        resolve_model("no-such-model", cache_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown architecture"):
        build_model(tmp_path / "x", arch="gpt9")
