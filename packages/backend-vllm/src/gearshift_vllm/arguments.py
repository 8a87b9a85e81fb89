"""What a vLLM engine is started with, and the checks that refuse a start before vLLM runs.

`engine_arguments` is a pure function of the engine's arguments, its options and
where it runs: it imports nothing of vLLM, so it is tested without starting one.
The checks that need vLLM's own registry or allocator (`check_architecture`,
`check_sleep_allocator_free`) take it, or import it, only when called.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gearshift.hf import kv_bytes_per_token as plain_kv_bytes_per_token, routed_experts
from gearshift.options import option
from gearshift.rollout import RolloutArgs, RolloutError, kv_tokens_for_batch

from .cpu_loader import choose_layout

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
#: the prompt tokens one CPU step takes at least (vLLM's default budget is 2,048)
CPU_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class VLLMOptions:
    """The vllm backend's own options (`VLLMRolloutEngine.Options`)."""

    cache_dir: str | None = option(None, "vLLM's caches, sockets and temporary files (default "
                                         "~/.cache/gearshift/vllm)")
    kv_cache_bytes: int | None = option(None, "KV cache size (CPU default 1 GiB; GPU default: what the "
                                              "rollout's max_batch_tokens need, within gpu_memory_utilization)")
    gpu_memory_utilization: float = option(0.5, "share of GPU memory vLLM may take (GPU only)")
    kv_cache_to_batch: bool = option(True, "on a GPU, reserve only the KV cache the rollout's batch needs "
                                           "(max_batch_tokens, with a quarter more) when that is less than "
                                           "gpu_memory_utilization leaves: less memory to map at each wake and "
                                           "more room for training (False: all it leaves, vLLM's own rule)")
    sleep_level: int = option(2, "GPU sleep: 2 discards the weights (the next sync refills them), 1 keeps a "
                                 "host copy (always 1 when serving adapters)", choices=(1, 2))
    enable_prefix_caching: bool = option(True, "reuse keys and values of shared prompt prefixes")
    enforce_eager: bool | None = option(None, "no CUDA graphs / torch.compile: a faster start, slower decoding "
                                              "(None: eager on a CPU, CUDA graphs on a GPU)")
    num_threads: int | None = option(None, "torch threads while vLLM runs (None: OMP_NUM_THREADS, else 1 for loads "
                                              "and every core of the process for generating on a CPU)")
    cpu_weights: str = option("auto", "CPU weight layout: plain (written in place), packed (oneDNN, re-packed "
                                      "each sync), auto (plain for float32)", choices=("auto", "plain", "packed"))
    tp_slices: bool = option(True, "with tp > 1, declare each rank's slice of the tensor-parallel weights, so a "
                                   "sync sends each rank only what it keeps (False: whole weights, which "
                                   "vLLM's loaders cut on arrival)")
    request_seeds: bool | None = option(None, "True: a seeded call gives each request a seed of its own, whatever "
                                               "batch it is in; False: the call's seed seeds the engine's "
                                               "generator, the same samples for the same call, drawn for the "
                                               "whole batch at once; None: True on a CPU (vLLM's CPU sampler "
                                               "draws a seed per row anyway), False on a GPU (where vLLM draws "
                                               "each seeded request's noise apart: a 0.5B rollout of 32 x 8 x "
                                               "256 tokens took 4.0 s against 2.9 s on an H100)")
    engine_kwargs: dict[str, Any] = option({}, "passed to vllm.LLM as they are")


def cpu_layout(options, dtype: torch.dtype, on_gpu: bool) -> str | None:
    """The CPU weight layout ("plain" or "packed") the options pick for `dtype`; None on GPU."""
    return None if on_gpu else choose_layout(options.cpu_weights, dtype)


