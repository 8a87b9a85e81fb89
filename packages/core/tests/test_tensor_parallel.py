"""The model's own tensor-parallel plan, resolved against its modules (no process group needed)."""

import pytest
import torch

from gearshift.mesh import MeshSpec
from gearshift.tensor_parallel import TensorParallelError, check_divisible, resolve_plan, tp_placement


def causal_lm(tied: bool = True, **shape):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320, tie_word_embeddings=tied, **shape)
    return Qwen2ForCausalLM(config)


def test_the_plan_cuts_the_projections_and_leaves_norms_and_a_tied_head_whole():
    plan = resolve_plan(model := causal_lm(), model)
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert len(plan) == 2 * 7  # q, k, v, o, gate, up, down in each layer
    assert "lm_head" not in plan and not any("norm" in n or "embed" in n for n in plan)
    untied = causal_lm(tied=False)
    assert resolve_plan(untied, untied)["lm_head"] == "colwise_gather_output"


def test_the_plan_is_found_under_a_value_head():
    from gearshift.module_train import ValueHeadModel

    lm = causal_lm()
    plan = resolve_plan(ValueHeadModel(lm), lm)
    assert "lm.model.layers.0.self_attn.o_proj" in plan and len(plan) == 14


def test_heads_that_do_not_divide_and_models_without_a_plan_are_clear_errors():
    check_divisible(causal_lm(), 2)
    with pytest.raises(TensorParallelError, match="tp=4 must divide the model's num_key_value_heads=2"):
        check_divisible(causal_lm(), 4)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    with pytest.raises(TensorParallelError, match="ships no tensor-parallel plan"):
        resolve_plan(gpt2, gpt2)


def test_a_plain_parameter_is_whole_on_the_mesh():
    assert tp_placement(torch.nn.Parameter(torch.zeros(3)), MeshSpec(tp=2)).is_replicated()
