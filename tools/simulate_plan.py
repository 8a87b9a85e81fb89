"""The reshard plan's traffic at several world sizes, worked out on the CPU without any process group.

    python tools/simulate_plan.py --model qwen2-7b --world 4,8,64

For each world size N, training shards every weight over dp=N (FSDP: dim 0) and the
rollout side wants, per rank, either every weight whole (what vLLM's own loaders take
before cutting for tensor parallelism) or only its tensor-parallel shard (Megatron's
layout: column-parallel weights cut on dim 0, row-parallel ones on dim 1) for tp=2 and
tp=4 with dp=N/tp. The plan is the one `gearshift.reshard.plan_reshard` computes for a
real sync; this prints what it moves: bytes each rank receives and sends, its peers,
its messages per sync (one per peer, dtype and bucket), and the naive alternative
(gather everything on one rank and send it on: what a file round trip does).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from gearshift.mesh import MeshSpec, Placement
from gearshift.models.tiny import PRESETS
from gearshift.reshard import plan_reshard
from gearshift.weights import ParamSpec, WeightSpec

ROW_PARALLEL = ("o_proj", "down_proj")  # cut on their input dimension under tensor parallelism


def shapes(preset: str) -> dict[str, tuple[int, ...]]:
    s = PRESETS[preset]()
    h, i, kv = s["hidden_size"], s["intermediate_size"], s["num_key_value_heads"] * s["head_dim"]
    q = s["num_attention_heads"] * s["head_dim"]
    out = {"model.embed_tokens.weight": (s["vocab_size"], h)}
    for n in range(s["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    out["model.norm.weight"] = (h,)
    return out


def spec(shape_of: dict, mesh: MeshSpec, shard, dtype: torch.dtype) -> WeightSpec:
    return WeightSpec(mesh, tuple(ParamSpec(n, s, dtype, Placement.of(mesh, shard(n, s))) for n, s in shape_of.items()))


def tp_shard(name: str, shape: tuple[int, ...]) -> dict[str, int]:
    if len(shape) < 2 or "embed" in name:
        return {}
    return {"tp": 1 if any(r in name for r in ROW_PARALLEL) else 0}


def simulate(preset: str, world: int, tp: int | None, bucket_mb: int) -> dict:
    shape_of = shapes(preset)
    train = spec(shape_of, MeshSpec(dp=world), lambda n, s: {"dp": 0}, torch.float32)
    if tp is None:  # every rank takes every weight whole
        rollout = spec(shape_of, MeshSpec(dp=world), lambda n, s: {}, torch.bfloat16)
    else:
        rollout = spec(shape_of, MeshSpec(dp=world // tp, tp=tp), tp_shard, torch.bfloat16)
    plan = plan_reshard(train, rollout, bucket_mb << 20)
    model = rollout.nbytes
    lands, received, sent, peers, messages = [], [], [], [], []
    for rank in range(world):
        out, into = plan.peer_bytes(rank)
        lands.append(plan.bytes_received(rank))
        received.append(sum(into.values()))
        sent.append(sum(out.values()))
        peers.append(len(set(out) | set(into)))
        # one message per peer per bucket (and dtype) that carries anything between them
        msgs = 0
        for bucket in plan.buckets:
            talk = {t.dst for n in bucket.names for t in plan.transfers[n] if t.src == rank != t.dst}
            talk |= {t.src for n in bucket.names for t in plan.transfers[n] if t.dst == rank != t.src}
            msgs += len(talk)
        messages.append(msgs)
    return {"world": world, "layout": "whole" if tp is None else f"tp={tp},dp={world // tp}",
            "model_gb": model / 1e9, "lands_gb": max(lands) / 1e9, "recv_gb": max(received) / 1e9, "sent_gb": max(sent) / 1e9,
            "peers": max(peers), "messages": statistics.median(messages), "buckets": len(plan.buckets),
            "naive_gb_rank0": model * world / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2-7b", choices=sorted(PRESETS))
    p.add_argument("--world", default="2,4,8,64")
    p.add_argument("--bucket-mb", type=int, default=128)
    args = p.parse_args()
    print(f"| ranks | rollout layout | lands per rank (GB) | from other ranks (GB) | to other ranks (GB) | "
          f"peers per rank | messages per rank per sync | naive: through rank 0 (GB) |")
    print("|---|---|---|---|---|---|---|---|")
    for world in map(int, args.world.split(",")):
        for tp in (None, 2, 4):
            if tp is not None and world % tp:
                continue
            r = simulate(args.model, world, tp, args.bucket_mb)
            print(f"| {r['world']} | {r['layout']} | {r['lands_gb']:.2f} | {r['recv_gb']:.2f} | {r['sent_gb']:.2f} | "
                  f"{r['peers']} | "
                  f"{r['messages']:.0f} | {r['naive_gb_rank0']:.1f} |", flush=True)
    print(f"\n{args.model}: {r['model_gb']:.2f} GB of bf16 weights, {r['buckets']} buckets of {args.bucket_mb} MiB; "
          f"training fp32 sharded dp=N on dim 0.")


if __name__ == "__main__":
    main()
