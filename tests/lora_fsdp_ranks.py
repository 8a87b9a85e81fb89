"""Checks of LoRA on sharded weights, run on every rank under torchrun by test_lora_fsdp.py."""

import pytest
import torch

from gearshift import dist as gdist
from gearshift.conformance.train import fixed_batch, full_weights, nll
from gearshift.module_train import position_ids
from gearshift.train import token_logprobs

from gearshift_fsdp.engine import FSDPTrainEngine

LORA = {"lora_r": 4, "lora_alpha": 8, "param_dtype": "float32"}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_sharded_adapters_export_the_merged_weights(gearshift_model):
    engine = FSDPTrainEngine.build(gearshift_model, lr=1e-2, **LORA)
    for _ in range(3):
        engine.train_step(fixed_batch(), nll)
    layer = engine.hf_model.model.layers[0].mlp.down_proj
    a, b = (_full(m["default"].weight.detach()) for m in (layer.lora_A, layer.lora_B))
    assert a.shape == (4, 128) and b.shape == (64, 4)
    want = _full(layer.base_layer.weight.detach()) + (b @ a) * 2.0
    exported = full_weights(engine)
    torch.testing.assert_close(exported["model.layers.0.mlp.down_proj.weight"], want, rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="gathered"):  # sharded factors are read only once gathered
        engine.local_weights(["model.layers.0.self_attn.q_proj.weight"])


def test_adapter_written_by_two_ranks_loads_with_peft(gearshift_model, gearshift_shared_tmp):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = FSDPTrainEngine.build(gearshift_model, lr=1e-2, **LORA)
    for _ in range(2):
        engine.train_step(fixed_batch(), nll)
    engine.save_hf(str(gearshift_shared_tmp / "lora-export"))
    batch = fixed_batch()
    ours = engine.forward_logprobs(batch).logprobs.cpu()
    if gdist.rank() == 0:
        base = AutoModelForCausalLM.from_pretrained(gearshift_model, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(gearshift_shared_tmp / "lora-export" / "adapter"))
        with torch.no_grad():
            out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=position_ids(batch.attention_mask))
        theirs = token_logprobs(out.logits, batch.input_ids).logprobs
        mask = batch.attention_mask.bool()
        assert float((theirs - ours)[mask].abs().max()) < 1e-5
    gdist.barrier()


def test_gather_whole_with_uneven_and_empty_shards():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gearshift.lora import gather_whole

    mesh = init_device_mesh("cpu", (gdist.world_size(),))
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(shape, generator=g) for shape in [(3, 5), (1, 4), (5, 3), (2,), (4, 2)]]
    sharded = [distribute_tensor(t, mesh, [Shard(0)]) for t in whole[:4]] + [whole[4]]  # and one not sharded
    for got, want in zip(gather_whole(sharded), whole):
        assert torch.equal(got, want)


def test_checkpoint_holds_the_adapters_only_and_resumes(gearshift_model, gearshift_shared_tmp):
    from torch.distributed.checkpoint import FileSystemReader

    from gearshift.conformance.train import assert_same

    path = str(gearshift_shared_tmp / "lora-ckpt")
    engine = FSDPTrainEngine.build(gearshift_model, lr=1e-2, **LORA)
    batch = fixed_batch()
    for _ in range(2):
        engine.train_step(batch, nll)
    engine.save(path)
    saved = full_weights(engine)
    next_loss = engine.train_step(batch, nll)["loss"]

    keys = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    frozen = {n for n, p in engine.model.named_parameters() if not p.requires_grad}
    trained = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert frozen and not {f"model.{n}" for n in frozen} & keys, "the frozen base is the model, not the state"
    assert {f"model.{n}" for n in trained} <= keys
    assert any(k.startswith("optimizer.") for k in keys)

    fresh = FSDPTrainEngine.build(gearshift_model, lr=1e-2, **LORA)  # the base again, adapters from the folder
    fresh.load(path)
    assert_same(full_weights(fresh), saved)
    assert fresh.train_step(batch, nll)["loss"] == pytest.approx(next_loss, rel=1e-5)

    plain = FSDPTrainEngine.build(gearshift_model, lr=1e-2, param_dtype="float32")
    with pytest.raises(RuntimeError, match="does not hold this engine's model"):
        plain.load(path)
