"""Moving ZeRO's state to host memory and back, by gearshift's tags, through DeepSpeed's `offload_states`.

Each tag is a set of DeepSpeed's state kinds:

| tag | DeepSpeed states | what they are |
| --- | --- | --- |
| params | lp_params | the weights forward reads (bf16 under mixed precision; this rank's partition at ZeRO-3) |
| grads | lp_grads, contiguous_grad_buffer | reduced gradient partitions, the reduction buckets |
| optimizer | hp_params, optim_states | fp32 master partitions, Adam's moments |

DeepSpeed moves each kind with the buffers only it knows about (flat groups,
pinned staging copies, caches), and `reload_states` brings back everything it
moved. Where DeepSpeed refuses a kind (ZeRO-3 moves master weights and Adam
state only for its FusedAdam; nothing moves while it offloads parameters itself),
the tensors behind it go to a `HostStash` instead: storages copied out and freed
in place, so the optimizer keeps the same tensor objects. Each tag keeps its
stash, and so its host buffer (pinned on a GPU), for every later offload; `reserve`
allocates it at start, so the first switch copies as fast as the next. DeepSpeed pins the
buffers of what it moves itself at its first offload and keeps them: `reserve` runs one
round trip of those kinds at start for the same reason. Frozen weights (LoRA's
base) lie outside ZeRO-1/2's flat groups, so the stash takes them with `params`;
at ZeRO-3 DeepSpeed's move of `lp_params` breaks on them (it maps every
parameter's partition into a buffer that holds only the trainable ones), so the
stash takes every partition there. Either way the round
trip is bit-exact. ZeRO-3's move runs with the host's heap frozen
(`gearshift.containment.heap_frozen`), so the full garbage collection DeepSpeed ends
it with walks only what the move made. Bytes are what leaves (or returns to) the device: on a CPU
the state already lives in host memory, DeepSpeed's bookkeeping runs but copies
nothing, and the count is 0.
"""

from __future__ import annotations

from typing import Sequence

import torch
from gearshift.containment import heap_frozen
from gearshift.offload import HostStash

TAG_STATES: dict[str, tuple[str, ...]] = {
    "params": ("lp_params",),
    "grads": ("lp_grads", "contiguous_grad_buffer"),
    "optimizer": ("hp_params", "optim_states"),
}


