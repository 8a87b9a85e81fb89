"""The pieces the engine is made of, each on its own, in one process."""

import pytest
import torch
from gearshift import registry
from gearshift.conformance.util import private_overrides
from gearshift.mesh import MeshError, MeshSpec
from gearshift.module_train import ModuleTrainEngine
from gearshift.sharding import Sharding

from gearshift_fsdp.engine import FSDPTrainEngine
from gearshift.layers import decoder_layers
from gearshift_fsdp.placement import HybridShard
from gearshift_fsdp.sharding import FSDPSharding


def test_registered_as_train_backend_fsdp():
    assert registry.load("train", "fsdp") is FSDPTrainEngine


def test_built_on_the_core_through_public_names_only():
    assert private_overrides(FSDPTrainEngine, ModuleTrainEngine) == []
    assert private_overrides(FSDPSharding, Sharding) == []


def test_hybrid_shard_slices_are_chunks_within_each_group():
    mesh = MeshSpec(dp=4)
    placement = HybridShard(mesh, dim=0, replicate=2)  # ranks (0, 1) and (2, 3) each hold a copy
    full = torch.arange(7 * 3).view(7, 3)
    for rank in range(4):
        (lo, hi), cols = placement.local_box((7, 3), rank)
        assert torch.equal(full[lo:hi], torch.chunk(full, 2)[rank % 2]) and cols == (0, 3)
    assert not placement.is_replicated() and HybridShard(mesh, replicate=4).is_replicated()
    assert placement.local_box((1, 3), 1) == ((1, 1), (0, 3))  # a trailing rank may hold nothing
    with pytest.raises(MeshError, match="must divide"):
        HybridShard(mesh, replicate=3)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_decoder_layers_are_found(tmp_path, arch):
    from gearshift.module_train import ValueHeadModel
    from gearshift.models.tiny import build_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_model(tmp_path / arch, preset="tiny", arch=arch))
    assert decoder_layers(model) == list(model.model.layers)
    assert decoder_layers(ValueHeadModel(model)) == list(model.model.layers)


def test_a_plain_process_gets_a_group_of_one(gearshift_model):
    import torch.distributed as dist

    engine = FSDPTrainEngine.build(gearshift_model, param_dtype="float32", one_rank="fsdp")
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert engine.mesh == MeshSpec(dp=1) and engine.device_mesh.mesh_dim_names == ("dp",)


def test_an_untied_head_is_its_own_weight(tmp_path, gearshift_model):
    from gearshift.conformance.train import assert_same, fixed_batch, full_weights, nll
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gearshift_model, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.copy_(-model.model.embed_tokens.weight)  # the file holds no head: it is new here
    model.save_pretrained(tmp_path / "untied")
    engine = FSDPTrainEngine.build(str(tmp_path / "untied"), lr=1e-2, param_dtype="float32")
    names = engine.weight_spec().names()
    assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
    weights = full_weights(engine)
    assert torch.equal(weights["lm_head.weight"], -weights["model.embed_tokens.weight"])
    losses = [engine.train_step(fixed_batch(), nll)["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    engine.save_hf(str(tmp_path / "saved"))
    loaded = dict(AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved")).named_parameters())
    assert_same(full_weights(engine), {k: loaded[k].detach() for k in names})
