"""One rank of a torchrun job for test_parallel.py: `parallel_ranks.py MODEL MESH [MESH ...]`.

For each mesh, an fsdp engine takes one step on the batch share of its dp index
(the ranks of a tp or sp group get the same rows), and every rank compares the
loss and every gradient with the same step computed
here in one process by plain transformers: the mean over the dp shares of each
share's gradient (what data parallelism averages). Prints `RESULT {json}` per mesh.
"""

import json
import sys

import torch

from gearshift import dist as gdist
from gearshift.conformance.util import reference_weights
from gearshift.mesh import MeshSpec
from gearshift.module_train import position_ids
from gearshift.train import TrainBatch, nll_loss, token_logprobs

LR = 1e-2
# rows of different lengths (padding inside a micro-batch), the widest 11 tokens: odd, so sp=2 pads it
PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 50, 61], [84, 104, 101, 32, 113, 117, 105], [40, 41, 42]]
RESPONSES = [[10, 20, 30, 40, 50, 60], [60, 70, 80], [90, 100, 110, 120], [7, 8, 9, 10, 11]]


def global_batch(padded: bool = True) -> TrainBatch:
    """Rows of different lengths (padding inside a micro-batch), or all cut to 8 tokens (none: a causal
    attention without a mask)."""
    if padded:
        return TrainBatch.from_sequences(PROMPTS, RESPONSES, pad_id=0)
    rows = [(p + r)[:8] for p, r in zip(PROMPTS, RESPONSES)]
    return TrainBatch.from_sequences([r[:3] for r in rows], [r[3:] for r in rows], pad_id=0)


def share(batch: TrainBatch, index: int, parts: int) -> TrainBatch:
    size = batch.size // parts
    return batch.select(slice(index * size, (index + 1) * size))


def reference_step(model_path: str, dp: int, padded: bool):
    """Loss and gradients of the dp-averaged loss, in one process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.config.use_cache = False
    batch, losses = global_batch(padded), []
    for d in range(dp):
        mb = share(batch, d, dp)
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                    position_ids=position_ids(mb.attention_mask), use_cache=False)
        loss, _ = nll_loss(token_logprobs(out.logits, mb.input_ids, True), mb)
        (loss / dp).backward()
        losses.append(float(loss))
    return sum(losses) / dp, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def check(model_path: str, mesh: MeshSpec, padded: bool = True) -> dict:
    from gearshift_fsdp.engine import FSDPTrainEngine

    engine = FSDPTrainEngine.build(model_path, mesh=mesh, lr=LR, param_dtype="float32", max_grad_norm=None,
                                   keep_grads=True)
    spec = engine.weight_spec()
    saved = reference_weights(model_path, spec)  # the folder's weights cut as the spec says this rank holds them
    local = engine.local_weights(spec.names())
    slices_ok = all(torch.equal(local[n], saved[n]) for n in spec.names())
    dp_index = mesh.coords(gdist.rank())["dp"]
    metrics = engine.train_step(share(global_batch(padded), dp_index, mesh.dp), nll_loss)
    grads = {n: full(p.grad).detach() for n, p in engine.trained.items()}
    shapes_ok = all(tuple(local[p.name].shape) == p.placement.local_shape(p.shape, gdist.rank()) for p in spec)
    sharded = sorted(p.name for p in spec if "tp" in str(p.placement))
    engine.close()
    loss, ref_grads = reference_step(model_path, mesh.dp, padded)

    def worst(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in b)

    return {"mesh": str(mesh), "padded": padded, "rank": gdist.rank(), "loss": metrics["loss"], "ref_loss": loss,
            "grad_diff": worst(grads, ref_grads), "grad_scale": max(float(g.abs().max()) for g in ref_grads.values()),
            "same_names": sorted(grads) == sorted(ref_grads),
            "shapes_ok": shapes_ok, "slices_ok": slices_ok, "tp_sharded": len(sharded),
            "placements": {p.name: str(p.placement) for p in spec}}


def main() -> None:
    model_path, meshes = sys.argv[1], sys.argv[2:]
    gdist.init("gloo")
    torch.manual_seed(0)
    for text in meshes:
        for padded in (True, False):
            print("RESULT " + json.dumps(check(model_path, MeshSpec.parse(text), padded)), flush=True)
    gdist.barrier()


if __name__ == "__main__":
    main()
