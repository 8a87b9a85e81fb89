#!/usr/bin/env python3
"""Switch benchmark over every installed (train, rollout) pair that runs here; writes a markdown table.

    python tools/bench_matrix.py --model bench100m --switches 5 --out runs/bench/matrix.md

Each pair is measured in its own process (engines do not share a process between pairs), with
`gearshift bench switch`, whose JSON this script reads back. Besides each pair's default, a pair
that shares the trainer's tensors is measured copying too (`--share off`), and vLLM on CPU with
its oneDNN packed weight layout (`cpu_weights=packed`) too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from gearshift import registry


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bench100m", help="model folder or preset (default bench100m)")
    p.add_argument("--switches", type=int, default=5)
    p.add_argument("--naive-switches", type=int, default=3)
    p.add_argument("--out", default="runs/bench/matrix.md")
    p.add_argument("--pairs", default="", help="comma-separated train/rollout pairs (default: all ready)")
    args = p.parse_args()
    ready = {k: [b.name for b in registry.list_backends(k) if b.ready] for k in ("train", "rollout")}
    pairs = ([tuple(x.split("/")) for x in args.pairs.split(",") if x] or
             [(t, r) for t in ready["train"] for r in ready["rollout"]])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for train, rollout in pairs:
        variants = [("default", [])]
        while variants:
            label, extra = variants.pop(0)
            print(f"== {train} -> {rollout} ({label})", flush=True)
            folder = out.parent / label
            cmd = [sys.executable, "-m", "gearshift", "bench", "switch", "--train", train, "--rollout", rollout,
                   "--model", args.model, "--switches", str(args.switches),
                   "--naive-switches", str(args.naive_switches), "--out", str(folder), *extra]
            proc = subprocess.run(cmd, text=True, capture_output=True)
            if proc.returncode != 0:
                why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?"
                rows.append(f"| {train} | {rollout} | {label} | failed: {why} | | | | | | | | |")
                continue
            r = json.loads(next(folder.glob(f"switch-{train}-{rollout}*.json")).read_text())
            mode = "shared" if r["shared"] else {"default": "copy", "packed": "copy (packed)"}.get(label, label)
            rows.append(
                f"| {train} | {rollout} | {mode} | {r['bytes'] / 1e6:.0f} | {r['sync_s']:.3f} | {r['copy_s']:.3f} | "
                f"{r['engine_load_s']:.3f} | {r['naive_s']:.3f} | {r['sync_over_copy']:.2f}x | "
                f"{r['sync_over_engine_load']:.2f}x | "
                + (f"{r['naive_over_sync']:.1f}x |" if r["naive_over_sync"] is not None else "not run |"))
            if label == "default":
                if r["shared"]:
                    variants.append(("copy", ["--share", "off"]))
                if rollout == "vllm" and not torch.cuda.is_available():
                    variants.append(("packed", ["--rollout-options", json.dumps({"cpu_weights": "packed"})]))
    header = ("| train | rollout | sync | MB | sync s | copy s | engine load s | naive s | sync/copy "
              "| sync/engine load | naive/sync |\n|---|---|---|---|---|---|---|---|---|---|---|")
    text = f"Switch benchmark, model `{args.model}`, medians of {args.switches} switches\n\n{header}\n" + "\n".join(rows) + "\n"
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
