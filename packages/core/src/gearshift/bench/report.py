"""What the benchmarks print and write: a switch's figures beside its baselines (`SwitchBench`), rows of
backends side by side (`print_rows`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import dist as gdist
from ..profiler import SwitchReport


SYNC_PHASES = ("export", "load", "share")


def _sync_seconds(report: SwitchReport) -> float:
    return sum(p.seconds for p in report.phases if p.name in SYNC_PHASES)


@dataclass
class SwitchBench:
    """Medians of N switches of one pair, and the baselines measured beside them."""

    train: str
    rollout: str
    model: str
    bytes: int
    to_rollout: SwitchReport
    to_train: SwitchReport
    naive: SwitchReport
    copy_s: float
    engine_load_s: float
    pcie_s: float | None = None  # the same bytes from pinned host memory to the device (GPU only)
    #: switches that sent a LoRA trainer's adapter alone (`AdapterResharder`), where the pair can
    adapter: SwitchReport | None = None
    #: one batched copy (`torch._foreach_copy_`) of the same tensors: what a sync with no host work per tensor
    #: would take; and how many tensors a sync moves
    foreach_s: float | None = None
    tensors: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def sync_s(self) -> float:
        return _sync_seconds(self.to_rollout)

    @property
    def shared(self) -> bool:
        """The rollout engine served from the trainer's tensors: the sync copied nothing."""
        return self.to_rollout.phase("share") is not None

    @property
    def adapter_sync_s(self) -> float | None:
        return None if self.adapter is None else _sync_seconds(self.adapter)

    @property
    def adapter_bytes(self) -> int | None:
        return None if self.adapter is None else self.adapter.phase("load").bytes

    @property
    def host_us_per_tensor(self) -> float | None:
        """Microseconds per tensor the sync takes beyond one batched copy of the same tensors: its host work."""
        if self.foreach_s is None or not self.tensors:
            return None
        return max(self.sync_s - self.foreach_s, 0.0) / self.tensors * 1e6

    @property
    def naive_s(self) -> float:
        return sum(p.seconds for p in self.naive.phases if p.name in ("save", "load"))

    def ratios(self) -> dict[str, float]:
        return {
            "sync_over_copy": self.sync_s / self.copy_s if self.copy_s else float("inf"),
            "sync_over_engine_load": self.sync_s / self.engine_load_s if self.engine_load_s else float("inf"),
            # None where the naive round trip was not run (`--naive-switches 0`)
            "naive_over_sync": (self.naive_s / self.sync_s if self.sync_s else float("inf")) if self.naive_ran
            else None,
        }

    @property
    def naive_ran(self) -> bool:
        return any(p.name in ("save", "load") for p in self.naive.phases)

    def to_dict(self) -> dict:
        return {
            "train": self.train, "rollout": self.rollout, "model": self.model, "bytes": self.bytes,
            "shared": self.shared, "sync_s": self.sync_s, "naive_s": self.naive_s, "copy_s": self.copy_s,
            "engine_load_s": self.engine_load_s, "pcie_s": self.pcie_s, **self.ratios(),
            "to_rollout": self.to_rollout.to_dict(), "to_train": self.to_train.to_dict(),
            "naive": self.naive.to_dict(), "adapter_sync_s": self.adapter_sync_s, "adapter_bytes": self.adapter_bytes,
            "foreach_s": self.foreach_s, "tensors": self.tensors, "host_us_per_tensor": self.host_us_per_tensor,
            "adapter": self.adapter.to_dict() if self.adapter is not None else None, **self.extra,
        }

    def table(self) -> str:
        r = self.ratios()
        lines = [
            f"switch benchmark: train={self.train} rollout={self.rollout} model={self.model} "
            f"({self.bytes / 1e6:.1f} MB of weights)",
            self.to_rollout.table(), self.to_train.table(),
            "",
            f"{'sync (export + share), median':<38}{self.sync_s:10.4f} s  shared, no bytes copied" if self.shared else
            f"{'sync (export + load), median':<38}{self.sync_s:10.4f} s  {self.bytes / self.sync_s / 1e9:6.2f} GB/s",
            f"{'naive resharder (file round trip)':<38}{self.naive_s:10.4f} s  {r['naive_over_sync']:6.1f}x the sync"
            if self.naive_ran else f"{'naive resharder (file round trip)':<38}   not run (--naive-switches 0)",
            f"{'copy limit (plain copy, same bytes)':<38}{self.copy_s:10.4f} s  sync is {r['sync_over_copy']:.2f}x"
            + (" (with the exchange between ranks)" if gdist.world_size() > 1 else ""),
            f"{'own load (the engine alone)':<38}{self.engine_load_s:10.4f} s  "
            f"sync is {r['sync_over_engine_load']:.2f}x",
        ]
        if self.foreach_s is not None:
            lines.append(f"{'one batched copy (_foreach_copy_)':<38}{self.foreach_s:10.4f} s  sync is "
                         f"{self.sync_s / max(self.foreach_s, 1e-9):.2f}x; host work "
                         f"{self.host_us_per_tensor:.1f} us per tensor ({self.tensors} tensors)")
        if self.pcie_s is not None:
            lines.append(f"{'PCIe (pinned host to device)':<38}{self.pcie_s:10.4f} s  "
                         f"sync is {self.sync_s / self.pcie_s:.2f}x")
        if self.adapter is not None:
            lines.append(f"{'adapter sync (the adapter alone)':<38}{self.adapter_sync_s:10.4f} s  "
                         f"{self.adapter_bytes / 1e6:.2f} MB instead of {self.bytes / 1e6:.1f} MB")
        if gdist.world_size() > 1 and "from_other_ranks" in self.extra:
            layouts = f"this rank, train {self.extra['train_mesh']} -> rollout {self.extra['rollout_mesh']}"
            lines.append(f"{layouts:<38}{self.extra['from_other_ranks'] / 1e6:10.3f} MB from other ranks, "
                         f"{self.extra['to_other_ranks'] / 1e6:.3f} MB to them")
        if "whole_bytes" in self.extra:
            whole, s = self.extra["whole_bytes"], self.extra["whole_sync_s"]
            lines.append(f"{'received per rank, slices declared':<38}{self.bytes / 1e6:10.3f} MB  "
                         f"{self.bytes / whole:.3f}x the {whole / 1e6:.3f} MB of whole weights "
                         f"({self.extra['whole_from_other_ranks'] / 1e6:.3f} MB of them from other ranks)")
            lines.append(f"{'sync with whole weights declared':<38}{s:10.4f} s  sync is {self.sync_s / s:.2f}x")
        if self.extra.get("rollout_load_path"):
            lines.append(f"{'rollout engine loads by':<38}{self.extra['rollout_load_path']}")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> bool:
        from ..profiler import pyplot

        plt = pyplot()
        if plt is None:
            return False
        bars = {
            "gearshift\n(to rollout)": [(p.name, p.seconds) for p in self.to_rollout.phases],
            "naive": [(p.name, p.seconds) for p in self.naive.phases if p.name in ("save", "load")],
            "copy limit": [("copy", self.copy_s)],
            "engine load": [("engine load", self.engine_load_s)],
        }
        if self.adapter is not None:
            bars["adapter\nsync"] = [(p.name, p.seconds) for p in self.adapter.phases if p.name in SYNC_PHASES]
        fig, ax = plt.subplots(figsize=(7, 4))
        colors: dict[str, Any] = {}
        cmap = plt.get_cmap("tab10")
        for i, (label, parts) in enumerate(bars.items()):
            bottom = 0.0
            for name, secs in parts:
                color = colors.setdefault(name, cmap(len(colors) % 10))
                ax.bar(i, secs, bottom=bottom, color=color, label=name if name not in ax.get_legend_handles_labels()[1] else None)
                bottom += secs
        ax.set_xticks(range(len(bars)), list(bars))
        ax.set_ylabel("seconds (median)")
        ax.set_title(f"switch: {self.train} -> {self.rollout}, {self.bytes / 1e6:.0f} MB")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return True


def print_rows(rows: list[dict]) -> None:
    if gdist.rank() != 0 or not rows:
        return
    keys = list(rows[0])
    cells = [keys] + [[f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(keys))]
    for i, c in enumerate(cells):
        print("  ".join(x.rjust(w) for x, w in zip(c, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
