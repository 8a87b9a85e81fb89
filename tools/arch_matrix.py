"""The conformance suite over every tiny architecture and pair: which decoder architectures each pair serves.

    python tools/arch_matrix.py                          # every architecture, pairs torch/hf fsdp/hf fsdp/vllm
    python tools/arch_matrix.py --archs gpt2,phi3 --pairs fsdp/vllm

Each cell is one `gearshift conformance --train T --rollout R --model tiny-ARCH`
run in its own process (a failed engine start cannot affect the next cell);
it prints a markdown table (passed / failed / expected failures, or the
reason the pair refuses the architecture) and writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from gearshift.models import ARCHS

PAIRS = ("torch/hf", "fsdp/hf", "fsdp/vllm")


def run_cell(arch: str, pair: str, cache: Path, timeout: int) -> dict:
    train, rollout = pair.split("/")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GEARSHIFT_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gearshift", "conformance", "--train", train, "--rollout", rollout,
           "--model", f"tiny-{arch}"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        out, code = (err.stdout or "") if isinstance(err.stdout, str) else "", -1
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|xfailed|skipped|errors?)", out)}
    refused = re.search(r"has no implementation of its own for[^\n]*|cannot take weight updates for this "
                        r"mixture-of-experts model[^\n]*|does not compute this mixture-of-experts model[^\n]*", out)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return {"arch": arch, "pair": pair, "exit": code, "seconds": round(time.perf_counter() - start, 1),
            "counts": counts, "failed": failed, "refused": refused.group(0) if refused else None,
            "tail": out[-3000:] if code not in (0,) and not refused else ""}


def cell_text(r: dict) -> str:
    if r["refused"]:
        return "refused (mixture of experts on a CPU)" if "mixture" in r["refused"] else "refused (no native vLLM model)"
    if r["exit"] == -1:
        return "timed out"
    c = r["counts"]
    text = f"{c.get('passed', 0)} passed"
    for key in ("failed", "errors", "error", "xfailed"):
        if c.get(key):
            text += f", {c[key]} {key}"
    return ("ok: " if r["exit"] == 0 else "FAIL: ") + text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS), help="comma-separated (default: every one)")
    parser.add_argument("--pairs", default=",".join(PAIRS), help="comma-separated train/rollout pairs")
    parser.add_argument("--out", default="runs/arch_matrix.json")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per cell")
    args = parser.parse_args()
    archs, pairs = args.archs.split(","), args.pairs.split(",")
    cache = Path(args.out).parent / "arch-matrix-cache"
    results = []
    for arch in archs:
        for pair in pairs:
            r = run_cell(arch, pair, cache, args.timeout)
            results.append(r)
            print(f"{arch:10s} {pair:10s} {cell_text(r)} ({r['seconds']} s)", flush=True)
            for name in r["failed"]:
                print(f"    {name}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n| architecture | " + " | ".join(pairs) + " |\n|---|" + "---|" * len(pairs))
    for arch in archs:
        row = {r["pair"]: cell_text(r) for r in results if r["arch"] == arch}
        print(f"| {arch} | " + " | ".join(row[p] for p in pairs) + " |")
    ok = all(r["exit"] == 0 or r["refused"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
