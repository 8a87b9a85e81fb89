"""What must leave the device for a switch: offload and sleep only for memory's sake.

On a GPU the train engine's state (params, grads, optimizer) and the rollout
engine's memory (weights unless shared, KV cache) often fit together; then a
switch moves nothing. When they do not, only enough moves, largest first. On
a CPU the train state lives in host memory already: nothing is planned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .hf import routed_experts

GiB = 2**30
MARGIN = 1.1  # room left beyond what is asked for: allocators round, kernels take workspaces


#: the most tokens a micro-batch gets when the budget is worked out from free memory: beyond it a step gains
#: little and single tensors (a micro-batch's logits over a 150k vocabulary: 15 GiB at 25k tokens) grow fragile
MAX_AUTO_TOKENS = 16384
#: tokens per micro-batch on a CPU with nothing asked for. A CPU's compute grows with the tokens computed,
#: padding included: rows packed by length compute fewer, in micro-batches still large enough for full-speed
#: matmuls (the default job's train phase 0.56 -> 0.47 s at 1,024; 256 was slower)
CPU_TOKENS_PER_MICRO_BATCH = 1024


class MemoryPlanError(ValueError):
    """A run that cannot fit in device memory, found before it runs out; the message names what to change."""


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in `obj`: a tensor, or lists, tuples and dicts of them (an engine's KV cache)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        obj = list(obj.values())
    return sum(tensor_bytes(o) for o in obj) if isinstance(obj, (list, tuple)) else 0


def device_free(device: torch.device, *, cached: bool = True) -> int:
    """Bytes a new allocation can take on `device`: free device memory, plus (`cached`) the blocks torch's
    caching allocator holds unused. Only torch's own allocations can reuse those: an engine that maps memory
    through an allocator of its own (vLLM's sleep mode, SGLang's memory saver) gets `cached=False` only."""
    free, _ = torch.cuda.mem_get_info(device)
    if not cached:
        return int(free)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def release_cached(device: torch.device) -> int:
    """Give torch's cached, unused device blocks back to the driver (so that an engine with an allocator of
    its own can map them); returns the bytes released."""
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    return max(int(before - torch.cuda.memory_reserved(device)), 0)


#: device memory a process takes beyond its tensors (the CUDA context, kernels, cuBLAS workspaces): more than
#: this held outside torch's allocator at start is taken to be another process's
CONTEXT_BYTES = 2 * GiB


def held_elsewhere(device: torch.device) -> int:
    """Device bytes in use that torch's allocator in this process does not hold, less a CUDA context: before
    a rollout engine starts, what other processes (a run not ended, a notebook) keep on the device."""
    free, total = torch.cuda.mem_get_info(device)
    return max(int(total - free - torch.cuda.memory_reserved(device)) - CONTEXT_BYTES, 0)


def mlp_width(config) -> tuple[int, int]:
    """(the MLP width one token passes through in a layer, the experts it is routed to): a dense model's
    `intermediate_size`; in a mixture of experts the routed experts' widths (`num_experts_per_tok` of them) plus
    the shared experts', or the dense layers' width where that is wider (models that keep some layers dense)."""
    h = int(config.hidden_size)
    dense = int(getattr(config, "intermediate_size", None) or 4 * h)
    if not routed_experts(config):
        return dense, 0
    k = int(getattr(config, "num_experts_per_tok", None) or 1)
    expert = int(getattr(config, "moe_intermediate_size", None) or dense)
    shared = int(getattr(config, "shared_expert_intermediate_size", None)
                 or (getattr(config, "n_shared_experts", None) or 0) * expert)
    return max(dense, k * expert + shared), k


def activation_bytes_per_token(config, *, training: bool, checkpointing: bool = False,
                               compute_itemsize: int = 2) -> int:
    """Device bytes one token of a micro-batch takes at its peak in a decoder LM's forward (and backward).

    Counted per layer from the tensors autograd keeps (norm inputs and outputs, q/k/v and their rotated
    copies, attention output, the MLP's gate, up, activation and product) at the compute dtype, with
    attention kernels that keep no sequence-squared matrix; plus the output head's logits, kept for backward,
    and their gradient, counted in float32 (the log-probabilities take float32 one chunk of rows at a time,
    gearshift.logprobs: a fixed few hundred MiB, inside the plan's margin). With checkpointing, a layer keeps
    only its input and one layer is recomputed at a time. Without a graph (`training=False`), one layer's tensors
    and the logits are alive at once. An estimate, sized to be above what such a model takes.
    """
    h = int(config.hidden_size)
    layers = int(config.num_hidden_layers)
    vocab = int(config.vocab_size)
    ffn, routed = mlp_width(config)
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    kv = 2 * int(getattr(config, "num_key_value_heads", None) or heads) * head_dim
    c = compute_itemsize
    # the norms keep a float32 copy of their input; a token routed to k experts is copied to each and its output
    # scaled there (about 4 hidden-sized tensors an expert)
    per_layer = c * (12 * h + 3 * kv + 5 * ffn + 4 * routed * h) + 4 * 2 * h
    # the head's logits (kept for backward) and, in backward, their gradient: at 4 bytes each whatever the compute
    # dtype, since some models return their logits in float32
    logits = 4 * vocab * (2 if training else 1)
    if not training:
        return per_layer + logits
    kept = c * h * layers if checkpointing else per_layer * layers
    return kept + (per_layer if checkpointing else 0) + logits


@dataclass
class OffloadPlan:
    tags: tuple[str, ...]
    note: str


def plan_offload(need: int, free: int, sizes: dict[str, int]) -> OffloadPlan:
    """The train tags to move off the device so that `need` more bytes fit beside what stays, largest first."""
    moved: list[str] = []
    room = free
    for tag in sorted(sizes, key=sizes.get, reverse=True):
        if room >= need * MARGIN:
            break
        if sizes[tag] > 0:
            moved.append(tag)
            room += sizes[tag]
    kept = [t for t in sizes if t not in moved and sizes[t] > 0]
    what = f"{free / GiB:.1f} GiB free, rollout needs {need / GiB:.1f} GiB"
    if not moved:
        return OffloadPlan((), f"kept {kept or 'nothing'} on the device ({what})")
    short = " (still short: the rollout engine may not fit)" if room < need * MARGIN else ""
    return OffloadPlan(tuple(moved), f"moved {moved} to host memory ({what}){short}")


def gpu_token_budget(config, device: torch.device, longest: int, *, training: bool, checkpointing: bool,
                     compute_itemsize: int, step_bytes: tuple[int, int], hints: Sequence[str] = (),
                     at_start: bool = False, bf16: bool = False) -> int:
    """Tokens per micro-batch that fit on `device` now, for a model of `config` whose longest row is `longest`
    tokens; `step_bytes` the gradients and the optimizer's update (`ModuleTrainEngine.step_bytes`).

    Free memory less the gradients the backward allocates beside the activations and a margin, over
    `activation_bytes_per_token`. A step whose longest row, or whose optimizer update, does not fit raises
    `MemoryPlanError` naming what can change that: the knobs every trainer has, then the engine's own `hints`.
    `at_start`: asked before the rollout engine exists (`check_train_fits`), so the knobs of its memory and of
    what moves at a switch cannot help and go unnamed; `bf16`: the weights are bfloat16 already.
    """
    per_token = activation_bytes_per_token(config, training=training, checkpointing=checkpointing,
                                           compute_itemsize=compute_itemsize)
    total = torch.cuda.get_device_properties(device).total_memory
    margin = max(int(0.04 * total), GiB)
    # torch's cached blocks are in pieces that a micro-batch's logits (GiBs in one tensor) may not fit:
    # count what the driver has free once they went back
    release_cached(device)
    free = device_free(device, cached=False)
    grads, update = step_bytes
    tokens = (free - grads - margin) // per_token
    if tokens < longest or free < update + margin:
        rows = tokens < longest
        what = (f"rows of {longest} tokens need about {(longest * per_token + grads) / GiB:.1f} GiB"
                if rows else f"the optimizer's update needs {update / GiB:.1f} GiB")
        knobs = ["set train.options.gradient_checkpointing=true",
                 "shorten the rows (rollout.max_tokens, data.max_prompt_len)"] if rows else []
        if not at_start:
            knobs += ["give the rollout engine less memory (rollout.options: gpu_memory_utilization for vllm, "
                      "mem_fraction_static for sglang)",
                      "move the optimizer off the device during rollout (switch.offload=optimizer,grads)"]
        knobs += [] if bf16 else ["train in bfloat16 (model.dtype=bfloat16)"]
        knobs += hints
        where = " (found at start, before the rollout engine took any memory)" if at_start else ""
        others = held_elsewhere(device) if at_start else 0
        if others > GiB:  # the first knob: end what else holds the device
            knobs.insert(0, f"free the {others / GiB:.1f} GiB of the device held outside this run (another "
                            "process? `nvidia-smi` lists them)")
        raise MemoryPlanError(
            f"a {'train step' if training else 'forward'} does not fit{where}: {what} beyond the state held, and "
            f"{free / GiB:.1f} GiB of device memory are free. To change: " + "; ".join(knobs))
    return int(min(tokens, MAX_AUTO_TOKENS))


def engine_token_budget(engine, longest: int, *, training: bool, at_start: bool = False) -> int:
    """`gpu_token_budget` for `engine`, a `ModuleTrainEngine` on a GPU: its model's shape, activation
    recomputation, compute dtype, step (`step_bytes`, when `training`) and `memory_hints`."""
    return gpu_token_budget(engine.hf_model.config, engine.device, longest, training=training,
                            checkpointing=engine.options.gradient_checkpointing,
                            compute_itemsize=engine.compute_dtype.itemsize,
                            step_bytes=engine.step_bytes() if training else (0, 0), hints=engine.memory_hints,
                            at_start=at_start, bf16=engine.dtype == torch.bfloat16)


def check_train_fits(engine, longest: int) -> None:
    """Before anything else takes device memory: raise `MemoryPlanError` if even one train step of `engine` (a
    `ModuleTrainEngine` on a GPU) over rows of `longest` tokens cannot fit beside the state it holds, so that a
    run which can never train fails at start, naming what to change, not in its first step (or in the rollout
    engine's start, short of the memory the trainer took). The same test as the step's own token budget, made
    while the device holds the most it will ever have free for training. Nothing on a CPU, or for a train
    engine of another kind (a `ModuleTrainEngine` has `memory_hints`; module_train imports this module)."""
    device = getattr(engine, "device", None)
    if hasattr(engine, "memory_hints") and device is not None and device.type == "cuda":
        engine_token_budget(engine, longest, training=True, at_start=True)
