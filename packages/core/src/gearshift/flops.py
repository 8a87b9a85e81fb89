"""Model FLOPs of a causal LM over a batch, and the share of the device's peak a phase reached (MFU).

A forward over a row of L tokens multiplies each token by the model's matrices, 2 FLOPs a weight, and runs
attention's two products, the scores and the weighted values, 2 x (heads x head_dim) FLOPs a pair of
positions each, over the L (L + 1) / 2 pairs a causal mask keeps. Backward is twice the forward (the
gradients of the inputs and of the weights), once with frozen weights (LoRA: the inputs' gradients, and the
adapters'). These are model FLOPs: padding, activation recomputation and a kernel's masked-out work are not
counted, and a prompt the trainer computes once for its samples (`train.share_prompts`) counts once a row, as
the job states it; so MFU, the model FLOPs a second over the device's peak, is the share of the device that did the
job's own work. Counted from the model's configuration on the meta device: every matrix weight but the input
embeddings (a tied head counts once, as the head), a mixture-of-experts layer's routed experts at their share
(`num_experts_per_tok` of them), the head apart (a critic's value head replaces it).

The device's peak is its dense bf16 tensor rate, from the table below by the name CUDA gives the device, or
`GEARSHIFT_PEAK_TFLOPS` (TFLOP/s) for a device the table lacks (or to compare against another rate).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Iterable

import torch

from .hf import meta_causal_lm, routed_experts

#: dense bf16 tensor TFLOP/s of one device (the vendors' figures, without sparsity), by a pattern of the name
#: `torch.cuda.get_device_name()` gives; the first match wins
PEAK_TFLOPS = (
    (r"\bH100\b.*\bPCIe\b", 756.0),
    (r"\bH[12]00\b.*\bNVL\b", 835.0),  # H100 NVL, H200 NVL
    (r"\bH100\b|\bH200\b|\bGH200\b|\bH800\b", 989.4),
    (r"\bH20\b", 148.0),
    (r"\bB200\b", 2250.0),
    (r"\bA100\b|\bA800\b", 312.0),
    (r"\bL40S\b", 362.0),
)

#: the variable that sets the peak (TFLOP/s) for a device the table lacks
PEAK_ENV = "GEARSHIFT_PEAK_TFLOPS"


def peak_flops(device: torch.device | str | None = None) -> float | None:
    """FLOP/s of the device at its dense bf16 tensor rate: `GEARSHIFT_PEAK_TFLOPS` when set, else the table's
    figure for a CUDA device it names; None for a CPU or a device it lacks (no MFU is then reported)."""
    env = os.environ.get(PEAK_ENV, "").strip()
    if env:
        try:
            value = float(env)
        except ValueError:
            raise ValueError(f"{PEAK_ENV}={env!r}: a number of TFLOP/s, e.g. 989.4") from None
        if value <= 0:
            raise ValueError(f"{PEAK_ENV}={env!r}: must be above 0")
        return value * 1e12
    device = torch.device(device) if device is not None else None
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return None
    return peak_of_name(torch.cuda.get_device_name(device))


def peak_of_name(name: str) -> float | None:
    """The table's FLOP/s for a device called `name` (as CUDA names it), or None."""
    for pattern, tflops in PEAK_TFLOPS:
        if re.search(pattern, name, re.I):
            return tflops * 1e12
    return None


