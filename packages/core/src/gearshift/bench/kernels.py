"""Where a step's device time goes: one call under torch.profiler, its kernels summed by kind.

`profile_kinds(fn)` runs `fn` once under the profiler and returns the wall time, the time the device was
busy (the union of its kernels' intervals, so overlapping streams count once), and the kernel time of each
kind below: matrix products, attention, the optimizer's multi-tensor kernels, copies and casts, collectives,
and the rest (elementwise and reductions: norms, activations, softmax). On a CPU there are no kernels; the
operators with the most time of their own are listed instead. A step whose busy time is well under its wall
time waits on the host; one whose "other" kernels are a large share spends it outside the matrix products.
"""

from __future__ import annotations

import re
import time
from typing import Callable

import torch

#: kernel kinds, matched in this order against a kernel's name (case-insensitive)
KINDS = (
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|matmul|sm\d+_.*(?:tn|nt|nn|tt)_"),
    ("attention", r"flash|fmha|attention|sdpa|attn"),
    ("collective", r"nccl|all_?gather|reduce_?scatter|all_?reduce"),
    ("optimizer", r"multi_tensor|adam|foreach"),
    ("copy", r"memcpy|memset|copy|cast|convert|cat_?array|chunk_cat|fill"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.I):
            return kind
    return "other"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals, in their unit."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total, end = total + (e - s), e
        elif e > end:
            total, end = total + (e - end), e
    return total


def profile_kinds(fn: Callable[[], object], top: int = 5) -> dict:
    """Run `fn` once under torch.profiler: wall seconds, device-busy seconds, kernel seconds by kind, and the
    `top` kernels (on a CPU: operators by their own time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities):  # the profiler's own start-up (CUPTI, kineto) outside the measured call
        torch.zeros(1).add_(1)
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    intervals = []
    if cuda:
        for e in prof.profiler.kineto_results.events():
            if e.device_type() != torch.autograd.DeviceType.CUDA or e.duration_ns() <= 0:
                continue
            name, secs = e.name(), e.duration_ns() / 1e9
            kind = kind_of(name)
            by_kind[kind] = by_kind.get(kind, 0.0) + secs
            by_name[name] = by_name.get(name, 0.0) + secs
            intervals.append((e.start_ns() / 1e9, e.start_ns() / 1e9 + secs))
    else:
        for e in prof.key_averages():
            by_name[e.key] = e.self_cpu_time_total / 1e6
    names = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"wall_s": wall, "busy_s": busy_seconds(intervals) if cuda else None,
            "kinds_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), "top": names}


def kinds_row(p: dict) -> dict:
    """A result of `profile_kinds` as a few columns of a benchmark row."""
    row = {"profiled_s": p["wall_s"]}
    if p["busy_s"] is not None:
        row["device_busy"] = p["busy_s"] / p["wall_s"] if p["wall_s"] else 0.0
        total = sum(p["kinds_s"].values()) or 1.0
        for kind, _ in (*KINDS, ("other", "")):
            row[f"{kind}_share"] = p["kinds_s"].get(kind, 0.0) / total
    return row


def print_top(label: str, p: dict) -> None:
    what = "kernels" if p["busy_s"] is not None else "operators (own CPU time)"
    print(f"{label}: the {len(p['top'])} {what} with the most time")
    for name, secs in p["top"]:
        print(f"  {secs * 1e3:9.1f} ms  {name[:110]}")
