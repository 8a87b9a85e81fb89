#!/usr/bin/env python3
"""Where vLLM's KV-cache wake spends its time: each allocation its sleep-mode allocator maps back, timed.

    python3 tools/gpu/profile_wake.py --model qwen2-7b --gpu-memory-utilization 0.3 --repeats 5
    python3 tools/gpu/profile_wake.py --model qwen2-7b --max-batch-tokens 81920   # KV cache sized to a batch

Builds the vllm rollout engine, then `repeats` times puts it to sleep, wakes its weights, and wakes its KV
cache with vLLM's `create_and_map` (the driver calls that map one allocation: cuMemCreate, cuMemMap,
cuMemSetAccess) wrapped in a timer. Prints, per wake, the allocations mapped, their sizes, the time in the
driver calls and the rest (vLLM's own Python). A tool, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gearshift import registry
from gearshift.models import resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="the rollout's batch in tokens (32 x 8 x 320 = 81920): the KV cache sized to it")
    args = p.parse_args()
    engine = registry.create("rollout", "vllm", model=resolve_model(args.model), dtype="bfloat16",
                             gpu_memory_utilization=args.gpu_memory_utilization,
                             max_batch_tokens=args.max_batch_tokens)
    from vllm.device_allocator import cumem

    calls: list[tuple[float, int]] = []
    original = cumem.create_and_map

    def timed(handle):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        original(handle)
        torch.cuda.synchronize()
        calls.append((time.perf_counter() - t0, int(handle[1])))

    cumem.create_and_map = timed
    rows = []
    try:
        for _ in range(args.repeats):
            engine.sleep(["kv_cache", "weights"])
            engine.wake(["weights"])
            calls.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.wake(["kv_cache"])
            torch.cuda.synchronize()
            total = time.perf_counter() - t0
            mapped = sum(s for s, _ in calls)
            rows.append((total, mapped, len(calls), sum(n for _, n in calls)))
            print(f"kv wake {total * 1e3:.1f} ms: {len(calls)} allocations mapped, {sum(n for _, n in calls) / 2**30:.2f} "
                  f"GiB, {mapped * 1e3:.1f} ms in the driver's map calls (largest {max((s for s, _ in calls), default=0) * 1e3:.1f} ms), "
                  f"{(total - mapped) * 1e3:.1f} ms elsewhere", flush=True)
    finally:
        cumem.create_and_map = original
        engine.close()
    print(f"median kv wake {statistics.median(r[0] for r in rows) * 1e3:.1f} ms, "
          f"of it in map calls {statistics.median(r[1] for r in rows) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
