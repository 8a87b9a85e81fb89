"""Helpers the conformance classes share."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import dist as gdist
from ..mesh import box_slices
from ..weights import WeightBucket, WeightSpec

PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 50, 61], [84, 104, 101, 32, 113, 117, 105, 99, 107]]


def reference_weights(model_path: str, spec: WeightSpec, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The weights saved in `model_path`, cut to this rank's part of `spec`, in its dtypes."""
    from safetensors.torch import load_file

    rank = gdist.rank() if rank is None else rank
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    out = {}
    for p in spec:
        box = p.placement.local_box(p.shape, rank)
        out[p.name] = state[p.name][box_slices(box)].to(p.dtype).contiguous()
    return out


def perturbed(weights: dict[str, torch.Tensor], scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=torch.float32).to(v.dtype) for k, v in weights.items()}


def as_buckets(weights: dict[str, torch.Tensor], device: torch.device, per_bucket: int = 4) -> list[WeightBucket]:
    items = list(weights.items())
    return [
        WeightBucket({k: v.to(device) for k, v in items[i:i + per_bucket]}, i // per_bucket)
        for i in range(0, len(items), per_bucket)
    ]


def same_outputs(a, b) -> bool:
    return [r.token_ids for r in a] == [r.token_ids for r in b]


def max_logprob_diff(a, b) -> float:
    diffs = [abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra.logprobs, rb.logprobs)]
    return max(diffs, default=0.0)
