#!/usr/bin/env python3
"""Where a vLLM rollout's time goes at the scenario's batch: the same engine and prompts, generated as gearshift
asks (a seed per request, the sampled token's logprob as flat lists) and with each of those asks left out (and
with logprobs as vLLM's default per-token dicts), then one call
under cProfile.

    python3 tools/gpu/profile_rollout.py --model qwen2-0.5b --prompts 32 --n 8 --max-tokens 256

Prints one line per variant (median seconds of `--repeats` calls, generated tokens/s), the garbage collector's
passes over one call, and the functions with the most own and most cumulative time in a profiled gearshift
call. The variants call vLLM's `LLM.generate` directly with the requests gearshift builds, changing one field of vLLM's `SamplingParams`; the first row is gearshift's own
`generate` (vLLM's call plus turning its outputs into rollouts). Runs on a CPU too (a tiny model). A tool, not a
test.

`--engine-process` adds two rows after the engine is closed: a plain `vllm.LLM` built with the same keyword
arguments in a process of its own with vLLM's engine core in yet another one (`VLLM_ENABLE_V1_MULTIPROCESSING=1`,
vLLM's default outside gearshift), generating the same requests without and with the sampled token's logprob: how
much of the rollout is the host work that runs on the trainer's thread while vLLM lives in its process.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

from gearshift import registry
from gearshift.models import resolve_model
from gearshift.rollout import SamplingParams


def timed(fn, repeats: int) -> tuple[float, int]:
    """Median seconds of `repeats` calls of `fn`, and the tokens the last call generated."""
    times, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), tokens


def request_params(vllm, sampling: SamplingParams, count: int, seeds: bool, logprobs: bool, flat: bool = True):
    """vLLM's sampling parameters for `count` prompts as gearshift builds them, with a seed per request or not,
    the sampled token's logprob or not, and logprobs as flat lists or vLLM's per-token dicts."""
    from gearshift_vllm.requests import vllm_sampling

    params = []
    for i in range(count):
        ps = vllm_sampling(vllm, sampling, i, 1 << 30, seeds)
        if not logprobs:
            ps.logprobs = None
        if not flat and hasattr(ps, "flat_logprobs"):
            ps.flat_logprobs = False
        params.append(ps)
    return params


def engine_process(kwargs: dict, prompts: list[list[int]], n: int, max_tokens: int, repeats: int) -> list[str]:
    """Rows for a plain vLLM built with `kwargs` in a child process, its engine core in a process of its own."""
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec = os.path.join(tmp, "spec.json")
        with open(spec, "w") as f:
            json.dump({"kwargs": kwargs, "prompts": prompts, "n": n, "max_tokens": max_tokens,
                       "repeats": repeats}, f)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        proc = subprocess.run([sys.executable, __file__, "--child", spec], env=env, capture_output=True, text=True,
                              timeout=900)
    rows = [line[len("ROW "):] for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode or len(rows) < 2:
        rows.append(f"engine process failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-1500:]}")
    return rows


def child(spec_path: str) -> int:
    """The `--engine-process` side: `vllm.LLM(**kwargs)` as vLLM runs by default, the same requests timed."""
    import vllm

    spec = json.load(open(spec_path))
    llm = vllm.LLM(**spec["kwargs"])
    requests = [{"prompt_token_ids": q} for q in spec["prompts"]]

    sampling = SamplingParams(n=spec["n"], temperature=1.0, max_tokens=spec["max_tokens"], seed=0)

    def call(logprobs: bool):
        params = request_params(vllm, sampling, len(requests), False, logprobs)
        return lambda: sum(len(c.token_ids) for o in llm.generate(requests, params, use_tqdm=False) for c in o.outputs)

    for logprobs in (False, True):
        call(logprobs)()  # warm-up
        secs, tokens = timed(call(logprobs), spec["repeats"])
        label = f"vLLM in its own processes, {'logprob' if logprobs else 'no logprob'}"
        print(f"ROW   {label:58s} {secs:7.3f} s  {tokens / secs:10,.0f} tokens/s  ({tokens} tokens)", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2-0.5b")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, default=25, help="profile rows printed")
    p.add_argument("--options", default='{"dtype": "bfloat16"}', help="JSON: vllm engine options")
    p.add_argument("--engine-process", action="store_true",
                   help="also time a plain vLLM with its engine core in a process of its own")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child)

    options = {"max_batch_tokens": args.prompts * args.n * (args.prompt_tokens + args.max_tokens),
               **json.loads(args.options)}
    engine = registry.create("rollout", "vllm", model=resolve_model(args.model), **options)
    vllm, llm = engine._vllm, engine._llm
    prompts = [[(7 * i + j) % 200 + 32 for j in range(args.prompt_tokens)] for i in range(args.prompts)]
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    engine.generate(prompts[:2], sampling)  # warm-up

    def ours() -> int:
        return sum(len(r.token_ids) for r in engine.generate(prompts, sampling))

    def raw(seeds: bool, logprobs: bool, flat: bool = True):
        def call() -> int:
            params = request_params(vllm, sampling, len(prompts), seeds, logprobs, flat)
            requests = [{"prompt_token_ids": q} for q in prompts]
            with engine._calling_vllm(generating=True):
                outs = llm.generate(requests, params, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs)
        return call

    variants = [(f"gearshift generate (request_seeds={engine.request_seeds})", ours),
                ("vLLM generate, seed per request, logprob", raw(True, True)),
                ("vLLM generate, seed per request, logprob per-token dicts", raw(True, True, flat=False)),
                ("vLLM generate, no seed per request, logprob", raw(False, True)),
                ("vLLM generate, seed per request, no logprob", raw(True, False)),
                ("vLLM generate, no seed per request, no logprob", raw(False, False))]
    print(f"{args.model}: {args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens, options {options}")
    for label, fn in variants:
        secs, tokens = timed(fn, args.repeats)
        print(f"  {label:58s} {secs:7.3f} s  {tokens / secs:10,.0f} tokens/s  ({tokens} tokens)", flush=True)

    # the garbage collector's passes over one call (vLLM's objects live in the trainer's process)
    import gc
    spent, began = [0.0, 0.0, 0.0], {}

    def on_gc(phase, info):
        if phase == "start":
            began["t"] = time.perf_counter()
        elif "t" in began:
            spent[info["generation"]] += time.perf_counter() - began.pop("t")
    counts = [g["collections"] for g in gc.get_stats()]
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    ours()
    wall = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    runs = [g["collections"] - c for g, c in zip(gc.get_stats(), counts)]
    print(f"garbage collector over one gearshift generate ({wall:.3f} s): passes by generation {runs}, "
          f"{sum(spent):.3f} s in them ({', '.join(f'{x:.3f}' for x in spent)}); "
          f"objects tracked {len(gc.get_objects()):,}")

    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    tokens = ours()
    wall = time.perf_counter() - t0
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(args.rows)
    stats.sort_stats("cumulative").print_stats(args.rows)
    print(f"profiled gearshift generate: {wall:.3f} s for {tokens} tokens (profiling slows Python down)")
    print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:20000])
    kwargs = {k: v for k, v in engine.vllm_kwargs.items() if isinstance(v, (str, int, float, bool, type(None)))}
    engine.close()
    if args.engine_process:
        kwargs.pop("enable_sleep_mode", None)  # nothing sleeps here
        if str(kwargs.get("load_format", "")).startswith("gearshift"):  # a loader registered in this process only
            kwargs.pop("load_format")
        print(f"{args.model}: the same requests (no seed per request) from a plain vLLM, {kwargs}")
        for row in engine_process(kwargs, prompts, args.n, args.max_tokens, args.repeats):
            print(f"  {row}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