@dataclass(frozen=True)
class ModelFlops:
    """What a model's FLOPs per token follow from: the matrix weights a token multiplies by in the body and in
    the head, and the attention layers with the width of their products."""

    body_params: float  # matrix weights below the head a token goes through (routed experts at their share)
    head_params: float  # the output head's (0 for a model without one)
    attention_layers: int
    attention_width: int  # heads x head_dim: the width of the score and value products

    @classmethod
    def of_config(cls, config) -> "ModelFlops":
        """From a transformers config, through the model it builds on the meta device."""
        model = meta_causal_lm(config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        experts = routed_experts(config)
        active = getattr(text, "num_experts_per_tok", None) or experts
        head = model.get_output_embeddings()
        head_weight = getattr(head, "weight", None)
        lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        body = 0.0
        for name, p in model.named_parameters():
            if p.dim() < 2 or p is head_weight or id(p) in lookups:
                continue
            share = active / experts if experts and re.search(r"(^|\.)experts\.", name) else 1.0
            body += p.numel() * share
        heads = getattr(text, "num_attention_heads", 0) or 0
        head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
        kinds = getattr(text, "layer_types", None)
        layers = (sum(1 for k in kinds if "attention" in str(k) and "linear" not in str(k)) if kinds
                  else getattr(text, "num_hidden_layers", 0))
        return cls(body, float(head_weight.numel()) if head_weight is not None else 0.0, int(layers),
                   int(heads * head_dim))

    @classmethod
    def of_model(cls, path: str) -> "ModelFlops":
        """From the config of the local model folder `path` (read once a process)."""
        return _of_model(str(path))

    def forward(self, lengths: Iterable[int], *, head: bool = True, causal: bool = True) -> float:
        """FLOPs of one forward over rows of these lengths (`head`: through the output head; `causal`: attention
        over the pairs a causal mask keeps, else over every pair, as a kernel that computes the masked ones)."""
        per_token = 2.0 * (self.body_params + (self.head_params if head else 0.0))
        total = 0.0
        for n in lengths:
            n = int(n)
            pairs = n * (n + 1) / 2 if causal else float(n * n)
            total += per_token * n + 2.0 * 2.0 * self.attention_width * self.attention_layers * pairs
        return total

    def train(self, lengths: Iterable[int], *, head: bool = True, frozen: bool = False, causal: bool = True) -> float:
        """FLOPs of a forward and backward over rows of these lengths: three forwards, or two when the weights
        are frozen (`frozen`: LoRA, whose backward computes the inputs' gradients and not the weights')."""
        return (2.0 if frozen else 3.0) * self.forward(lengths, head=head, causal=causal)


#: model folders whose FLOPs could not be counted (said once a process)
_UNCOUNTED: set[str] = set()


@functools.lru_cache(maxsize=8)
def _of_model(path: str) -> ModelFlops:
    from transformers import AutoConfig

    return ModelFlops.of_config(AutoConfig.from_pretrained(path))


def engine_train_flops(engine, lengths: Iterable[int]) -> float | None:
    """Model FLOPs of `engine`'s train step over rows of these lengths (a critic's value head in place of the
    output head, LoRA's frozen weights); None where its model folder has no config transformers reads."""
    path = str(engine.args.model)
    try:
        flops = ModelFlops.of_model(path)
    except Exception as err:  # a folder without config.json, an architecture transformers lacks: a figure, not
        if path not in _UNCOUNTED:  # a reason to stop training
            print(f"gearshift: no model FLOPs for {path} ({type(err).__name__}: {err}); "
                  f"perf/train_tflops and perf/mfu are left out")
            _UNCOUNTED.add(path)
        return None
    return flops.train(lengths, head=not engine.args.value_head, frozen=bool(engine.lora_rank))


def add_flops(total: float | None, more: float | None) -> float | None:
    """`total` + `more`, None once either is (a phase whose count is unknown in part is unknown)."""
    return None if total is None or more is None else total + more


def train_rates(flops: float, seconds: float, device: torch.device | str | None) -> dict[str, float]:
    """The train phase's model TFLOP/s (`perf/train_tflops`) and, where the device's peak is known, the share
    of it they are (`perf/mfu`)."""
    out = {"perf/train_tflops": flops / max(seconds, 1e-9) / 1e12}
    peak = peak_flops(device)
    if peak:
        out["perf/mfu"] = flops / max(seconds, 1e-9) / peak
    return out


__all__ = ["PEAK_ENV", "PEAK_TFLOPS", "ModelFlops", "add_flops", "engine_train_flops", "peak_flops", "peak_of_name",
           "train_rates"]
