"""Loading Hugging Face causal LMs the way every engine should: dropout off, memory the process owns,
tied weights named once.

- Dropout is off unless asked: an on-policy update computed with dropout on is
  off-policy (the sampled tokens came from the model without it).
- Weights are copied into memory the process allocated itself. On the CPU,
  `from_pretrained` can leave them as views of the checkpoint's file mapping,
  at whatever offset the file put them; SIMD kernels then round differently
  than on the aligned buffers a later update writes into, so restoring the same
  weights would not restore the same outputs bit for bit (seen with GPT-2).
- A tied output head is listed once, under the name `named_parameters()` gives
  the shared tensor, and its other name recorded as an alias (see weights.py).
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

from .mesh import MeshSpec, Placement
from .weights import ParamSpec, WeightSpec


def dropout_keys(config) -> list[str]:
    """The config's dropout probabilities (float attributes named *dropout* or *pdrop*)."""
    keys = []
    for key, value in config.to_dict().items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key) and hasattr(config, key):
            keys.append(key)
    return keys


def load_causal_lm(path: str, dtype: torch.dtype, *, dropout: bool = False) -> nn.Module:
    """`AutoModelForCausalLM` from a local folder in `dtype`, on the CPU, in memory this process owns."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if not dropout:
        for key in dropout_keys(config):
            setattr(config, key, 0.0)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    if not dropout:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    own_storage(model)
    return model


@torch.no_grad()
def own_storage(model: nn.Module) -> None:
    """Give every CPU parameter storage of its own (aligned, writable, not a view of a file mapping)."""
    for p in model.parameters():
        if p.device.type == "cpu":
            p.data = p.data.clone()


def tied_aliases(model: nn.Module, prefix: str = "") -> dict[str, str]:
    """{other name: listed name} for parameters registered under several names (a tied head)."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(prefix=prefix, remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def meta_causal_lm(config) -> nn.Module:
    """The causal LM of transformers `config` on the meta device: names, shapes and modules, no weights."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def weight_spec_of(model_path: str, mesh: MeshSpec, dtype: torch.dtype) -> WeightSpec:
    """The weights of the model at `model_path` as a rollout engine takes them: `named_parameters()` names
    (a tied head as an alias), full shapes, whole on every rank; read from its config on the meta device,
    so no weight is loaded to learn it."""
    from transformers import AutoConfig

    model = meta_causal_lm(AutoConfig.from_pretrained(model_path))
    placement = Placement.replicated(mesh)
    params = tuple(ParamSpec(name, tuple(p.shape), dtype, placement) for name, p in model.named_parameters())
    return WeightSpec(mesh, params, tied_aliases(model))


#: config keys giving a mixture-of-experts model's count of routed experts, by architecture family
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def routed_experts(config) -> int:
    """How many routed experts each mixture-of-experts layer of the model of transformers `config` has (0: a
    dense model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    counts = [getattr(text, k, None) for k in EXPERT_KEYS]
    return max([int(c) for c in counts if isinstance(c, int)] or [0])


def kv_bytes_per_token(config, dtype: torch.dtype, tp: int = 1) -> int:
    """Bytes of keys and values one token takes on one of `tp` ranks in every attention layer of the model
    of transformers `config` (its text model's), at `dtype`."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * max(1, kv_heads // tp) * head_dim * dtype.itemsize


def write_hf_folder(path: str, hf_model: nn.Module, state: dict[str, torch.Tensor], source: str,
                    value_head: bool = False) -> None:
    """Write `state` as a Hugging Face folder of `hf_model`'s class and config, with `source`'s tokenizer;
    a critic's value head goes beside it in value_head.safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if value_head:
        lm = {k[len("lm."):]: v.contiguous() for k, v in state.items() if k.startswith("lm.")}
        head = {k[len("value_head."):]: v.contiguous() for k, v in state.items() if k.startswith("value_head.")}
        hf_model.save_pretrained(path, state_dict=lm)
        save_file(head, os.path.join(path, "value_head.safetensors"))
    else:
        hf_model.save_pretrained(path, state_dict=state)
    try:
        AutoTokenizer.from_pretrained(source).save_pretrained(path)
    except (OSError, ValueError) as err:
        warnings.warn(f"save_hf: no tokenizer copied from {source}: {err}", stacklevel=2)
