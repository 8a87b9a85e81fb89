"""Moving tensors' memory to the host and back without replacing the tensors.

FSDP2 and the optimizer hold references to their tensors (the padded flat
shard behind each parameter, the reduce-scatter buffer behind a group's
gradients, Adam's moments). Rather than swapping objects under them, a
`HostStash` copies each tensor's storage to host memory and shrinks the device
storage to zero bytes; `restore` grows it again and copies the bytes back.
Every tensor keeps its identity, shape and strides, so the round trip is
bit-exact and nothing else needs telling.

The host side is one buffer per stash, allocated once at the size of what it
holds (or earlier, with `reserve`) and kept for every later offload: a switch
after the first allocates nothing. With a GPU the buffer is page-locked with
`cudaHostRegister`, which pins exactly its size (the caching pinned allocator
would round each block up, holding up to twice the bytes), so copies both
ways are DMA transfers.
"""

from __future__ import annotations

import warnings
from typing import Iterable

import torch

ALIGN = 64  # bytes: each storage starts on a boundary DMA engines like


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage` (on its device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class HostStash:
    """Storages moved to host memory; `restore` puts them back where they were. The host buffer stays."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, int, int]] = []  # (emptied storage, offset, bytes)
        self._buffer: torch.Tensor | None = None
        self._pinned = False

    def __len__(self) -> int:
        return len(self._saved)

    @property
    def nbytes(self) -> int:
        """Bytes held for the device now."""
        return sum(n for _, _, n in self._saved)

    @property
    def pinned(self) -> bool:
        """Whether the host buffer is page-locked (registered with CUDA), so copies to and from it run at full speed."""
        return self._pinned

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the stash keeps (held or not)."""
        return 0 if self._buffer is None else self._buffer.numel()

    @staticmethod
    def room_for(sizes: Iterable[int]) -> int:
        """Host bytes an offload of storages of these sizes takes (each starts on an aligned boundary)."""
        return sum(_aligned(n) for n in sizes)

    def reserve(self, nbytes: int) -> None:
        """Allocate (and pin, with a GPU) the host buffer now, so the first offload allocates nothing."""
        if self._saved:
            raise RuntimeError("reserve() while the stash holds state: restore() first")
        if self.host_bytes >= nbytes:
            return
        self.close()
        self._buffer = torch.empty(_aligned(nbytes), dtype=torch.uint8)
        self._pinned = _register(self._buffer)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages behind `tensors` to host memory and free them; returns bytes moved."""
        if self._saved:
            raise RuntimeError("the stash already holds state: restore() it before offloading again")
        storages: list[torch.UntypedStorage] = []
        seen: set[int] = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue  # views of one storage (a group's gradients) move once
            seen.add(storage.data_ptr())
            storages.append(storage)
        need = self.room_for(s.nbytes() for s in storages)
        if need > self.host_bytes:
            self.reserve(need)
        offset = 0
        for storage in storages:
            n = storage.nbytes()
            self._buffer[offset:offset + n].copy_(_bytes_of(storage), non_blocking=self._pinned)
            self._saved.append((storage, offset, n))
            offset += _aligned(n)
        _synchronize(storages)
        for storage in storages:
            storage.resize_(0)
        return self.nbytes

    def restore(self) -> int:
        """Reallocate every stashed storage at its old size and copy its bytes back; returns bytes moved."""
        for storage, offset, n in self._saved:
            storage.resize_(n)
            _bytes_of(storage).copy_(self._buffer[offset:offset + n], non_blocking=self._pinned)
        _synchronize(s for s, _, _ in self._saved)  # the host bytes must outlive the transfers
        moved = self.nbytes
        self._saved.clear()
        return moved

    def close(self) -> None:
        """Give the host buffer back (state still held is lost: restore first)."""
        if self._buffer is not None and self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._buffer.data_ptr())
        self._buffer, self._pinned = None, False

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock `buffer` where a GPU is present; False (plain host memory) otherwise. A GPU that refuses says
    so in a warning: copies to and from plain host memory run at a fraction of the speed."""
    if not torch.cuda.is_available() or buffer.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    code = int(getattr(err, "value", err))
    if code:
        warnings.warn(f"gearshift: could not page-lock {buffer.numel() / 2**30:.2f} GiB of host memory for "
                      f"offloaded state (cudaHostRegister error {code}; `ulimit -l` or the container's locked "
                      f"memory limit may be too low): offloads copy through plain host memory, several times "
                      f"slower", RuntimeWarning, stacklevel=3)
    return code == 0


def _synchronize(storages: Iterable[torch.UntypedStorage]) -> None:
    for device in {s.device for s in storages if s.device.type == "cuda"}:
        torch.cuda.synchronize(device)
