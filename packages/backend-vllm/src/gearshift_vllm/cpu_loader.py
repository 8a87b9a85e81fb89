"""CPU weight layout: plain tensors that `load_weights` writes in place, or vLLM's prepacked ones.

vLLM on CPU normally reorders every linear weight into oneDNN's blocked layout
after loading and drops the original tensor. That makes each sync a re-pack
(`reload_weights`), which costs several plain copies of the weights. With the
`plain` layout the weights stay ordinary tensors used through
`torch.nn.functional.linear`, so a sync is `load_weights` writing in place, the
same path as on GPU. Decoding is somewhat slower (see the README for figures),
so long rollouts between syncs may prefer `packed`.

The layout is chosen at engine start through a model loader registered with
vLLM (`load_format="gearshift_plain"`): it marks the linear layers to skip the
re-pack (`_cpu_skip_gemm_dispatch`, vLLM's own switch for layers it keeps
unpacked) before loading, and points the logits projection at the live weight.
"""

from __future__ import annotations

import dataclasses

import torch

PLAIN_LOAD_FORMAT = "gearshift_plain"
LAYOUTS = ("auto", "plain", "packed")
_registered = False


def choose_layout(layout: str, dtype: torch.dtype) -> str:
    """`auto`: plain for float32 (where the packed kernels gain little), packed for 16-bit weights."""
    if layout not in LAYOUTS:
        raise ValueError(f"cpu_weights={layout!r}: use one of {LAYOUTS}")
    if layout == "auto":
        return "plain" if dtype == torch.float32 else "packed"
    return layout


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


def register_plain_loader() -> str:
    """Register the loader with vLLM (once per process); returns its `load_format`."""
    global _registered
    if _registered:
        return PLAIN_LOAD_FORMAT
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class PlainWeightsLoader(DefaultModelLoader):
        """The default loader from local files, keeping linear weights as plain tensors on CPU."""

        def __init__(self, load_config) -> None:
            super().__init__(dataclasses.replace(load_config, load_format="auto"))

        def load_weights(self, model: torch.nn.Module, model_config) -> None:
            from vllm.model_executor.layers.linear import UnquantizedLinearMethod

            for module in model.modules():
                if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod):
                    module._cpu_skip_gemm_dispatch = True
            super().load_weights(model, model_config)

        def load_model(self, vllm_config, model_config, prefix: str = "") -> torch.nn.Module:
            model = super().load_model(vllm_config, model_config, prefix)
            for module in model.modules():
                if hasattr(module, "cpu_linear"):  # the logits projection keeps a packed copy: use the weight
                    module.cpu_linear = _linear
            return model

    register_model_loader(PLAIN_LOAD_FORMAT)(PlainWeightsLoader)
    _registered = True
    return PLAIN_LOAD_FORMAT


def packed_modules(model: torch.nn.Module) -> list[str]:
    """Modules that still compute from a packed copy instead of their weight (empty for the plain layout)."""
    out = []
    for name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        if linear is not None and linear is not _linear and linear is not torch.nn.functional.linear:
            out.append(name)
    return out
