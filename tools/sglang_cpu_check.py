"""Drive SGLang's own Engine on the CPU with a tiny model built locally, and print what it does.

    python tools/sglang_cpu_check.py [--model PATH] [--arch qwen2|llama] [--dtype float32|bfloat16]

Uses gearshift_sglang only to make SGLang importable (kernel stand-in, private
site, child-process entry points), not its rollout engine: generation with
logprobs against transformers, seeded sampling, `update_weights_from_tensor`
per tensor and as a flattened bucket (inside `begin_weight_update` /
`end_weight_update`, and outside it), `flush_cache`, `release_memory_occupation`
/ `resume_memory_occupation`, and which `sgl_kernel` stand-in ops were called.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def build(path: str, arch: str, dtype: str) -> str:
    try:
        from gearshift.models.tiny import build_model
    except ImportError:
        from gearshift.tiny import build_model
    return build_model(path, preset="tiny", arch=arch, dtype=dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a local Hugging Face folder (default: build the tiny preset)")
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gearshift-sglang-check-"))
    model_path = args.model or build(str(work / "model"), args.arch, args.dtype)
    trace = work / "sgl_kernel-calls.txt"
    os.environ["GEARSHIFT_SGL_KERNEL_TRACE"] = str(trace)

    from gearshift_sglang import children
    from gearshift_sglang.imports import cpu_environment, prepare

    os.environ.update(cpu_environment())
    t0 = time.perf_counter()
    print("prepare:", prepare())
    import torch
    from sglang.srt.entrypoints.engine import Engine
    from transformers import AutoModelForCausalLM
    print(f"import sglang: {time.perf_counter() - t0:.1f} s")

    class CheckedEngine(Engine):
        run_scheduler_process_func = staticmethod(children.run_scheduler_process)
        run_detokenizer_process_func = staticmethod(children.run_detokenizer_process)

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    original = {k: v.detach().clone() for k, v in hf.named_parameters()}

    def logprob_diff(outs, prompts, n=1):
        worst = 0.0
        for i, o in enumerate(outs):
            p = prompts[i // n]
            ids = torch.tensor([p + o["output_ids"]])
            with torch.no_grad():
                logits = hf(ids).logits[0, len(p) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(o["output_ids"])[:, None]).squeeze(-1)
            got = torch.tensor([x[0] for x in o["meta_info"]["output_token_logprobs"]])
            worst = max(worst, float((got - ref).abs().max()))
        return worst

    t0 = time.perf_counter()
    engine = CheckedEngine(model_path=model_path, device="cpu", attention_backend="torch_native", dtype=args.dtype,
                           max_total_tokens=4096, random_seed=0, log_level="error", disable_cuda_graph=True)
    print(f"engine start: {time.perf_counter() - t0:.1f} s")
    prompts = [[72, 101, 108, 108, 111], [49, 43, 50, 61], list(range(40, 140))]
    greedy = {"max_new_tokens": 16, "temperature": 0.0}

    def generate(sampling, seed=None, ps=prompts):
        if seed is not None:
            engine.collective_rpc("gearshift_reseed", seed=seed)
        return engine.generate(input_ids=ps, sampling_params=sampling, return_logprob=True)

    base = generate(greedy)
    print(f"greedy logprobs vs transformers: max abs diff {logprob_diff(base, prompts):.2e}")
    hot = {"max_new_tokens": 16, "temperature": 0.7, "top_k": 20, "top_p": 0.9}
    a, b = generate(hot, seed=3), generate(hot, seed=3)
    print(f"sampled at T=0.7, top-k 20, top-p 0.9: logprob diff {logprob_diff(a, prompts):.2e} (temperature 1 "
          f"expected); same seed, same samples: {[o['output_ids'] for o in a] == [o['output_ids'] for o in b]}")
    out = generate({"max_new_tokens": 16, "temperature": 0.0, "stop_token_ids": [base[0]["output_ids"][2]]})
    print(f"stop token: {out[0]['output_ids']} finish {out[0]['meta_info']['finish_reason']}")

    print("update outside begin/end:", engine.update_weights_from_tensor(list(original.items())))
    g = torch.Generator().manual_seed(1)
    changed = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) for k, v in original.items()}
    print("begin_weight_update:", engine.begin_weight_update())
    t0 = time.perf_counter()
    result = engine.update_weights_from_tensor(list(changed.items()), flush_cache=False)
    print(f"update per tensor: {result} {1e3 * (time.perf_counter() - t0):.1f} ms")
    print("end_weight_update:", engine.end_weight_update(), "flush_cache:", engine.flush_cache().success)
    out = generate(greedy)
    hf.load_state_dict(changed, strict=False)
    print(f"after update: outputs changed {[o['output_ids'] for o in out] != [o['output_ids'] for o in base]}, "
          f"logprob diff vs transformers with the new weights {logprob_diff(out, prompts):.2e}")

    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    bucket = FlattenedTensorBucket(named_tensors=list(original.items()))
    payload = MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}, output_str=True)
    engine.begin_weight_update()
    t0 = time.perf_counter()
    result = engine.update_weights_from_tensor([payload], load_format="flattened_bucket", flush_cache=False)
    print(f"update as one flattened bucket: {result} {1e3 * (time.perf_counter() - t0):.1f} ms")
    engine.end_weight_update()
    engine.flush_cache()
    hf.load_state_dict(original, strict=False)
    out = generate(greedy)
    same = [o["output_ids"] for o in out] == [o["output_ids"] for o in base]
    lp_same = all(x["meta_info"]["output_token_logprobs"] == y["meta_info"]["output_token_logprobs"]
                  for x, y in zip(out, base))
    print(f"restored: same tokens {same}, same logprobs {lp_same}")

    report = work / "memory.json"

    def resident():
        engine.collective_rpc("gearshift_report", path=str(report))
        return json.loads(report.read_text())

    print("resident bytes awake:", resident())
    t0 = time.perf_counter()
    engine.release_memory_occupation(tags=["kv_cache"])
    engine.release_memory_occupation(tags=["weights"])
    print(f"released weights and kv_cache in {1e3 * (time.perf_counter() - t0):.1f} ms; resident bytes: {resident()}")
    engine.resume_memory_occupation(tags=["weights"])
    engine.begin_weight_update()
    engine.update_weights_from_tensor(list(original.items()), flush_cache=False)
    engine.end_weight_update()
    engine.resume_memory_occupation(tags=["kv_cache"])
    out = generate(greedy)
    print("after release/update/resume: same tokens", [o["output_ids"] for o in out] == [o["output_ids"] for o in base])
    engine.shutdown()
    calls = trace.read_text().split("\n") if trace.exists() else []
    print("sgl_kernel stand-in ops called:", sorted({c.split()[1] for c in calls if c}) or "none")


if __name__ == "__main__":
    sys.exit(main())
