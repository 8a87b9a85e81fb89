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

    def __init__(self, device: torch.device, dtype: torch.dtype, group_bytes: int = 0) -> None:
        self.device = device
        self.dtype = dtype
        #: the size a group of buckets (`add`) fills before it is sent; the buffer holds at least this much
        self.group_bytes = int(group_bytes)
        self._buffer: torch.Tensor | None = None
        #: which buffer this is: a new one (grown) gets a new number, and every layout is worked out again
        self.buffer_id = 0
        self._layouts: dict[tuple[str, ...], FlatLayout] = {}
        self._delivered: set[int] = set()
        self._next_layout = 0
        #: the open group: (name, shape, start, end) of every tensor added since the last `close`
        self._open: list[tuple[str, torch.Size, int, int]] = []
        #: views of the buffer for a bucket added at an offset, by (offset, names), kept while the buffer is
        self._part_views: dict[tuple[int, tuple[str, ...]], list[torch.Tensor]] = {}

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

    # --- groups: several buckets in one layout, sent as one -------------------------------------
    @property
    def open_bytes(self) -> int:
        """The bytes of the open group (0: none)."""
        return self._open[-1][3] if self._open else 0

    def add(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Copy (casting) `tensors` into the buffer after the open group's; False, with nothing copied, when
        they do not fit beside it (close the group first). Into an empty group they always go: the buffer
        grows when one bucket needs more (a new buffer, every layout worked out again)."""
        start = self.open_bytes
        spans = self._spans(tensors, start)
        end = spans[-1][3] if spans else start
        if self._buffer is None or self._buffer.numel() < end:
            if self._open:
                return False
            self._take(max(end, self.group_bytes))
        key = (start, tuple(tensors))
        views = self._part_views.get(key)
        if views is None:
            views = self._part_views[key] = self._views(spans)
        with torch.no_grad():  # a trainer's parameter is read, never made part of a graph
            copy_weights_(views, list(tensors.values()))
        self._open.extend(spans)
        return True

    def close(self) -> FlatLayout | None:
        """The open group's layout (the copies into it finished), the group emptied; None when it was empty.
        A group of the same names, in the same order, is the same layout every time (`delivered` holds)."""
        if not self._open:
            return None
        spans, self._open = self._open, []
        key = tuple(n for n, _, _, _ in spans)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout_of(key, spans)
        if self._buffer.is_cuda:
            torch.cuda.current_stream(self._buffer.device).synchronize()  # as `pack` does
        return layout

    def drop_open(self) -> None:
        """Forget the open group (an update that failed half way)."""
        self._open = []

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
        spans = self._spans(tensors, 0)
        self._take(spans[-1][3] if spans else 0)
        return self._layout_of(tuple(tensors), spans)

    def _spans(self, tensors: dict[str, torch.Tensor], offset: int) -> list[tuple[str, torch.Size, int, int]]:
        """(name, shape, start, end) of each tensor packed from byte `offset` on."""
        itemsize, spans = self.dtype.itemsize, []
        for name, t in tensors.items():
            offset = _aligned(offset, itemsize)
            spans.append((name, torch.Size(t.shape), offset, offset + t.numel() * itemsize))
            offset = spans[-1][3]
        return spans

    def _views(self, spans) -> list[torch.Tensor]:
        return [self._buffer[start:end].view(self.dtype).view(shape) for _, shape, start, end in spans]

    def _layout_of(self, names: tuple[str, ...], spans) -> FlatLayout:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        metadata = [FlattenedTensorMetadata(name=n, shape=shape, dtype=self.dtype, start_idx=start, end_idx=end,
                                            numel=end - start) for n, shape, start, end in spans]
        self._next_layout += 1
        layout = FlatLayout(self._next_layout, spans[-1][3] if spans else 0, metadata, self._views(spans))
        self._layouts[names] = layout
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
        self._part_views.clear()
        self._open = []


def _aligned(offset: int, itemsize: int) -> int:
    return -(-offset // itemsize) * itemsize


class Sources:
    """The trainer's own tensors (`WeightBucket.lent`) that SGLang's scheduler copies from at each sync.

    The first sync hands the scheduler every landed weight's tensor (CUDA IPC on a GPU; on a CPU the
    storages move into shared memory, in place, on the way) and it keeps them; a later sync whose
    tensors are the same storages at the same places sends no tensor at all, and the scheduler copies
    from what it holds, all weights in one batched copy: the bytes cross once and no buffer sits between.
    Any change (a parameter the trainer made anew, another set of weights) hands them over again.

    This side keeps the tensors too, so no storage the scheduler reads is freed and its address given
    to another tensor while the scheduler still maps the old one; `release` drops them on both sides.
    """

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self._key: tuple | None = None
        #: the bytes held
        self.nbytes = 0
        #: how often the tensors were handed over (a benchmark or test reads it)
        self.handed = 0

    @staticmethod
    def key(tensors: dict[str, torch.Tensor]) -> tuple:
        """Where each tensor lies: its first element's address, shape, strides and dtype. The tensors held
        keep their storages alive, so a tensor at the same address as a held one is in that same storage."""
        return tuple((n, t.data_ptr(), t.dtype, t.shape, t.stride()) for n, t in tensors.items())

    def known(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether the scheduler holds exactly these tensors: the held tensor objects themselves, still where
        they were (a trainer hands the same ones at each sync: no shape or stride to read), or others at the
        same places."""
        key, held = self._key, self.held
        if key is None:
            return False
        if len(tensors) == len(key) and all(n == k[0] and held[n] is t and k[1] == t.data_ptr()
                                            for (n, t), k in zip(tensors.items(), key)):
            return True
        return key == self.key(tensors)

    def payload(self, tensors: dict[str, torch.Tensor]) -> str:
        """SGLang's serialized form of `tensors` (storages shared, never copied); they are held from now on."""
        from sglang.srt.utils import MultiprocessingSerializer

        with torch.no_grad():
            payload = MultiprocessingSerializer.serialize(list(tensors.items()), output_str=True)
        self.held, self._key = dict(tensors), None  # marked known once the scheduler has them (`handed_over`)
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return payload

    def handed_over(self) -> None:
        self._key = self.key(self.held)  # after: a CPU storage moved into shared memory as it was serialized
        self.handed += 1

    def release(self) -> None:
        self.held, self._key, self.nbytes = {}, None, 0
