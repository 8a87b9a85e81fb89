"""Compiled decoder layers against uncompiled ones, architecture by architecture, on this machine.

    python tools/compile_matrix.py                     # every tiny architecture (gearshift.models.ARCHS)
    python tools/compile_matrix.py --archs qwen2,falcon --json out.json

For each architecture: the torch trainer built twice from the same random tiny model, one with each decoder
layer's forward compiled as `train.options.compile` does it (inductor), one without; one train step on the same
rows (of one length, then of several: a padding mask), and the largest gap between the two gradients of any
weight, over the largest gradient of that weight. What passes is at float rounding (`--tolerance`, 1e-4);
`gearshift.layers.COMPILE_CHECKED` lists the model types that pass, and the trainer refuses compile for others.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.bench.train import train_batch
from gearshift.layers import compile_layers
from gearshift.models import ARCHS, resolve_model
from gearshift.train import nll_loss


def gradients(path: str, batch, compiled: bool) -> dict[str, torch.Tensor]:
    engine = TorchTrainEngine.build(path, lr=1e-2, keep_grads=True)
    if compiled:
        compile_layers(engine.model, checked=False)
    engine.train_step(batch, nll_loss)
    out = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    engine.close()
    return out


def gap(arch: str) -> dict:
    path = resolve_model(f"tiny-{arch}")
    from transformers import AutoConfig

    row = {"arch": arch, "model_type": AutoConfig.from_pretrained(path).model_type}
    start = time.perf_counter()
    try:
        for label, batch in (("one_length", train_batch(4, 24)), ("padded", train_batch(4, 24, 8))):
            torch._dynamo.reset()
            want, got = gradients(path, batch, False), gradients(path, batch, True)
            row[label] = max(float((want[n] - got[n]).abs().max() / want[n].abs().max().clamp(min=1e-12))
                             for n in want)
    except Exception as err:  # an architecture the compiler cannot take: its row says why
        row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    row["seconds"] = time.perf_counter() - start
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default=",".join(ARCHS), help="comma-separated tiny architectures (default: all)")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest relative gradient gap that passes")
    p.add_argument("--json", default="", help="write the rows to this JSON file")
    args = p.parse_args()
    rows = []
    print("| arch | model_type | one length | padded | result |\n|---|---|---|---|---|")
    for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
        row = gap(arch)
        worst = max(row.get("one_length", float("inf")), row.get("padded", float("inf")))
        row["passes"] = "error" not in row and worst <= args.tolerance
        rows.append(row)
        result = "passes" if row["passes"] else row.get("error", f"gap {worst:.2g} over {args.tolerance:g}")
        print(f"| {arch} | {row['model_type']} | {row.get('one_length', float('nan')):.2g} | "
              f"{row.get('padded', float('nan')):.2g} | {result} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "tolerance": args.tolerance, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
