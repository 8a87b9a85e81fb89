"""Timing every phase of a switch: seconds, bytes moved, peak memory; tables, JSON, Chrome traces.

Peak memory is the device allocator's high-water mark on CUDA and the
process's resident-set high-water mark (VmHWM, reset per phase through
/proc/self/clear_refs) on the CPU.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .dist import synchronize


@dataclass
class Phase:
    """One timed step of a switch."""

    name: str
    seconds: float = 0.0
    bytes: int = 0
    peak_bytes: int = 0
    start: float = 0.0  # seconds since the report began, for traces

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class SwitchReport:
    """The phases of one switch (or of several, merged), in order."""

    direction: str = ""
    phases: list[Phase] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the switch decided and why (what moved, what stayed)

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.phases)

    @property
    def peak_bytes(self) -> int:
        return max((p.peak_bytes for p in self.phases), default=0)

    def phase(self, name: str) -> Phase | None:
        return next((p for p in self.phases if p.name == name), None)

    def extend(self, other: "SwitchReport") -> "SwitchReport":
        offset = self.seconds
        for p in other.phases:
            self.phases.append(Phase(p.name, p.seconds, p.bytes, p.peak_bytes, p.start + offset))
        return self

    def to_dict(self) -> dict:
        return {
            "direction": self.direction,
            "seconds": self.seconds,
            "bytes": self.bytes,
            "peak_bytes": self.peak_bytes,
            "phases": [asdict(p) for p in self.phases],
            "notes": list(self.notes),
        }

    def table(self) -> str:
        """The breakdown as an aligned text table."""
        rows = [("phase", "seconds", "MB", "GB/s", "peak MB")]
        for p in self.phases + [Phase("total", self.seconds, self.bytes, self.peak_bytes)]:
            rows.append(
                (p.name, f"{p.seconds:.4f}", f"{p.bytes / 1e6:.1f}", f"{p.gbps:.2f}" if p.bytes else "-",
                 f"{p.peak_bytes / 1e6:.0f}")
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        lines.insert(len(lines) - 1, "-" * len(lines[0]))
        title = f"switch {self.direction}".strip()
        return f"{title}\n" + "\n".join(lines + [f"note: {n}" for n in self.notes])

    def write_json(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    def write_chrome_trace(self, path: str | os.PathLike, pid: int = 0) -> None:
        """Phases as complete events, viewable in chrome://tracing or Perfetto."""
        events = [
            {"name": p.name, "ph": "X", "ts": p.start * 1e6, "dur": p.seconds * 1e6, "pid": pid, "tid": 0,
             "args": {"bytes": p.bytes, "peak_bytes": p.peak_bytes}}
            for p in self.phases
        ]
        Path(path).write_text(json.dumps({"traceEvents": events}))


def proc_status_bytes(key: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM, ...) in bytes; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    """Start `peak_memory_bytes` afresh: the CUDA allocator's high-water mark, or the process's."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _reset_host_peak()


def _reset_host_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class PhaseTimer:
    """Times phases into a `SwitchReport`, synchronising the device at each boundary."""

    def __init__(self, device: torch.device | str = "cpu", direction: str = "") -> None:
        self.device = torch.device(device)
        self.report = SwitchReport(direction)
        self._t0 = time.perf_counter()

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_host_peak()

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return proc_status_bytes("VmHWM") or proc_status_bytes("VmRSS")

    @contextmanager
    def phase(self, name: str, nbytes: int = 0) -> Iterator[Phase]:
        """Time the block; set `.bytes` on the yielded phase when the size is known only inside."""
        synchronize(self.device)
        self._reset_peak()
        record = Phase(name, bytes=nbytes, start=time.perf_counter() - self._t0)
        begin = time.perf_counter()
        try:
            yield record
        finally:
            synchronize(self.device)
            record.seconds = time.perf_counter() - begin
            record.peak_bytes = self._peak()
            self.report.phases.append(record)

    def add(self, name: str, seconds: float, nbytes: int = 0) -> Phase:
        """Record a phase timed elsewhere (for example, interleaved with another)."""
        record = Phase(name, seconds, nbytes, self._peak(), time.perf_counter() - self._t0 - seconds)
        self.report.phases.append(record)
        return record


def median_report(reports: list[SwitchReport]) -> SwitchReport:
    """Per-phase medians over several switches of the same shape."""
    import statistics

    if not reports:
        return SwitchReport()
    names = [p.name for p in reports[0].phases]
    out = SwitchReport(reports[0].direction, notes=list(reports[-1].notes))
    for name in names:
        found = [r.phase(name) for r in reports if r.phase(name) is not None]
        out.phases.append(
            Phase(
                name,
                statistics.median(p.seconds for p in found),
                int(statistics.median(p.bytes for p in found)),
                max(p.peak_bytes for p in found),
            )
        )
    return out


def peak_memory_bytes() -> int:
    """The CUDA allocator's high-water mark, or the process's resident-set high-water mark.

    Beside an engine that maps memory through a pool of its own (vLLM's sleep mode), torch's figure also
    counts the pool's address space while it holds no memory: `step_peak_bytes` gives what the device held."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return proc_status_bytes("VmHWM")


def device_used_bytes() -> int | None:
    """Memory in use on the current CUDA device now, by every process and allocator (what nvidia-smi shows);
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def step_peak_bytes(samples: Sequence[int | None]) -> int:
    """A step's memory high point: on a GPU the highest of `samples` (`device_used_bytes()` taken at the ends
    of the step's phases, where torch's cache still holds each phase's peak); on a CPU the process's
    resident-set high-water mark."""
    used = [s for s in samples if s is not None]
    return max(used) if used else peak_memory_bytes()


def pyplot():
    """matplotlib.pyplot on a file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