def engine_arguments(args: RolloutArgs, options, *, tp: int, world_size: int, on_gpu: bool,
                     lora_ranks: Sequence[int] | None = None, kv_for_batch: int | None = None,
                     context: int | None = None) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM` for `args` and the engine's `options`, on `world_size` ranks with
    `tp` of them per engine, on a GPU or a CPU.

    `lora_ranks`: the adapter ranks this vLLM accepts (`lora_ranks()`; None: any). Raises `ValueError` on a
    combination vLLM would fail on, naming the option to change. The CPU plain layout's `load_format` is
    left for the engine to fill in (it registers the loader with vLLM). `kv_for_batch`: the KV-cache bytes the
    rollout's batch needs (`kv_cache_for_batch`), reserved on a GPU instead of vLLM's share when the options
    let it; None: not known, or more than the share leaves. `context`: the longest sequence the engine serves
    (`max_model_len`, else the model's own limit), which one CPU step must hold.
    """
    kwargs: dict[str, Any] = dict(
        model=args.model, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
        enforce_eager=not on_gpu if options.enforce_eager is None else options.enforce_eager,
        enable_prefix_caching=options.enable_prefix_caching,
        tensor_parallel_size=tp,
        # logprobs of the model's own distribution, before temperature, top-k and top-p
        logprobs_mode="raw_logprobs",
    )
    if world_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if args.max_lora_rank:  # one adapter slot, reloaded in place on every sync
        kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1,
                      max_lora_rank=fitting_lora_rank(args.max_lora_rank, lora_ranks))
    if on_gpu:
        kwargs.update(enable_sleep_mode=True, gpu_memory_utilization=options.gpu_memory_utilization)
        if options.kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(options.kv_cache_bytes)
        elif options.kv_cache_to_batch and kv_for_batch:
            kwargs["kv_cache_memory_bytes"] = int(kv_for_batch)
    else:
        kwargs["kv_cache_memory_bytes"] = int(options.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES)
        # A prompt split over two steps (chunked prefill) makes vLLM rewind that request's generator after the
        # first part, which only a CUDA generator can do: a seeded request fails on a CPU with "CPU Generator
        # does not use offset". Whole prompts only, and a step that holds the longest (vLLM's own CPU answer
        # for MLA models).
        kwargs.update(enable_chunked_prefill=False,
                      max_num_batched_tokens=max(int(context or args.max_model_len or 0), CPU_BATCHED_TOKENS))
    kwargs.update(options.engine_kwargs)
    check_layout(args, kwargs, on_gpu, cpu_layout(options, args.torch_dtype, on_gpu))
    return kwargs


def kv_bytes_per_token(config, dtype: torch.dtype, tp: int = 1) -> int | None:
    """Bytes of keys and values one token takes on one of `tp` ranks, for a model of plain attention layers
    (`config` a transformers config); None when its fields do not say (another attention, a state-space
    model): then vLLM sizes the cache by its own rule."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fields = (getattr(text, k, None) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    if not all(fields) or getattr(text, "kv_lora_rank", None) or \
            getattr(text, "layer_types", None) and any(t != "full_attention" for t in text.layer_types):
        return None
    return plain_kv_bytes_per_token(config, dtype, tp)


def kv_cache_for_batch(config, dtype: torch.dtype, *, batch_tokens: int | None, max_model_len: int, tp: int = 1,
                       dp: int = 1, room: float | None = None) -> int | None:
    """KV-cache bytes one engine reserves for its share (`dp` replicas) of a batch of `batch_tokens` tokens:
    at least one sequence of `max_model_len`, with a margin. None when not worth setting: tokens or the
    model's attention unknown, or the need reaches `room` (what vLLM's share leaves after the weights); see
    `gearshift.rollout.kv_tokens_for_batch`."""
    per_token = kv_bytes_per_token(config, dtype, tp)
    tokens = kv_tokens_for_batch(batch_tokens, max_model_len, dp)
    if tokens is None or per_token is None:
        return None
    need = tokens * per_token
    return None if room is not None and need >= room else need


def check_layout(args: RolloutArgs, kwargs: dict[str, Any], on_gpu: bool, cpu_weights: str | None) -> None:
    """Refuse adapters and weight layouts vLLM cannot serve together."""
    if args.max_lora_rank and on_gpu and args.torch_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"vLLM's GPU LoRA kernels take float16 or bfloat16 weights, not {args.dtype}: serve "
                         f"adapters in half precision (rollout.dtype=bfloat16), or sync merged weights")
    if args.max_lora_rank and cpu_weights == "packed":
        raise ValueError("serving LoRA adapters on a CPU needs the plain weight layout: cpu_weights='plain'")
    if cpu_weights == "plain" and kwargs.get("load_format", "auto") not in ("auto", "safetensors"):
        raise ValueError(f"cpu_weights='plain' loads local safetensors itself; load_format="
                         f"{kwargs['load_format']!r} needs cpu_weights='packed'")


def fitting_lora_rank(rank: int, allowed: Sequence[int] | None) -> int:
    """The smallest of the `allowed` adapter ranks that holds `rank` (None: `rank` itself)."""
    if allowed is None:
        return rank
    fits = sorted(a for a in allowed if a >= rank)
    if not fits:
        raise ValueError(f"max_lora_rank={rank}: vLLM serves adapters up to rank {max(allowed)}")
    return fits[0]


def lora_ranks() -> list[int] | None:
    """The adapter ranks the installed vLLM accepts for `max_lora_rank` (None: it does not list them)."""
    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:  # another vLLM: it takes the rank as it is, or says what it takes
        return None
    return sorted(typing.get_args(MaxLoRARanks))


def check_architecture(vllm, config) -> None:
    """Refuse, before vLLM starts, a model it would only run through its Transformers fallback.

    That fallback keeps no weight layout of its own that `load_weights` writes in place,
    and a failed start leaves vLLM's process-wide config unset, which breaks every later
    engine in the process ("Current vLLM config is not set").
    """
    archs = list(getattr(config, "architectures", None) or [])
    entries = [vllm.ModelRegistry.models.get(a) for a in archs]
    native = [a for a, e in zip(archs, entries) if e is not None and not e.module_name.endswith(".transformers")]
    if not native:
        raise ValueError(
            f"vLLM {vllm.__version__} has no implementation of its own for {archs or 'this model'} (it would run "
            f"it through its Transformers fallback, which the vllm backend does not support): pick another "
            f"rollout backend for this model, e.g. rollout.backend=hf")


def check_experts_on_cpu(vllm, config, on_gpu: bool) -> None:
    """Refuse, before vLLM starts, a mixture-of-experts model on a CPU: vLLM's CPU kernels pad and repack the
    experts' weights after loading, and neither `load_weights` nor its own `reload_weights` redoes that (a
    reload of the model's own folder changes its outputs), so no update could reach the engine intact."""
    experts = routed_experts(config)
    if experts and not on_gpu:
        raise ValueError(
            f"vLLM {vllm.__version__} on a CPU cannot take weight updates for this mixture-of-experts model "
            f"({experts} experts a layer): its CPU kernels pad and repack the experts after loading, and an "
            f"update through its loader (even its own reload_weights of the model's folder) computes other "
            f"outputs. On a CPU pick rollout.backend=hf for this model; on a GPU the vllm backend takes it")


def sleep_allocator_in_use() -> int:
    """Bytes vLLM's sleep-mode allocator (its process-wide CuMemAllocator) still holds (0: none, or unused)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return 0
    instance = getattr(CuMemAllocator, "instance", None)
    return int(instance.get_current_usage()) if instance is not None else 0


def check_sleep_allocator_free() -> None:
    """Refuse, before vLLM starts, a second engine with sleep mode in a process whose first one's memory is
    still held: vLLM's allocator serves one engine per process and would fail deep inside its start."""
    held = sleep_allocator_in_use()
    if held:
        raise RolloutError(
            f"vLLM's sleep-mode allocator serves one engine per process, and it still holds {held / 2**30:.1f} GiB "
            f"from an engine built earlier in this process (closed or not): build the next vllm engine in a new "
            f"process (the gearshift benchmarks run one model per process)")
