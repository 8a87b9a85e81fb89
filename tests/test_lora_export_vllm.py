"""A LoRA policy's export (merged weights, the adapter beside them) loads in vLLM and computes what training did."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gearshift import registry
from gearshift.conformance.train import fixed_batch, nll
from gearshift.train import TrainBatch


@pytest.mark.slow  # ~90 s; the adapter sync below and test_export_loads_in_vllm.py stay in the fast set
def test_merged_lora_export_loads_in_vllm_and_agrees_with_training(gearshift_model, tmp_path):
    pytest.importorskip("peft")
    if not registry.ready("rollout", "vllm"):
        if os.environ.get("CI"):
            pytest.fail("gearshift-vllm not installed: tools/install.sh installs it")
        pytest.skip("gearshift-vllm not installed")
    from gearshift.backends.torch_train import TorchTrainEngine

    engine = TorchTrainEngine.build(gearshift_model, lr=1e-2, lora_r=4, lora_alpha=8)
    for _ in range(3):
        engine.train_step(fixed_batch(), nll)
    engine.save_hf(str(tmp_path / "exported"))
    assert (tmp_path / "exported" / "adapter" / "adapter_config.json").exists()
    prompt = [72, 101, 108]
    script = textwrap.dedent(f"""
        import json
        from gearshift import SamplingParams
        from gearshift_vllm.engine import VLLMRolloutEngine
        engine = VLLMRolloutEngine.build({str(tmp_path / 'exported')!r}, cache_dir={str(tmp_path / 'vllm')!r},
                                         kv_cache_bytes=64 * 2**20)
        [out] = engine.generate([{prompt!r}], SamplingParams(temperature=0.0, max_tokens=6))
        print("ROLLOUT", json.dumps({{"tokens": out.token_ids, "logprobs": out.logprobs}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GEARSHIFT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("ROLLOUT "))
    rollout = json.loads(line[len("ROLLOUT "):])
    batch = TrainBatch.from_sequences([prompt], [rollout["tokens"]])
    ours = engine.forward_logprobs(batch).logprobs[0, len(prompt):len(prompt) + len(rollout["tokens"])]
    assert max(abs(a - b) for a, b in zip(ours.tolist(), rollout["logprobs"])) <= 1e-4


def test_grpo_with_the_adapter_sync_serves_the_trained_policy_from_vllm(gearshift_model, tmp_path):
    """`model.lora.sync=adapter`: vLLM serves the trainer's adapter on its base, step after step."""
    pytest.importorskip("peft")
    if torch.cuda.is_available():  # fp32 here; tools/gpu/lora_h200.sh runs it in bf16 on a GPU
        pytest.skip("vLLM's GPU LoRA kernels take half precision only")
    if not registry.ready("rollout", "vllm"):
        if os.environ.get("CI"):
            pytest.fail("gearshift-vllm not installed: tools/install.sh installs it")
        pytest.skip("gearshift-vllm not installed")
    script = textwrap.dedent(f"""
        import json
        from gearshift import Trainer
        def reward(completion):  # a random model earns it too, so advantages are not all zero
            return len(completion) / 3
        trainer = Trainer(model={{"path": {gearshift_model!r}, "lora": {{"r": 4, "alpha": 8, "sync": "adapter"}}}},
                          reward=reward, rollout={{"backend": "vllm", "n": 4, "max_tokens": 3, "logprobs": "always",
                                                  "options": {{"kv_cache_bytes": 64 * 2**20,
                                                               "cache_dir": {str(tmp_path / 'vllm')!r}}}}},
                          train={{"backend": "torch", "lr": 1e-2}},
                          run={{"steps": 3, "prompts_per_step": 4, "output_dir": {str(tmp_path / 'run')!r},
                               "checkpoint_every": 0, "progress": False, "samples_per_step": 0,
                               "tensorboard": False, "plot": False, "resume": "never"}})
        history = trainer.train()
        actor = trainer.controller.actor
        print("RESULT", json.dumps({{"resharder": type(actor.resharder).__name__,
                                    "loaded": [r.phase("load").bytes for r in actor.reports if r.phase("load")],
                                    "adapter": actor.train.export_adapter().nbytes,
                                    "mismatch": [h["mismatch/logprob_max"] for h in history],
                                    "loss": [h["train/loss"] for h in history]}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GEARSHIFT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["resharder"] == "AdapterResharder"
    assert result["loaded"] == [result["adapter"]] * 3  # every switch moved the adapter alone
    # the samples of steps 2 and 3 came from the adapter trained by the steps before: vLLM's logprobs agree
    assert max(result["mismatch"]) <= 1e-4 and any(loss != 0 for loss in result["loss"])
