"""One vLLM engine for the whole session (a start costs 10-70 s), and what the host looked like before it.

Its files go to a folder under the system's temporary directory (kept between
sessions, so later starts find vLLM's caches warm), never the home directory;
`GEARSHIFT_VLLM_TEST_CACHE` picks another.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from gearshift.conformance.util import as_buckets, reference_weights

KV_CACHE_BYTES = 64 << 20


@pytest.fixture(scope="session")
def vllm_cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / f"gearshift-vllm-test-{os.getuid()}"
    path = Path(os.environ.get("GEARSHIFT_VLLM_TEST_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def host_before_engine() -> dict:
    """The host's threads, `torch.set_num_threads`, environment and vLLM home cache before the engine starts."""
    home_cache = Path.home() / ".cache" / "vllm"
    return {
        "threads": torch.get_num_threads(),
        "set_num_threads": torch.set_num_threads,
        "environ": dict(os.environ),
        "home_cache_mtime": home_cache.stat().st_mtime if home_cache.exists() else None,
        "home_cache": home_cache,
    }


# On CPU every test runs against both weight layouts, one engine at a time (pytest groups the
# tests by layout and closes the first engine before the second starts).
LAYOUTS = ["auto"] if torch.cuda.is_available() else ["plain", "packed"]


@pytest.fixture(scope="session", params=LAYOUTS)
def vllm_engine(request, gearshift_model, vllm_cache_dir, host_before_engine):
    from gearshift_vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine.build(gearshift_model, cache_dir=str(vllm_cache_dir), kv_cache_bytes=KV_CACHE_BYTES,
                               cpu_weights=request.param)
    yield engine
    engine.close()


@pytest.fixture
def serving_model_weights(vllm_engine, gearshift_model):
    """The session engine, awake and serving the model folder's weights again after the test."""
    yield vllm_engine
    restore(vllm_engine, gearshift_model)


def restore(engine, model_path: str) -> None:
    engine.wake(["weights", "kv_cache"])
    engine.update_weights(as_buckets(reference_weights(model_path, engine.weight_spec()), engine.device))


@pytest.fixture(scope="session")
def transformers_diff(gearshift_model):
    """`diff(rollouts, changes=None)`: max |logprob - transformers' logprob| of the sampled tokens, with
    `changes` ({name: tensor}) applied over the model folder's weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gearshift_model, dtype=torch.float32).eval()
    # parameters, not the state dict: that lists a tied lm_head too, which would overwrite a changed embedding
    original = {k: v.detach().clone() for k, v in model.named_parameters()}

    @torch.no_grad()
    def diff(rollouts, changes=None) -> float:
        model.load_state_dict({**original, **(changes or {})}, strict=False)
        worst = 0.0
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.token_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.token_ids)[:, None]).squeeze(-1)
            worst = max(worst, float((ref - torch.tensor(r.logprobs)).abs().max()))
        return worst

    return diff
