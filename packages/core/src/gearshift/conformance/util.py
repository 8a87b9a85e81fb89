"""Helpers the conformance classes share: reference weights and log-probabilities from the model folder."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from .. import dist as gdist
from ..mesh import box_slices
from ..stored import stored_layout
from ..weights import WeightBucket, WeightSpec

PROMPTS = [[72, 101, 108, 108, 111], [49, 43, 50, 61], [84, 104, 101, 32, 113, 117, 105, 99, 107]]

#: compute dtype -> (log-probability tolerance, relative tolerance of a loss computed two ways); float32 keeps
#: each suite's own. bfloat16's 8 bits of mantissa move a random 0.5B model's logprobs by up to a few tenths
#: between kernels and batch shapes (seen on an H200 with vLLM and FSDP)
TOLERANCES = {torch.float32: (0.0, 1e-5), torch.float16: (0.1, 2e-3), torch.bfloat16: (0.5, 1e-2)}


def compute_dtype(engine) -> torch.dtype:
    """The least precise dtype an engine computes in: a trainer's `compute_dtype` (its master dtype when it
    says none), a rollout engine's weights'."""
    from ..rollout import RolloutEngine

    if isinstance(engine, RolloutEngine):
        dtypes = {p.dtype for p in engine.weight_spec()}
    else:
        dtypes = {engine.compute_dtype or engine.args.torch_dtype}
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def tolerances(*engines) -> tuple[float, float]:
    """(logprob atol, loss rtol) for engines computing in their dtypes: those of the least precise."""
    least = max((compute_dtype(e) for e in engines), key=lambda d: torch.finfo(d).eps)
    return TOLERANCES.get(least, TOLERANCES[torch.bfloat16])


def widen_for_dtype(suite, request, *engines) -> None:
    """Raise the suite's `logprob_atol` (and `loss_rtol`) to what the engines' compute dtype allows, unless
    `--gearshift-atol` set the log-probability tolerance (it wins)."""
    atol, rtol = tolerances(*engines)
    given = request.config.getoption("--gearshift-atol", default=None)
    suite.logprob_atol = given if given is not None else max(type(suite).logprob_atol, atol)
    suite.loss_rtol = max(getattr(type(suite), "loss_rtol", 1e-5), rtol)


def saved_weights(model_path: str) -> dict[str, torch.Tensor]:
    """Every tensor in the folder's safetensors files, in the form transformers holds them (`gearshift.stored`)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return dict(stored_layout(str(model_path)).from_stored(state.items()))


def reference_weights(model_path: str, spec: WeightSpec, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The weights saved in `model_path`, cut to this rank's part of `spec`, in its dtypes.

    A weight the file holds under another name of a tied pair (`spec.aliases`) is found under it.
    """
    rank = gdist.rank() if rank is None else rank
    state = saved_weights(model_path)
    others = {}
    for alias, name in spec.aliases.items():
        others.setdefault(name, []).append(alias)
    out = {}
    for p in spec:
        key = next((k for k in [p.name, *others.get(p.name, [])] if k in state), None)
        if key is None:  # a tied head the file stores once, under the embedding's name
            key = next(k for k in state if k.endswith("embed_tokens.weight") or k.endswith("wte.weight"))
        box = p.placement.local_box(p.shape, rank)
        out[p.name] = state[key][box_slices(box)].to(p.dtype).contiguous()
    return out


@lru_cache(maxsize=2)
def _reference_model(model_path: str):
    from ..hf import load_causal_lm

    model = load_causal_lm(model_path, torch.float32).eval()
    return model, {k: v.detach().clone() for k, v in model.named_parameters()}


def whole_weights(spec: WeightSpec, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full tensors of `local` (this rank's slices of `spec`'s weights), put together from every rank's slice
    (a collective when any weight is sliced; every rank calls it)."""
    if all(spec.by_name()[n].placement.is_replicated() for n in local) or not gdist.is_distributed():
        return local
    import torch.distributed as dist

    mine = {n: (spec.by_name()[n].placement.local_box(spec.by_name()[n].shape, gdist.rank()), t.detach().cpu())
            for n, t in local.items()}
    everyone = [None] * gdist.world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for n, t in local.items():
        full = torch.empty(spec.by_name()[n].shape, dtype=t.dtype)
        for pieces in everyone:
            box, piece = pieces[n]
            full[box_slices(box)] = piece
        out[n] = full
    return out


@torch.no_grad()
def reference_logprob_diff(model_path: str, rollouts, weights: dict[str, torch.Tensor] | None = None,
                           spec: WeightSpec | None = None) -> float:
    """Max |rollout logprob - transformers' temperature-1 logprob| of the sampled tokens, in fp32, with
    `weights` in place of the folder's: full tensors by parameter name, or this rank's slices of `spec`'s
    weights (put together from every rank's: then every rank calls it)."""
    if weights is not None and spec is not None:
        weights = whole_weights(spec, weights)
    model, original = _reference_model(model_path)
    params = dict(model.named_parameters())
    for name, tensor in {**original, **(weights or {})}.items():
        if name in params:
            params[name].copy_(tensor.to("cpu", torch.float32))
    worst = 0.0
    for r in rollouts:
        ids = torch.tensor([list(r.prompt_ids) + list(r.token_ids)])
        logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.token_ids)[:, None]).squeeze(-1)
        worst = max(worst, float((ref - torch.tensor(r.logprobs)).abs().max()))
    return worst


def long_prompts(max_model_len: int, count: int = 2) -> list[list[int]]:
    """Prompts long enough to fill several blocks of any prefix cache (CPU vLLM caches 128-token blocks)."""
    length = max(8, min(300, max_model_len - 16))
    return [[32 + (7 * i + 3 * j) % 90 for i in range(length)] for j in range(count)]


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


def private_overrides(cls: type, base: type) -> list[str]:
    """Methods and properties named with one underscore that `cls` (or a class between it and `base`) defines
    over `base`'s: a backend built on the core's classes extends them through public names only (the ABC
    machinery's own `_abc_impl` is no hook)."""
    between = cls.__mro__[:cls.__mro__.index(base)]
    return sorted({n for klass in between for n, v in vars(klass).items()
                   if n.startswith("_") and not n.startswith("__") and hasattr(base, n)
                   and (callable(v) or isinstance(v, (property, staticmethod, classmethod)))})
