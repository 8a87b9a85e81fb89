#!/usr/bin/env python3
"""Switch latency of train/rollout pairs at several model shapes, every baseline in the same run.

    python3 tools/gpu/switch_matrix.py --models qwen2-0.5b,qwen2-7b --pairs fsdp/hf,fsdp/vllm --out $OUT

Each pair is built once per model and measured twice: with the rollout engine put to sleep and
woken every switch (offload of optimizer and grads forced: the full switch, KV-cache wake included)
and with the memory plan (`offload="auto"`: nothing moves when both sides fit). Prints one table
row per measurement and writes all of it as JSON. Training runs fp32 master weights (`--train-dtype bfloat16`:
bf16, as the GRPO scenario runs 7B), computing in bf16; rollout bf16.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from gearshift import dist as gdist, registry
from gearshift.bench import measure_pair
from gearshift.models import resolve_model

TRAIN_OPTIONS = {"fsdp": {"param_dtype": "bfloat16"}, "deepspeed": {"zero_stage": 3}}
ROLLOUT_OPTIONS = {"hf": {"dtype": "bfloat16"},
                   "vllm": {"dtype": "bfloat16", "gpu_memory_utilization": 0.3},
                   "sglang": {"dtype": "bfloat16"}}
MODES = {"full": ["optimizer", "grads"], "auto": "auto"}


def row(b, mode: str, dtype: str) -> dict:
    r = b.ratios()
    up = b.to_rollout
    return {"train": b.train, "rollout": b.rollout, "model": b.model, "mode": mode, "train_dtype": dtype,
            "bytes": b.bytes,
            "sync_s": b.sync_s, "copy_s": b.copy_s, "own_load_s": b.engine_load_s, "pcie_s": b.pcie_s,
            "naive_s": b.naive_s, "sync_over_copy": r["sync_over_copy"],
            "sync_over_own_load": r["sync_over_engine_load"], "naive_over_sync": r["naive_over_sync"],
            "to_rollout_s": up.seconds, "phases": {p.name: p.seconds for p in up.phases},
            "to_train_s": b.to_train.seconds, "notes": up.notes + b.to_train.notes, "foreach_s": b.foreach_s,
            "host_us_per_tensor": b.host_us_per_tensor, "detail": b.to_dict()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen2-0.5b")
    p.add_argument("--pairs", default="fsdp/hf,fsdp/vllm")
    p.add_argument("--modes", default="full,auto")
    p.add_argument("--switches", type=int, default=5)
    p.add_argument("--naive-switches", type=int, default=1)
    p.add_argument("--train-dtype", default="float32", help="the trainer's master weights")
    p.add_argument("--out", default="runs/switch_matrix")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    models = args.models.split(",")
    if len(models) > 1:  # one model a process: vLLM's sleep-mode allocator serves one engine per process
        codes = [subprocess.run([sys.executable, __file__, *sys.argv[1:], "--models", m, "--out", str(out / m)]).returncode
                 for m in models]
        rows = [r for m in models if (out / m / "switch_matrix.json").exists()
                for r in json.loads((out / m / "switch_matrix.json").read_text())]
        (out / "switch_matrix.json").write_text(json.dumps(rows, indent=1))
        sys.exit(max(codes))
    gdist.init()
    rows = []
    for model in models:
        t0 = time.perf_counter()
        path = resolve_model(model)
        print(f"[{model}] built or found in {time.perf_counter() - t0:.0f} s", flush=True)
        for pair in args.pairs.split(","):
            train_name, rollout_name = pair.split("/")
            t0 = time.perf_counter()
            train = registry.create("train", train_name, model=path, dtype=args.train_dtype,
                                    **TRAIN_OPTIONS.get(train_name, {}))
            rollout = registry.create("rollout", rollout_name, model=path, **ROLLOUT_OPTIONS.get(rollout_name, {}))
            print(f"[{model} {pair}] engines up in {time.perf_counter() - t0:.0f} s", flush=True)
            try:
                for mode in args.modes.split(","):
                    bench = measure_pair(train, rollout, args.switches, args.naive_switches,
                                         naive_dir="/tmp/gearshift-naive", labels=(train_name, rollout_name, model),
                                         offload=MODES[mode])
                    rows.append(row(bench, mode, args.train_dtype))
                    r = rows[-1]
                    print(f"[{model} {pair} {mode} {args.train_dtype}] sync {r['sync_s'] * 1e3:.1f} ms | copy {r['copy_s'] * 1e3:.1f} ms "
                          f"({r['sync_over_copy']:.2f}x) | one foreach copy {(r['foreach_s'] or 0) * 1e3:.1f} ms | "
                          f"host {r['host_us_per_tensor'] or 0:.1f} us/tensor | own load {r['own_load_s'] * 1e3:.1f} ms "
                          f"({r['sync_over_own_load']:.2f}x) | pcie {(r['pcie_s'] or 0) * 1e3:.1f} ms | naive "
                          f"{r['naive_s']:.2f} s ({r['naive_over_sync'] or 0:.0f}x) | to_rollout "
                          f"{r['to_rollout_s'] * 1e3:.1f}"
                          f" ms {json.dumps({k: round(v * 1e3, 1) for k, v in r['phases'].items()})} | to_train "
                          f"{r['to_train_s'] * 1e3:.1f} ms", flush=True)
                    for note in r["notes"]:
                        print(f"    note: {note}", flush=True)
                    (out / "switch_matrix.json").write_text(json.dumps(rows, indent=1))
            finally:
                train.close()
                rollout.close()
                del train, rollout
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
