"""The rollout benchmark: generated tokens/s of rollout backends on the same model and batch."""

from __future__ import annotations

import argparse
import statistics
import time

from .. import registry
from ..options import json_object, positive_int
from ..rollout import SamplingParams
from .report import print_rows
from .timing import resolve_once


def measure_rollout(names: list[str], model: str, prompts: int = 16, n: int = 4, max_tokens: int = 64,
                    repeats: int = 3, options: dict | None = None) -> list[dict]:
    """Generated tokens/s of each rollout backend on the same model and batch (sampling, fixed seed)."""
    path = resolve_once(model)
    batch = [[(7 * i + j) % 200 + 32 for j in range(8 + i % 5)] for i in range(prompts)]
    sampling = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=0)
    rows = []
    for name in names:
        engine = registry.create("rollout", name, model=path, **(options or {}).get(name, {}))
        engine.generate(batch[:2], sampling)  # warm-up
        times, tokens = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = engine.generate(batch, sampling)
            times.append(time.perf_counter() - t0)
            tokens = sum(len(r.token_ids) for r in out)
        secs = statistics.median(times)
        rows.append({"backend": name, "model": model, "sequences": len(batch) * n, "tokens": tokens,
                     "seconds": secs, "tokens_per_s": tokens / secs})
        engine.close()
    return rows


def add_rollout_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default="hf", help="comma-separated rollout backends (e.g. hf,vllm)")
    p.add_argument("--model", default="small", help="model folder or preset (default small)")
    p.add_argument("--prompts", type=positive_int, default=16)
    p.add_argument("--n", type=positive_int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--repeats", type=positive_int, default=3)
    p.add_argument("--options", type=json_object, default="{}", help="JSON: {backend: {engine options}}")


def bench_rollout(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.backends.split(",") if n.strip()]
    print_rows(measure_rollout(names, args.model, args.prompts, args.n, args.max_tokens, args.repeats,
                               args.options))
    return 0
