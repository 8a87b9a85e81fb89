"""How much of a GPU's free memory SGLang may hold (its `mem_fraction_static`), worked out before it starts.

SGLang measures the device's free memory when its scheduler starts (the trainer's tensors and any other engine
are already there), loads the weights, and gives the KV cache what is left of `mem_fraction_static` times that
free memory. When the weights alone need more, the scheduler fails at start and SGLang kills the host process
that started it (SIGQUIT): a run dies with a traceback from another process. This module checks first, and
raises an error that says which number to change.
"""

from __future__ import annotations

from gearshift.options import OptionError

#: what the scheduler's own CUDA context and SGLang's bookkeeping take before it measures (a margin)
CONTEXT_BYTES = 1 << 30
#: the fraction when nothing asks for more: SGLang keeps the rest for activations and CUDA graphs
DEFAULT_FRACTION = 0.5
#: the largest fraction worked out on its own: above it decoding has too little room beside the KV cache
MAX_FRACTION = 0.9

GB = 1e9


def static_fraction(*, free: int, weights: int, kv_cache: int, given: float | None, device: str = "cuda") -> float:
    """SGLang's `mem_fraction_static` for `free` bytes free on `device`, `weights` bytes of weights and a KV
    cache of `kv_cache` bytes (0 where the batch is not known: SGLang then takes what the fraction leaves).

    `given` (the user's option) is checked; None works one out: `DEFAULT_FRACTION`, or more where the weights
    and the KV cache need it, up to `MAX_FRACTION`. Raises `OptionError` naming what to change when they do
    not fit."""
    need = weights + kv_cache + CONTEXT_BYTES
    least = need / free if free > 0 else float("inf")
    what = (f"the weights ({weights / GB:.1f} GB) and the KV cache the batch needs ({kv_cache / GB:.1f} GB)"
            if kv_cache else f"the weights ({weights / GB:.1f} GB)")
    if given is not None:
        if not 0 < given <= 1:
            raise OptionError(f"mem_fraction_static={given} must be in (0, 1]")
        if given < least:
            raise OptionError(
                f"mem_fraction_static={given} gives SGLang {given * free / GB:.1f} GB of the {free / GB:.1f} GB "
                f"free on {device}, and {what} need {need / GB:.1f} GB with its start: set "
                f"rollout.options.mem_fraction_static to at least {min(1.0, least + 0.005):.2f}, or leave it "
                f"unset and gearshift works it out")
        return given
    if least > MAX_FRACTION:
        raise OptionError(
            f"SGLang needs {need / GB:.1f} GB for {what} and its start, and {device} has {free / GB:.1f} GB free: "
            f"free memory before the rollout engine starts (a smaller trainer footprint, another device), or "
            f"shrink the KV cache (rollout.max_batch_tokens, rollout.options.kv_cache_bytes)")
    return round(max(DEFAULT_FRACTION, least + 0.02), 3)
