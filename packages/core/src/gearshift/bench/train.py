"""The train benchmark: optimizer steps/s, tokens/s, padding and step memory of train backends, side by side."""

from __future__ import annotations

import argparse

import torch

from .. import dist as gdist, registry
from ..flops import engine_train_flops, train_rates
from ..options import json_object, positive_int
from ..profiler import peak_memory_bytes, reset_peak_memory
from .report import print_rows
from .kernels import kinds_row, print_top, profile_kinds
from .timing import median_seconds, resolve_once


def train_batch(batch_size: int, seq_len: int, min_len: int | None = None, seed: int = 0):
    """Random rows, half prompt and half response, `seq_len` tokens each, or of lengths drawn uniformly
    from [min_len, seq_len] (right-padded to the longest)."""
    from ..train import TrainBatch

    g = torch.Generator().manual_seed(seed)
    if min_len is None or min_len >= seq_len:
        lengths = [seq_len] * batch_size
    else:
        lengths = torch.randint(max(min_len, 2), seq_len + 1, (batch_size,), generator=g).tolist()
    prompts = [torch.randint(32, 200, (n // 2,), generator=g).tolist() for n in lengths]
    responses = [torch.randint(32, 200, (n - n // 2,), generator=g).tolist() for n in lengths]
    return TrainBatch.from_sequences(prompts, responses)


def step_peak_bytes(fn) -> int:
    """The most memory `fn` allocates beyond what was allocated when it started (activations, gradients):
    the CUDA allocator's count, or on a CPU the allocations torch's profiler records."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


def measure_train(names: list[str], model: str, batch_size: int = 16, seq_len: int = 64, steps: int = 3,
                  options: dict | None = None, *, min_len: int | None = None, micro_batch_size: int | None = None,
                  token_budgets: tuple[int, ...] = (0,), meshes: tuple[str, ...] = ("",),
                  dtype: str | None = None, profile: bool = False) -> list[dict]:
    """Optimizer steps/s and tokens/s of each train backend on the same model and batch, once per token
    budget (0: micro-batches of `micro_batch_size` rows, as wide as the batch; else rows packed by length
    into micro-batches of that many tokens, `max_tokens_per_micro_batch`, with no cap on their rows:
    `micro_batch_size` rows x `seq_len` is the budget that bounds memory as the fixed count does).

    tokens_per_s counts the batch's real tokens; pad_share is the share of padding in the tokens the
    engine computed (from its `pad_frac` metric; '-' for an engine that does not report it). Each of
    `meshes` ('' for the default, 'sp=2', 'tp=2', ...) gets its rows, every rank given the whole batch;
    step_peak_mb is what one step allocates beyond what it started with (activations, gradients),
    measured in an extra step; train_tflops is the model FLOPs of a step (`gearshift.flops`) over its median
    time, mfu their share of the device's peak where it is known. `dtype` is the weights' dtype (None: the
    engine's default); `profile` runs one more step under torch.profiler and adds where its device time went
    (`gearshift.bench.kernels`).
    """
    from ..train import nll_loss

    gdist.init()
    path = resolve_once(model)
    batch = train_batch(batch_size, seq_len, min_len)
    real_tokens = int(batch.lengths.sum())
    rows = []
    for name, budget, mesh in ((n, b, m) for n in names for b in token_budgets for m in meshes):
        reset_peak_memory()
        engine = registry.create("train", name, model=path, lr=1e-5,
                                 micro_batch_size=None if budget else micro_batch_size,
                                 max_tokens_per_micro_batch=budget or None, **({"dtype": dtype} if dtype else {}),
                                 **(options or {}).get(name, {}),
                                 **({"mesh": mesh} if mesh else {}))
        metrics = engine.train_step(batch, nll_loss)  # warm-up
        secs = median_seconds(lambda: engine.train_step(batch, nll_loss), steps)
        step_peak = step_peak_bytes(lambda: engine.train_step(batch, nll_loss))
        pad = metrics.get("pad_frac")
        kinds = profile_kinds(lambda: engine.train_step(batch, nll_loss)) if profile else None
        flops = engine_train_flops(engine, batch.lengths.tolist())
        rates = train_rates(flops, secs, engine.device) if flops else {}
        rows.append({"backend": name, **({"mesh": str(engine.mesh)} if meshes != ("",) else {}),
                     "model": model, "dtype": engine.args.dtype, "batch": batch_size, "seq_len": seq_len,
                     "micro_batch_size": "-" if budget else micro_batch_size or "-", "max_tokens": budget or "-",
                     "micro_batches": int(metrics.get("micro_batches", 0)) or "-",
                     "pad_share": pad if pad is not None else "-",
                     "seconds_per_step": secs, "steps_per_s": 1 / secs, "tokens_per_s": real_tokens / secs,
                     "train_tflops": rates.get("perf/train_tflops", "-"), "mfu": rates.get("perf/mfu", "-"),
                     "peak_gb": peak_memory_bytes() / 1e9, "step_peak_mb": step_peak / 2**20,
                     **(kinds_row(kinds) if kinds else {})})
        if kinds:
            print_top(f"{name}, {rows[-1]['micro_batches']} micro-batches", kinds)
        engine.close()
    return rows


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default="torch", help="comma-separated train backends (e.g. torch,fsdp)")
    p.add_argument("--model", default="small", help="model folder or preset (default small)")
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--min-len", type=positive_int, default=None,
                   help="row lengths drawn uniformly from [min-len, seq-len] (default: all seq-len, no padding)")
    p.add_argument("--micro-batch-size", type=positive_int, default=None, help="rows per micro-batch (default: all)")
    p.add_argument("--max-tokens-per-micro-batch", default="0",
                   help="comma-separated token budgets, one row each; 0: micro-batches of --micro-batch-size "
                        "rows; N: rows packed by length into N tokens (--micro-batch-size 8 --seq-len 256 "
                        "--max-tokens-per-micro-batch 0,2048 puts the two under the same memory bound side by side)")
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--dtype", default=None, help="the weights' dtype (e.g. bfloat16; default: the engine's)")
    p.add_argument("--profile", action="store_true",
                   help="one more step under torch.profiler: the device's busy share and its kernel time by kind "
                        "(matrix products, attention, optimizer, copies, collectives, the rest), top kernels")
    p.add_argument("--options", type=json_object, default="{}", help="JSON: {backend: {engine options}}")
    p.add_argument("--mesh", action="append", default=None,
                   help="a train mesh to measure (repeat for several, e.g. --mesh dp=2 --mesh sp=2 under torchrun); "
                        "default: the backend's own")


def bench_train(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    budgets = tuple(int(b) for b in args.max_tokens_per_micro_batch.split(",") if b.strip())
    print_rows(measure_train(names, args.model, args.batch_size, args.seq_len, args.steps, args.options,
                             min_len=args.min_len, micro_batch_size=args.micro_batch_size,
                             token_budgets=budgets or (0,), meshes=tuple(args.mesh or ("",)),
                             dtype=args.dtype, profile=args.profile))
    return 0