class ZeroOffloader:
    """Offload and onload of one DeepSpeed engine's state, tag by tag."""

    def __init__(self, engine, frozen: Sequence[torch.Tensor] = ()) -> None:
        self.engine = engine
        self.device = torch.device(engine.device)
        self._frozen = list(frozen)  # parameters that train not (LoRA's base): outside ZeRO-1/2's flat groups
        self._away: set[str] = set()
        # kept: their host buffers are reused (a new one would be allocated and pinned at every offload)
        self._stashes: dict[str, HostStash] = {tag: HostStash() for tag in TAG_STATES}

    @property
    def away(self) -> set[str]:
        return set(self._away)

    def offload(self, tags: Sequence[str]) -> int:
        """Move the state of `tags` (not already away) to host memory; returns device bytes freed."""
        new = [t for t in tags if t not in self._away]
        if not new:
            return 0
        before = self._allocated()
        kinds = [k for t in new for k in TAG_STATES[t] if self._deepspeed_moves(k)]
        if kinds:
            self._offload_states(kinds)
        for tag in new:
            self._stashes[tag].offload(t for k in TAG_STATES[tag] for t in self._stashed(k) if t.device.type != "cpu")
        self._away.update(new)
        return max(before - self._allocated(), 0)

    def onload(self, tags: Sequence[str]) -> int:
        """Bring the state of `tags` back to the device bit-exactly; returns device bytes restored."""
        back = [t for t in tags if t in self._away]
        if not back:
            return 0
        before = self._allocated()
        staying = [k for t in self._away - set(back) for k in TAG_STATES[t] if self._deepspeed_moves(k)]
        if any(self._deepspeed_moves(k) for t in back for k in TAG_STATES[t]):
            self.engine.reload_states()  # everything DeepSpeed moved comes back: send the rest away again
            if staying:
                self._offload_states(staying)
        for tag in back:
            self._stashes[tag].restore()
        self._away.difference_update(back)
        return max(self._allocated() - before, 0)

    def stash_sizes(self, tag: str, device_only: bool = True) -> list[int]:
        """Bytes of each storage the stash takes for `tag` at an offload (on the device only, or wherever it
        lies); before the first step, Adam's moments as the step will allocate them: two per master partition."""
        sizes: dict[int, int] = {}
        for kind in TAG_STATES[tag]:
            tensors = self._stashed(kind)
            if kind == "optim_states" and not tensors and not self._deepspeed_moves(kind):
                masters = [t for t in self._tensors("hp_params") if not device_only or t.device.type != "cpu"]
                sizes.update(((id(t), i), t.numel() * t.element_size()) for t in masters for i in range(2))
                continue
            sizes.update((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors
                         if t.untyped_storage().nbytes() and (not device_only or t.device.type != "cpu"))
        return list(sizes.values())

    def reserve(self, tags: Sequence[str]) -> int:
        """Allocate (and pin, on a GPU) now the host buffers an offload of `tags` copies into; returns the host
        bytes the stashes hold."""
        for tag in tags:
            sizes = self.stash_sizes(tag)
            if sizes and tag not in self._away:
                self._stashes[tag].reserve(HostStash.room_for(sizes))
        moved = [k for t in tags for k in TAG_STATES[t] if self._deepspeed_moves(k)]
        if moved and not self._away:
            # DeepSpeed allocates and pins the host buffers of what it moves at its first `offload_states` and
            # keeps them: one round trip now makes that a cost of the start, not of the first switch
            self._offload_states(moved)
            self.engine.reload_states()
        return sum(s.host_bytes for s in self._stashes.values())

    def close(self) -> None:
        """Give the host buffers back."""
        for stash in self._stashes.values():
            stash.close()

    # --- DeepSpeed's side -----------------------------------------------------------------
    def _deepspeed_moves(self, kind: str) -> bool:
        """Whether DeepSpeed's `offload_states` moves this kind of state for this engine."""
        offload_param = self.engine.zero_offload_param()
        if offload_param is not None and str(getattr(offload_param.device, "value", offload_param.device)) != "none":
            return False  # "Moving states across devices is not supported for offloaded parameters"
        if self.engine.zero_optimization_stage() == 3 and kind in ("hp_params", "optim_states"):
            return type(self.engine.optimizer.optimizer).__name__ == "FusedAdam"
        if self.engine.zero_optimization_stage() == 3 and kind == "lp_params" and self._frozen:
            # its lp buffer holds the trainable partitions, but the move maps every parameter into it
            return False
        return True

    def _offload_states(self, kinds: list[str]) -> None:
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        # pinned staging buffers make the copy back a DMA; on a CPU there is nothing to stage. ZeRO-3's move frees
        # what it moves by dropping references and ends in a full gc.collect() (`heap_frozen`); ZeRO-1/2 collects
        # to free the references it clears: its heap is left as it is
        with heap_frozen(self.engine.zero_optimization_stage() == 3):
            self.engine.offload_states(include=[OffloadStateTypeEnum(k) for k in kinds],
                                       device=OffloadDeviceEnum.cpu, pin_memory=self.device.type == "cuda",
                                       non_blocking=False)

    def _stashed(self, kind: str) -> list[torch.Tensor]:
        """The tensors of a kind that go to the stash: all of them where DeepSpeed will not move the kind;
        else those outside its buffers (frozen weights at ZeRO-1/2)."""
        if not self._deepspeed_moves(kind):
            return self._tensors(kind)
        return self._tensors(kind) if kind == "lp_params" and self.engine.zero_optimization_stage() < 3 else []

    def _tensors(self, kind: str) -> list[torch.Tensor]:
        """The tensors behind a kind, where the engine can name them."""
        zero = self.engine.optimizer
        if kind == "hp_params":
            flat = getattr(zero, "fp32_partitioned_groups_flat", None)
            return list(flat if flat is not None else zero.single_partition_of_fp32_groups)
        if kind == "optim_states":
            return [v for st in zero.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        if kind == "lp_params":
            if self.engine.zero_optimization_stage() == 3:  # every parameter's partition, frozen ones too
                return [p.ds_tensor for p in self.engine.module.parameters()]
            return [p.data for p in self._frozen]  # outside ZeRO-1/2's flat groups
        return []  # gradient buffers stay where DeepSpeed keeps them

    def _allocated(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)
