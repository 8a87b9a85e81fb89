"""One rank of a two-process run (torchrun), for test_distributed.py: `two_ranks.py dp|tp MODEL CACHE_DIR`.

The weights reach the engines the way a sharded trainer sends them: each rank
holds half of every weight (dim 0, as FSDP does), the core's resharder plans
the moves to the rollout layout and streams them point to point over gloo.
Prints one line `RESULT {json}` per rank.
"""

import json
import math
import sys

import torch

from gearshift import dist as gdist
from gearshift.conformance.util import PROMPTS, perturbed, reference_weights
from gearshift.mesh import MeshSpec, Placement, box_slices
from gearshift.reshard import plan_reshard, stream_plan
from gearshift.rollout import SamplingParams
from gearshift.weights import ParamSpec, WeightSpec

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def transformers_diff(model_path, rollouts, state):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(state, strict=False)
    worst = 0.0
    with torch.no_grad():
        for r in rollouts:
            logits = model(torch.tensor([r.prompt_ids + r.token_ids])).logits[0, len(r.prompt_ids) - 1:-1]
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, float((ref - torch.tensor(r.logprobs)).abs().max()))
    return worst


def sync(engine, weights, rank):
    """Stream `weights` into the engine from a train layout that shards every weight over both ranks."""
    train_mesh = MeshSpec(dp=2)
    train = WeightSpec(train_mesh, tuple(ParamSpec(p.name, p.shape, p.dtype, Placement.of(train_mesh, {"dp": 0}))
                                         for p in engine.weight_spec()))
    local = {p.name: weights[p.name][box_slices(p.placement.local_box(p.shape, rank))].clone() for p in train}
    plan = plan_reshard(train, engine.weight_spec(), bucket_bytes=64 << 10)
    return engine.update_weights(stream_plan(plan, lambda names: {n: local[n] for n in names}))


def main() -> None:
    mode, model, cache = sys.argv[1:4]
    gdist.init("gloo")
    rank = gdist.rank()
    from gearshift_vllm import VLLMRolloutEngine

    mesh = MeshSpec(dp=2) if mode == "dp" else MeshSpec(tp=2)
    engine = VLLMRolloutEngine.build(model, mesh=mesh, cache_dir=cache, kv_cache_bytes=64 << 20)
    # dp: each rank serves its own share (of different sizes); tp: both ranks serve the same prompts
    prompts = (PROMPTS[:1] if rank == 0 else PROMPTS[1:]) if mode == "dp" else PROMPTS
    original = reference_weights(model, engine.weight_spec().replicated())  # whole: sync cuts them as trained
    before = engine.generate(prompts, GREEDY)
    changed = perturbed(original, scale=0.05)  # a training-sized change: huge logits would measure fp32 rounding
    loaded = sync(engine, changed, rank)
    after = engine.generate(prompts, GREEDY)
    # tp peers must draw the same samples: unseeded, they rely on the engine's generator being the same on both
    seed = rank if mode == "dp" else None
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=seed))
    sync(engine, original, rank)
    restored = engine.generate(prompts, GREEDY)
    result = {
        "rank": rank, "mode": mode, "mesh": str(engine.mesh), "spec_mesh": str(engine.weight_spec().mesh),
        "prompts": len(prompts), "loaded_bytes": loaded, "spec_bytes": engine.weight_spec().nbytes,
        "local_bytes": sum(p.dtype.itemsize * math.prod(p.placement.local_shape(p.shape, rank))
                           for p in engine.weight_spec()),
        "diff_before": transformers_diff(model, before, {}),
        "diff_after": transformers_diff(model, after + sampled, changed),
        "changed": [r.token_ids for r in after] != [r.token_ids for r in before],
        "restored": [(r.token_ids, r.logprobs) for r in restored] == [(r.token_ids, r.logprobs) for r in before],
        "tokens": [r.token_ids for r in before + sampled],
        "threads": torch.get_num_threads(),
    }
    print("RESULT " + json.dumps(result), flush=True)
    engine.close()
    gdist.barrier()


if __name__ == "__main__":
    main()
