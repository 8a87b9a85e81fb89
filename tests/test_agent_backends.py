"""Episodes through the whole RL loop on each installed rollout backend: tools, environments and masks."""

import os

import pytest

from gearshift import Trainer, registry

FAST = {"checkpoint_every": 0, "progress": False, "samples_per_step": 0, "tensorboard": False, "plot": False,
        "resume": "never"}


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_episodes_train_on_the_rollout_backend(backend, gearshift_model, tmp_path):
    if not registry.ready("rollout", backend):
        if os.environ.get("CI") and backend == "vllm":
            pytest.fail("gearshift-vllm not installed: tools/install.sh installs it")
        pytest.skip(f"gearshift-{backend} not installed")
    options = {"cache_dir": str(tmp_path / "cache"), "kv_cache_bytes": 64 * 2**20} if backend == "vllm" else {}
    history = Trainer(model=gearshift_model, data={"task": "guess"}, agent={"max_turns": 3, "max_tokens": 24},
                      rollout={"backend": backend, "n": 2, "max_tokens": 3, "options": options},
                      train={"backend": "torch"},
                      run={"steps": 2, "prompts_per_step": 4, "output_dir": str(tmp_path / "run"), **FAST}).train()
    assert all(m["agent/turns_mean"] > 1 and m["agent/model_token_share"] < 1 for m in history)
    assert history[0]["mismatch/logprob_max"] < 1e-4  # the environment's tokens (logprob 0) are masked out
