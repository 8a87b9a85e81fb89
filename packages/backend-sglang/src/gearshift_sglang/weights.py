"""Weights into an SGLang engine: buckets packed in SGLang's flattened format.

The engine's spec is the core's `gearshift.hf.weight_spec_of` (the trainer's names, whole):
SGLang's own loaders map them onto its fused modules (q, k and v into one `qkv_proj`), and so
does the direct load in its scheduler (direct.py).

A bucket travels to SGLang's scheduler process as one flat byte tensor plus
metadata (SGLang's `flattened_bucket` load format): one shared-memory buffer
to map, instead of one per weight. The buffer is kept between updates and grown
when a bucket needs more, so a sync allocates no shared memory after the first.
Each bucket's layout (offsets, metadata, a typed view of the buffer per tensor)
is worked out the first time its names are seen, in that order, and kept while
the buffer is: packing is then one cast-copy per tensor straight into its view,
batched (`copy_weights_`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gearshift.weights import copy_weights_


@dataclass
class FlatLayout:
    """Where the tensors of one bucket layout sit in the buffer."""

    id: int
    nbytes: int
    metadata: list  # SGLang's FlattenedTensorMetadata, one per tensor
    views: list[torch.Tensor]  # typed views of the buffer, one per tensor


class FlatBuckets:
    """Packs buckets of named tensors into one reused byte buffer, as SGLang's flattened bucket payload.

    Every tensor is packed in `dtype`; a name keeps its shape between buckets (the engine checks each
    bucket against its spec first)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._buffer: torch.Tensor | None = None
        #: which buffer this is: a new one (grown) gets a new number, and every layout is worked out again
        self.buffer_id = 0
        self._layouts: dict[tuple[str, ...], FlatLayout] = {}
        self._delivered: set[int] = set()
        self._next_layout = 0

    def pack(self, tensors: dict[str, torch.Tensor]) -> FlatLayout:
        """Copy (casting) `tensors` into the buffer; their layout there."""
        layout = self._layouts.get(tuple(tensors))
        if layout is None:
            layout = self._layout(tensors)
        with torch.no_grad():  # a trainer's parameter is read, never made part of a graph
            copy_weights_(layout.views, list(tensors.values()))
        if self._buffer.is_cuda:
            # SGLang's scheduler reads the buffer on its own stream; a buffer it already holds is not opened
            # again, and opening is what would have waited on this process's stream
            torch.cuda.current_stream(self._buffer.device).synchronize()
        return layout

    def payload(self, layout: FlatLayout) -> str:
        """The serialized payload for `update_weights_from_tensor(..., load_format="flattened_bucket")`."""
        from sglang.srt.utils import MultiprocessingSerializer

        flat = self._buffer[:layout.nbytes]
        return MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": layout.metadata},
                                                   output_str=True)

    def delivered(self, layout: FlatLayout) -> bool:
        """Whether the scheduler holds this buffer and layout already (`mark_delivered`)."""
        return layout.id in self._delivered

    def mark_delivered(self, layout: FlatLayout) -> None:
        self._delivered.add(layout.id)

    def _layout(self, tensors: dict[str, torch.Tensor]) -> FlatLayout:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        itemsize = self.dtype.itemsize
        spans, offset = [], 0
        for name, t in tensors.items():
            offset = _aligned(offset, itemsize)
            spans.append((name, torch.Size(t.shape), offset, offset + t.numel() * itemsize))
            offset = spans[-1][3]
        flat = self._take(offset)
        metadata = [FlattenedTensorMetadata(name=n, shape=shape, dtype=self.dtype, start_idx=start, end_idx=end,
                                            numel=end - start) for n, shape, start, end in spans]
        views = [flat[start:end].view(self.dtype).view(shape) for _, shape, start, end in spans]
        self._next_layout += 1
        layout = FlatLayout(self._next_layout, offset, metadata, views)
        self._layouts[tuple(tensors)] = layout
        return layout

    def _take(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self.release()
            buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            if buffer.device.type == "cpu":
                buffer.share_memory_()  # mapped by the scheduler process as it is, no copy on the way
            self._buffer = buffer
            self.buffer_id += 1
        return self._buffer

    def release(self) -> None:
        """Drop the buffer and every layout in it."""
        self._buffer = None
        self._layouts.clear()
        self._delivered.clear()


def _aligned(offset: int, itemsize: int) -> int:
    return -(-offset // itemsize) * itemsize
