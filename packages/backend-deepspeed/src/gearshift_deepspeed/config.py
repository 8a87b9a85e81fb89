"""The DeepSpeed config the engine runs with: the one place that decides how ZeRO is set up."""

from __future__ import annotations

import copy

import torch


def deepspeed_config(
    *,
    zero_stage: int,
    max_grad_norm: float | None,
    compute_dtype: torch.dtype,
    offload_params: bool = False,
    offload_optimizer: bool = False,
    pin_memory: bool = False,
    fused_optimizer: dict | None = None,
    overrides: dict | None = None,
) -> dict:
    """A DeepSpeed config for one optimizer step per `engine.step()`, the caller owning accumulation.

    - Micro-batches are the engine's business: `managed_gradient_accumulation` off, so
      `backward` only accumulates and every `step()` is a boundary, whatever the number
      of micro-batches; the batch-size keys are DeepSpeed's bookkeeping only.
    - Clipping is explicit (DeepSpeed's default is 1.0): `max_grad_norm`, or 0 for none.
    - `compute_dtype` bfloat16 keeps fp32 master weights and Adam state in the optimizer.
    - ZeRO-3's `memory_efficient_linear` replaces `torch.nn.functional.linear` in the whole
      process, for every other model in it too: off.
    - `offload_params` / `offload_optimizer`: DeepSpeed's own ZeRO-Offload to host memory
      (params: stage 3 only). With a torch optimizer DeepSpeed refuses ZeRO-Offload unless
      `zero_force_ds_cpu_optimizer` is off; its C++ CPU Adam would be faster but is built at run time.
    - `fused_optimizer`: AdamW arguments for DeepSpeed's own optimizer (FusedAdam on a GPU,
      DeepSpeedCPUAdam with optimizer offload), JIT-built on first use; None: the caller
      passes a torch optimizer.
    - `overrides`: any DeepSpeed config keys, merged in last (nested dicts key by key).
    """
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: DeepSpeed ZeRO stages are 1, 2 and 3")
    if offload_params and zero_stage != 3:
        raise ValueError(f"offload_params needs zero_stage=3 (DeepSpeed offloads parameters only when it "
                         f"partitions them), got zero_stage={zero_stage}")
    if compute_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"compute dtype {compute_dtype} is not supported: use float32 or bfloat16 "
                         f"(float16 needs loss scaling, which skips steps on overflow)")
    zero: dict = {"stage": zero_stage, "memory_efficient_linear": False}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(max_grad_norm) if max_grad_norm is not None else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": compute_dtype == torch.bfloat16},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if fused_optimizer is not None:
        config["optimizer"] = {"type": "AdamW", "params": dict(fused_optimizer)}
    elif offload_optimizer:
        config["zero_force_ds_cpu_optimizer"] = False
    return merge(config, overrides or {})


def merge(base: dict, extra: dict) -> dict:
    """`base` with `extra` on top: nested dicts merged key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
