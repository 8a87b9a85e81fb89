"""Weights stored otherwise than transformers holds them: mixture-of-experts layers (gearshift.stored)."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from gearshift.hf import routed_experts, weight_spec_of
from gearshift.landing import checkpoint_tensors
from gearshift.mesh import MeshSpec
from gearshift.models import build_model
from gearshift.stored import StoredLayoutError, _pieces, stored_layout


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe(request, tmp_path_factory):
    return build_model(tmp_path_factory.mktemp(request.param), preset="tiny", arch=request.param)


def _held(path):
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())


def test_a_dense_model_is_stored_as_it_is_held(tmp_path):
    assert stored_layout(build_model(tmp_path / "qwen2", preset="tiny")).plain


def test_experts_stored_one_by_one_are_held_stacked_and_cut_back_into_views(moe):
    layout = stored_layout(moe)
    held, disk = _held(moe), load_file(f"{moe}/model.safetensors")
    stacked = [n for n in layout.pieces if n.endswith("experts.gate_up_proj")]
    assert len(stacked) == 2 and all(len(layout.pieces[n]) == 2 * 4 for n in stacked)  # 2 layers, gate + up x 4
    # the folder's tensors assembled: exactly what transformers loaded
    assembled = dict(layout.from_stored(disk.items()))
    assert all(torch.equal(assembled[n], p.detach()) for n, p in held.items())
    # the held tensors cut: exactly the folder's, as views of the held storage (no copy)
    cut = dict(layout.to_stored((n, p.detach()) for n, p in held.items()))
    assert set(disk) <= set(cut) and all(torch.equal(cut[k], disk[k]) for k in disk)
    gate = next(k for k in layout.pieces[stacked[0]]).key
    assert cut[gate].untyped_storage().data_ptr() == held[stacked[0]].untyped_storage().data_ptr()


def test_a_folder_read_for_the_engines_gives_the_spec_names_and_shapes(moe):
    spec = weight_spec_of(moe, MeshSpec(), torch.float32)
    read = dict(checkpoint_tensors(moe, spec))
    assert set(read) == set(spec.names())
    assert all(tuple(read[p.name].shape) == tuple(p.shape) for p in spec)


def test_routed_experts_counts_each_familys_key(moe, tmp_path):
    from transformers import AutoConfig

    assert routed_experts(AutoConfig.from_pretrained(moe)) == 4
    assert routed_experts(AutoConfig.from_pretrained(build_model(tmp_path / "dense", preset="tiny"))) == 0


def test_a_rule_other_than_stacking_and_concatenating_is_refused_naming_the_weights():
    transpose = SimpleNamespace(operations=[type("Transpose", (), {})()])
    members = [(f"experts.{e}.w.weight", 0, e) for e in range(2)]
    shapes = {k: (4, 8) for k, _, _ in members}
    with pytest.raises(StoredLayoutError, match=r"'experts.w'.*\['Transpose'\].*rollout.backend=hf"):
        _pieces("experts.w", transpose, members, shapes, {"experts.w": torch.empty(2, 4, 8, device="meta")})
    stack = SimpleNamespace(operations=[type("MergeModulelist", (), {"dim": 0})()])
    with pytest.raises(StoredLayoutError, match="tile"):  # an expert missing: the pieces would not fill it
        _pieces("experts.w", stack, members[:1], shapes, {"experts.w": torch.empty(2, 4, 8, device="meta")})
    assert len(_pieces("experts.w", stack, members, shapes, {"experts.w": torch.empty(2, 4, 8, device="meta")})) == 2


def test_stacked_experts_land_in_the_engines_own_stack_only_where_it_holds_the_same():
    from torch import nn

    from gearshift.landing import FUSED, landing_views, load_units, verified_landing

    experts = nn.Module()
    experts.routed_experts = nn.Module()  # vLLM 0.32 keeps the stack one level below the layer's module
    experts.routed_experts.w13_weight = nn.Parameter(torch.randn(2, 8, 4))
    experts.routed_experts.w2_weight = nn.Parameter(torch.randn(2, 4, 4))
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.experts = experts
    names = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    units = load_units(names, {n for n, _ in model.named_modules()}, FUSED)
    assert units == {n: "mlp.experts" for n in names}
    views = landing_views(model, names, units, FUSED)
    assert views["mlp.experts.gate_up_proj"].data_ptr() == experts.routed_experts.w13_weight.data_ptr()
    w13, w2 = experts.routed_experts.w13_weight.detach(), experts.routed_experts.w2_weight.detach()
    assert set(verified_landing(views, [(names[0], w13.clone()), (names[1], w2.clone())])) == set(names)
    # an engine that keeps up before gate (or any other order) holds other numbers: that stack goes through its loader
    swapped = torch.cat([w13[:, 4:], w13[:, :4]], dim=1)
    assert set(verified_landing(views, [(names[0], swapped), (names[1], w2.clone())])) == {names[1]}


FAMILIES = {  # more mixture-of-experts families users bring, at tiny shapes
    "Qwen2MoeConfig": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                           shared_expert_intermediate_size=64, decoder_sparse_step=1),
    "OlmoeConfig": dict(num_experts=4, num_experts_per_tok=2),
    "DeepseekV3Config": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                             first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32,
                             qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, n_shared_experts=1),
    "GraniteMoeConfig": dict(num_local_experts=4, num_experts_per_tok=2),
    "PhimoeConfig": dict(num_local_experts=4, num_experts_per_tok=2),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_round_trip_between_their_folder_and_memory(family, tmp_path):
    import transformers
    from transformers import AutoModelForCausalLM

    from gearshift.models.tiny import build_tokenizer, tiny

    tokenizer = build_tokenizer(tmp_path)
    config = getattr(transformers, family)(**tiny(), **FAMILIES[family], rms_norm_eps=1e-6,
                                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    layout = stored_layout(tmp_path)
    assert not layout.plain
    held, disk = _held(str(tmp_path)), load_file(f"{tmp_path}/model.safetensors")
    assembled = dict(layout.from_stored(disk.items()))
    assert all(torch.equal(assembled[n], p.detach()) for n, p in held.items())
    cut = dict(layout.to_stored((n, p.detach()) for n, p in held.items()))
    # what a trainer sends covers every stored parameter (buffers such as DeepSeek's score bias are not sent)
    assert all(torch.equal(cut[k], disk[k]) for k in disk if k in cut)
    assert {k for k in disk if k not in cut} <= {k for k in disk if k.endswith("e_score_correction_bias")}
