"""Moving tensors' memory to the host and back without replacing the tensors.

FSDP2 and the optimizer hold references to their tensors (the padded flat
shard behind each parameter, the reduce-scatter buffer behind a group's
gradients, Adam's moments). Rather than swapping objects under them, a
`HostStash` copies each tensor's storage to host memory (pinned when a GPU is
present, so the copy back is a DMA) and shrinks the device storage to zero
bytes; `restore` grows it again and copies the bytes back. Every tensor keeps
its identity, shape and strides, so the round trip is bit-exact and nothing
else needs telling.
"""

from __future__ import annotations

from typing import Iterable

import torch


class HostStash:
    """Storages moved to host memory; `restore` puts them back where they were."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # (emptied storage, host bytes)

    def __len__(self) -> int:
        return len(self._saved)

    @property
    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self._saved)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Copy the storages behind `tensors` to host memory and free them; returns bytes moved."""
        seen: set[int] = {s.data_ptr() for s, _ in self._saved}
        moved = []
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue  # views of one storage (a group's gradients) move once
            seen.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu",
                               pin_memory=torch.cuda.is_available())
            host.untyped_storage().copy_(storage, non_blocking=True)
            moved.append((storage, host))
        _synchronize(s for s, _ in moved)
        for storage, _ in moved:
            storage.resize_(0)
        self._saved.extend(moved)
        return sum(host.numel() for _, host in moved)

    def restore(self) -> int:
        """Reallocate every stashed storage at its old size and copy its bytes back; returns bytes moved."""
        for storage, host in self._saved:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=True)
        _synchronize(s for s, _ in self._saved)  # the host copies must outlive the transfers
        moved = self.nbytes
        self._saved.clear()
        return moved


def _synchronize(storages: Iterable[torch.UntypedStorage]) -> None:
    for device in {s.device for s in storages if s.device.type == "cuda"}:
        torch.cuda.synchronize(device)
