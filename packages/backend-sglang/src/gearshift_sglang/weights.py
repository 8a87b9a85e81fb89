"""Weights into an SGLang engine: buckets packed in SGLang's flattened format.

The engine's spec is the core's `gearshift.hf.weight_spec_of` (the trainer's names, whole):
SGLang's own loaders map them onto its fused modules (q, k and v into one `qkv_proj`).

A bucket travels to SGLang's scheduler process as one flat byte tensor plus
metadata (SGLang's `flattened_bucket` load format): one shared-memory buffer
to map, instead of one per weight. The buffer is kept between updates and grown
when a bucket needs more, so a sync allocates no shared memory after the first.
"""

from __future__ import annotations

import torch


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
