"""What an SGLang engine is started with: the backend's options and the keyword arguments of `sglang.Engine`.

`engine_arguments` takes the engine's arguments, options and where it runs; on a
GPU it reads the device's free memory to work out SGLang's share (memory.py).
It imports nothing of SGLang, so it is tested without starting one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gearshift.hf import kv_bytes_per_token
from gearshift.memory import device_free, release_cached
from gearshift.options import option
from gearshift.rollout import RolloutArgs, kv_tokens_for_batch

from .memory import static_fraction

DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20


@dataclass(frozen=True)
class SGLangOptions:
    """The sglang backend's own options (`SGLangRolloutEngine.Options`)."""

    cache_dir: str | None = option(None, "SGLang's caches, sockets and temporary files (default "
                                         "~/.cache/gearshift/sglang)")
    kv_cache_bytes: int | None = option(None, "KV cache size (CPU default 256 MiB; GPU default: what the "
                                              "rollout's max_batch_tokens need, within mem_fraction_static)")
    kv_cache_to_batch: bool = option(True, "on a GPU, cap the KV cache at what the rollout's batch needs "
                                           "(max_batch_tokens, with a quarter more; False: all that "
                                           "mem_fraction_static leaves)")
    mem_fraction_static: float | None = option(None, "share of the GPU's free memory at start that SGLang "
                                                     "holds for weights and KV cache (GPU only); None: 0.5, "
                                                     "or what the weights and the batch's KV cache need, up "
                                                     "to 0.9; a value too small for the weights is an error "
                                                     "at build, naming the least that fits")
    enable_prefix_caching: bool = option(True, "reuse keys and values of shared prompt prefixes (SGLang's radix "
                                               "cache: the n samples of a prompt share its prefill); a prefix "
                                               "served from the cache was computed in another pass shape, so a "
                                               "repeated request can differ in the last bits (4.8e-7 in fp32)")
    release_memory: bool | None = option(None, "sleep releases memory through SGLang (None: on GPU only; "
                                               "on CPU it frees nothing and costs ~0.5 s)")
    sleep_on_idle: bool = option(False, "SGLang's scheduler waits on its sockets while it has no work "
                                        "instead of polling them: frees the core it keeps busy while the "
                                        "trainer runs; off by default until its timing on the CPU is "
                                        "understood (see the README)")
    direct_load: bool = option(True, "write updated weights straight into SGLang's parameters, in its "
                                     "scheduler process, through views found and checked against the "
                                     "checkpoint at start (the rest through SGLang's loader); False: "
                                     "every weight through SGLang's loader (flattened buckets)")
    load_group_bytes: int = option(1 << 30, "with direct_load, buckets are gathered in the flat buffer up to "
                                            "this many bytes (the whole model when smaller) and sent to the "
                                            "scheduler in one call: one round trip per group instead of one "
                                            "per bucket (a 7B sync has about 100 buckets of 128 MiB); the "
                                            "trainer's side keeps a buffer of this size on its device")
    sampling_backend: str | None = option(None, "SGLang's sampling kernels ('pytorch', 'flashinfer'); "
                                                "None: 'pytorch' on a GPU (flashinfer's top-k/top-p kernels "
                                                "compile with nvcc on first use, for minutes; rollouts at "
                                                "temperature 1 without top-k/top-p sample in plain torch "
                                                "either way), SGLang's own choice on a CPU")
    prefill_cuda_graph: bool = option(False, "on a GPU, also capture CUDA graphs for prefill (SGLang's "
                                             "default in 0.5.17: at its first start on a fresh machine it "
                                             "compiled and captured them for 79 s); a rollout's steps are "
                                             "nearly all decoding, whose graphs are captured either way")
    engine_kwargs: dict[str, Any] = option({}, "passed to sglang.Engine as they are (over every option)")


def engine_arguments(args: RolloutArgs, options: SGLangOptions, config, *, model_path: str, on_gpu: bool,
                     device: torch.device, dtype: torch.dtype, dp: int, served_bytes: int) -> dict[str, Any]:
    """The keyword arguments of `sglang.Engine` for `args` and `options` (`config` the model's transformers
    config), on one of `dp` engines; `served_bytes` the weights in the engine's dtype."""
    kwargs: dict[str, Any] = dict(
        model_path=model_path, dtype=args.dtype, random_seed=args.seed, log_level="error",
        context_length=args.max_model_len, disable_radix_cache=not options.enable_prefix_caching,
        skip_server_warmup=True, sleep_on_idle=options.sleep_on_idle,
    )
    if on_gpu:
        kwargs.update(base_gpu_id=device.index or 0, enable_memory_saver=True,
                      sampling_backend=options.sampling_backend or "pytorch")
        if not options.prefill_cuda_graph:
            kwargs["disable_prefill_cuda_graph"] = True
    else:
        kwargs.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True)
        if options.sampling_backend:
            kwargs["sampling_backend"] = options.sampling_backend
    kv_bytes = options.kv_cache_bytes or (None if on_gpu else DEFAULT_CPU_KV_CACHE_BYTES)
    if kv_bytes is not None:
        kwargs["max_total_tokens"] = max(1, int(kv_bytes) // kv_bytes_per_token(config, dtype))
    elif options.kv_cache_to_batch:  # a GPU: the batch's tokens, where known
        text = getattr(config, "text_config", None) or config
        context = args.max_model_len or getattr(text, "max_position_embeddings", None) or 0
        tokens = kv_tokens_for_batch(args.max_batch_tokens, int(context), dp)
        if tokens is not None:
            kwargs["max_total_tokens"] = tokens
    kwargs.update(options.engine_kwargs)
    if on_gpu and "mem_fraction_static" not in options.engine_kwargs:
        kv = (kwargs.get("max_total_tokens") or 0) * kv_bytes_per_token(config, dtype)
        kwargs["mem_fraction_static"] = _static_fraction(device, served_bytes, kv, options.mem_fraction_static)
    return kwargs


def _static_fraction(device: torch.device, weights: int, kv_cache: int, given: float | None) -> float:
    """SGLang's `mem_fraction_static` for the memory free now (torch's unused cached blocks given back
    first: SGLang's scheduler, another process, cannot use them); see memory.py."""
    release_cached(device)
    return static_fraction(free=device_free(device, cached=False), weights=weights, kv_cache=kv_cache,
                           given=given, device=str(device))
