#!/usr/bin/env python
"""Rollout throughput of the `hf` and `vllm` backends on the same model, batch and sampling, on CPU.

    python tools/bench_rollout_hf_vs_vllm.py                      # tiny model, 1 and 2 threads
    python tools/bench_rollout_hf_vs_vllm.py --model small --prompts 64 --n 4 --max-tokens 128

Reports generated tokens/s (median of --repeats timed calls after a warm-up) per
backend and torch thread count, and the time of a full in-memory weight update.
A benchmark, not a test: nothing is asserted. Models are built under --work-dir
(default: the system's temporary directory), never the home directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def build(model: str, work: Path) -> str:
    from gearshift.models.tiny import PRESETS, build_model

    if os.path.isdir(model):
        return model
    if model not in PRESETS:
        raise SystemExit(f"--model {model!r} is neither a folder nor a preset from {sorted(PRESETS)}")
    return build_model(work / f"model-{model}", preset=model)


def sync_device(result):
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result


def median_seconds(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="preset (tiny, small, bench100m) or model folder")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts to try")
    p.add_argument("--stop-tokens", type=int, default=0,
                   help="treat this many token ids as stop tokens, so samples end at ragged lengths as in RL "
                        "(a random model otherwise always runs to --max-tokens)")
    p.add_argument("--dtype", default="float32", help="weights and compute dtype of both engines")
    p.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "gearshift-bench"))
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args()

    import torch

    from gearshift.backends.hf_rollout import HFRolloutEngine
    from gearshift.conformance.util import reference_weights
    from gearshift.rollout import SamplingParams
    from gearshift.weights import WeightBucket
    from gearshift_vllm import VLLMRolloutEngine

    work = Path(args.work_dir)
    path = build(args.model, work)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(32, 250, (args.prompts, args.prompt_len), generator=g).tolist()
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0,
                              stop_token_ids=tuple(range(32, 32 + args.stop_tokens)))
    host_threads = torch.get_num_threads()
    thread_counts = [int(t) for t in args.threads.split(",")]

    t0 = time.perf_counter()
    vllm_engine = VLLMRolloutEngine.build(path, dtype=args.dtype, cache_dir=str(work / "vllm-cache"), kv_cache_bytes=1 << 30)
    start_s = time.perf_counter() - t0
    hf_engine = HFRolloutEngine.build(path, dtype=args.dtype)
    weights = {k: v.to(vllm_engine.device) for k, v in reference_weights(path, vllm_engine.weight_spec()).items()}

    rows = []
    for threads in thread_counts:
        for name, engine in (("hf", hf_engine), ("vllm", vllm_engine)):
            torch.set_num_threads(threads)
            vllm_engine.num_threads = threads
            engine.generate(batch[:4], sampling)  # warm-up
            secs, out = median_seconds(lambda: engine.generate(batch, sampling), args.repeats)
            tokens = sum(len(r.token_ids) for r in out)
            load_s, _ = median_seconds(lambda: sync_device(engine.update_weights([WeightBucket(dict(weights))])),
                                       args.repeats)
            rows.append({"backend": name, "threads": threads, "sequences": len(out), "tokens": tokens,
                         "seconds": round(secs, 4), "tokens_per_s": round(tokens / secs, 1),
                         "update_weights_s": round(load_s, 4)})
    torch.set_num_threads(host_threads)
    vllm_engine.close()

    print(f"model {args.model} ({path}), {args.prompts} prompts x n={args.n}, up to {args.max_tokens} new tokens, "
          f"prompt length {args.prompt_len}, {args.stop_tokens} stop tokens; vLLM engine start {start_s:.1f} s")
    print(f"{'backend':8} {'threads':>7} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'update_weights':>15}")
    for r in rows:
        print(f"{r['backend']:8} {r['threads']:>7} {r['tokens']:>7} {r['seconds']:>8.3f} {r['tokens_per_s']:>9.1f} "
              f"{r['update_weights_s']:>13.4f} s")
    for threads in thread_counts:
        hf = next(r for r in rows if r["backend"] == "hf" and r["threads"] == threads)
        vl = next(r for r in rows if r["backend"] == "vllm" and r["threads"] == threads)
        print(f"threads={threads}: vllm/hf = {vl['tokens_per_s'] / hf['tokens_per_s']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "vllm_start_s": start_s, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
