"""A stand-in for `sgl_kernel` where SGLang's compiled kernel package cannot be installed (CPU).

SGLang's CPU engine (`SGLANG_USE_CPU_ENGINE=1`) imports `sgl_kernel` at module
level, but PyPI carries only CUDA builds of it (`sgl-kernel`, `sglang-kernel`),
with no source release. This module object takes its place, and only where no
real `sgl_kernel` can be imported.

It holds the names SGLang 0.5.23 imports from `sgl_kernel` on the CPU path
(`IMPORTED`). Run through everything gearshift asks of the engine (generation
greedy and sampled, with top-k/top-p/min-p, stops, chunked prefill and prefix
cache hits; weight updates per tensor and as flattened buckets; cache flushes;
memory release and resume; Qwen2 and Llama, float32 and bfloat16), SGLang calls
none of them: they serve speculative decoding and KV-cache moves, which this
backend does not use. So each is a function that raises `NotImplementedError`
naming itself, rather than an untested guess at the kernel. A call is also
appended to the file named by `GEARSHIFT_SGL_KERNEL_TRACE`, if set, which is how
the tests check that the CPU path still calls none of them.

SGLang's fused CPU kernels (`torch.ops.sgl_kernel.*`) are used only when
`torch.ops.sgl_kernel.convert_weight_packed` exists (Intel AMX builds); this
stand-in registers no torch operator, so SGLang takes its plain PyTorch path.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import types

MODULE = "sgl_kernel"
TRACE_ENV = "GEARSHIFT_SGL_KERNEL_TRACE"

#: what SGLang 0.5.23 imports from `sgl_kernel` at module level when it runs on the CPU
IMPORTED = (
    "assign_req_to_token_pool_cpu",  # srt/mem_cache/allocation.py (speculative decoding)
    "copy_all_layer_kv_cache_cpu",  # kernels/ops/kvcache/cache_move.py (moving KV pages)
    "build_tree_kernel_efficient_cpu",  # kernels/ops/speculative/spec_tree.py
    "verify_tree_greedy_cpu",  # kernels/ops/speculative/spec_tree.py
    "assign_draft_cache_locs_contiguous_cpu",  # kernels/ops/speculative/cache_locs.py
    "assign_extend_cache_locs_cpu",  # kernels/ops/speculative/cache_locs.py
    "fill_accept_out_cache_loc_cpu",  # kernels/ops/speculative/eagle.py
    "fill_bonus_tokens_cpu",  # kernels/ops/speculative/eagle.py
)


def real_kernel_available() -> bool:
    """True when an `sgl_kernel` other than this stand-in can be imported."""
    existing = sys.modules.get(MODULE)
    if existing is not None:
        return not getattr(existing, "__gearshift_stand_in__", False)
    return importlib.util.find_spec(MODULE) is not None


def install() -> bool:
    """Put the stand-in in `sys.modules` unless a real `sgl_kernel` imports; True if it is in place."""
    existing = sys.modules.get(MODULE)
    if existing is not None:
        return bool(getattr(existing, "__gearshift_stand_in__", False))
    if importlib.util.find_spec(MODULE) is not None:
        return False
    sys.modules[MODULE] = build()
    return True


def build() -> types.ModuleType:
    """A fresh stand-in module."""
    module = types.ModuleType(MODULE, __doc__)
    module.__spec__ = importlib.machinery.ModuleSpec(MODULE, None)
    module.__gearshift_stand_in__ = True
    module.__all__ = list(IMPORTED)
    for name in IMPORTED:
        setattr(module, name, _unavailable(name))
    return module


def _unavailable(name: str):
    def op(*args, **kwargs):
        _record(name)
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in gearshift's CPU stand-in for SGLang's kernel package: this path of "
            f"SGLang needs the real sgl_kernel (the stand-in covers plain generation, weight updates, cache "
            f"flushes and memory release on dense models)"
        )

    op.__name__ = op.__qualname__ = name
    return op


def _record(name: str) -> None:
    path = os.environ.get(TRACE_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()} {name}\n")
