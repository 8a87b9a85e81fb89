"""Weights into an SGLang engine: the spec it asks for, and buckets packed in SGLang's flattened format.

The spec names the weights as the trainer does (`AutoModelForCausalLM.named_parameters()`;
a tied head is listed once, its other name an alias), whole: SGLang's own
loaders map them onto its fused modules (q, k and v into one `qkv_proj`). It is
read from the config on the meta device, so no weights are loaded to learn it.

A bucket travels to SGLang's scheduler process as one flat byte tensor plus
metadata (SGLang's `flattened_bucket` load format): one shared-memory buffer
to map, instead of one per weight. The buffer is kept between updates and grown
when a bucket needs more, so a sync allocates no shared memory after the first.
"""

from __future__ import annotations

import torch

from gearshift.hf import tied_aliases
from gearshift.mesh import MeshSpec, Placement
from gearshift.weights import ParamSpec, WeightSpec


def hf_weight_spec(model_path: str, mesh: MeshSpec, dtype: torch.dtype) -> WeightSpec:
    """The trainable weights of the model at `model_path`, named as transformers names them, whole on every rank."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    placement = Placement.replicated(mesh)
    params = tuple(ParamSpec(name, tuple(p.shape), dtype, placement) for name, p in model.named_parameters())
    return WeightSpec(mesh, params, tied_aliases(model))


class FlatBuckets:
    """Packs buckets of named tensors into one reused byte buffer, as SGLang's flattened bucket payload."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None

    def pack(self, tensors: dict[str, torch.Tensor]) -> str:
        """The serialized payload for `update_weights_from_tensor(..., load_format="flattened_bucket")`."""
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        metadata, offset = [], 0
        for name, t in tensors.items():
            offset = _aligned(offset, t.element_size())
            size = t.numel() * t.element_size()
            metadata.append(FlattenedTensorMetadata(name=name, shape=t.shape, dtype=t.dtype, start_idx=offset,
                                                    end_idx=offset + size, numel=size))
            offset += size
        flat = self._take(offset)
        for meta, t in zip(metadata, tensors.values()):
            flat[meta.start_idx:meta.end_idx].copy_(t.detach().reshape(-1).view(torch.uint8))
        return MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metadata}, output_str=True)

    def _take(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None
            buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            if buffer.device.type == "cpu":
                buffer.share_memory_()  # mapped by the scheduler process as it is, no copy on the way
            self._buffer = buffer
        return self._buffer[:nbytes]

    def release(self) -> None:
        self._buffer = None


def _aligned(offset: int, itemsize: int) -> int:
    return -(-offset // itemsize) * itemsize
