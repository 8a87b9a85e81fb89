"""A process group over two pools of ranks, beside each pool's own default group.

When training and rollout run on separate pools of processes, each pool runs
its engines on its own torch.distributed default group, as under torchrun.
Weights cross between the pools over a `Link`: a second group over the ranks
of both (train ranks first, then rollout ranks), made from its own store, so
the pools need no common default group. Gloo between CPUs, NCCL between GPUs.
A link carries point-to-point messages only; `gearshift.reshard.stream_plan`
sends over it when given it as `group`.
"""

from __future__ import annotations

import datetime
import time
from typing import Iterable

import torch
import torch.distributed as dist

from ..dist import DEFAULT_TIMEOUT_S

#: one message: ("send" | "recv", tensor, peer rank on the link, tag)
Message = tuple[str, torch.Tensor, int, int]


def open_store(host: str, size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The store a link rendezvous through, served by its rank 0 on a free port (`store.port`)."""
    return dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class Link:
    """Rank `rank` of a group of `size` ranks over two pools, for point-to-point messages.

    Rank 0 serves the store (`open_store`) and passes it in; the others connect to `host:port`.
    Every rank must construct its `Link` before any message moves (the constructor waits for all).
    """

    def __init__(self, host: str, port: int, rank: int, size: int, *, backend: str | None = None,
                 store: dist.Store | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"link rank {rank} is outside a link of {size} ranks")
        self.rank, self.size = rank, size
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, size, False, timeout=timeout)
        self._store = store  # rank 0's serves the others: it lives as long as the link
        prefixed = dist.PrefixStore("gearshift-link", store)
        if self.backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, size, options)
        elif self.backend == "gloo":
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
        else:
            raise ValueError(f"link backend {self.backend!r}: use gloo (CPU tensors) or nccl (GPU tensors)")

    def exchange(self, messages: Iterable[Message]) -> None:
        """Post every message (ordered by peer, then tag, the same way on both ends) and wait for all.

        On NCCL a rank either sends or receives in one exchange (a pool sends, the other
        receives): NCCL matches messages by order, and a pair that both sent and received
        could wait on each other.
        """
        messages = sorted(messages, key=lambda m: (m[2], m[3], m[0]))
        kinds = {m[0] for m in messages}
        if self.backend == "nccl" and len(kinds) > 1:
            raise ValueError("a rank both sends and receives in one exchange over an NCCL link")
        works = [self.group.send([t], peer, tag) if kind == "send" else self.group.recv([t], peer, tag)
                 for kind, t, peer, tag in messages]
        for work in works:
            work.wait()

    def bandwidth(self, sender: int, receiver: int, nbytes: int = 64 << 20, repeats: int = 3) -> float | None:
        """Bytes per second of one message of `nbytes` from `sender` to `receiver` (best of `repeats`).

        Both ranks call it (others return None at once); the first message warms the path up.
        """
        if self.rank not in (sender, receiver):
            return None
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        kind, peer = ("send", receiver) if self.rank == sender else ("recv", sender)
        best = float("inf")
        for i in range(repeats + 1):
            self._sync()
            start = time.perf_counter()
            self.exchange([(kind, buf, peer, i)])
            self._sync()
            if i:
                best = min(best, time.perf_counter() - start)
        return nbytes / best

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Let go of the group (every rank may call it; messages in flight are abandoned)."""
        shutdown = getattr(self.group, "shutdown", None)
        if self.backend == "nccl" and shutdown is not None:
            shutdown()
        self.group = None
