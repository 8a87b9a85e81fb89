"""A trained policy exported as a Hugging Face folder loads in vLLM and generates."""

import os
import subprocess
import sys
import textwrap

import pytest

from gearshift import Trainer, registry


def test_exported_policy_loads_in_vllm(gearshift_model, tmp_path):
    if not registry.ready("rollout", "vllm"):
        if os.environ.get("CI"):
            pytest.fail("gearshift-vllm not installed: tools/install.sh installs it")
        pytest.skip("gearshift-vllm not installed")
    trainer = Trainer(model=gearshift_model, rollout={"backend": "hf", "n": 2, "max_tokens": 3},
                      train={"backend": "torch"},
                      run={"steps": 1, "prompts_per_step": 4, "output_dir": str(tmp_path / "run"), "progress": False,
                           "checkpoint_every": 0, "tensorboard": False, "plot": False, "resume": "never"})
    trainer.train()
    trainer.save(str(tmp_path / "exported"))
    script = textwrap.dedent(f"""
        from gearshift import SamplingParams
        from gearshift_vllm.engine import VLLMRolloutEngine
        engine = VLLMRolloutEngine.build({str(tmp_path / 'exported')!r}, cache_dir={str(tmp_path / 'vllm')!r},
                                   kv_cache_bytes=64 * 2**20)
        out = engine.generate([[72, 101, 108]], SamplingParams(temperature=0.0, max_tokens=4))
        assert len(out) == 1 and 1 <= len(out[0].token_ids) <= 4, out
        print("generated", out[0].token_ids)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "GEARSHIFT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "generated" in proc.stdout
