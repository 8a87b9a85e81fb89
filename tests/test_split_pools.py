"""run.placement=split with real backends on Ray's local test cluster: a sharded (fsdp) train pool feeding
rollout replicas, and the default job learning with split pools, on-policy and one step off-policy (slow)."""

import statistics

import pytest
import torch

from gearshift import registry
from gearshift.reshard import export_weights
from gearshift.rl.config import build_config
from gearshift.rl.metrics import read_jsonl


def _ready(kind, name):
    if not registry.ready(kind, name):
        pytest.skip(f"{kind} backend {name} is not installed")


def length(completion, **row):
    return float(len(completion))


@pytest.mark.slow  # ~220 s: a Ray cluster of four pools; packages/core/tests/test_split.py keeps split placement fast
def test_an_fsdp_pool_sends_each_rollout_replica_its_shards_and_nothing_is_gathered(gearshift_ray_cluster,
                                                                                  gearshift_model, tmp_path):
    import ray

    from gearshift.rl.split import SplitController

    _ready("train", "fsdp")
    cfg = build_config(None, {
        "model": {"path": gearshift_model}, "rollout": {"backend": "hf", "n": 2, "max_tokens": 3, "logprobs": "always"},
        "train": {"backend": "fsdp", "lr": 1e-2},
        "run": {"placement": "split", "steps": 2, "prompts_per_step": 4, "output_dir": str(tmp_path / "run"),
                "progress": False, "tensorboard": False, "plot": False, "checkpoint_every": 0,
                "pools": {"train": 2, "rollout": 2}}})
    ctl = SplitController(cfg, reward_fn=length)
    try:
        history = ctl.fit()
        ctl.sync_weights()
        model_bytes = ctl.plan.src.nbytes
        # each train rank sends its own shards, to both replicas: no rank gathers the model
        for rank in (0, 1):
            sent, received = ctl.plan.peer_bytes(rank)
            assert set(sent) == {2, 3} and not received
            assert sum(sent.values()) < 1.2 * model_bytes  # its half, twice
        assert history[-1]["switch/transfer_mb"] == pytest.approx(2 * model_bytes / 1e6)
        assert all(m["mismatch/logprob_max"] < 1e-4 for m in history)
        workers = ctl.workers()

        def exported(self):  # every train rank takes part in the export; each gets the whole weights
            return {n: t.clone() for b in export_weights(self.learner.policy) for n, t in b.items()}

        def served(self):
            return {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}

        full = ray.get([workers[f"train/{i}"]["actor"].__ray_call__.remote(exported) for i in (0, 1)])[0]
        for label in ("rollout/0", "rollout/1"):
            got = ray.get(workers[label]["actor"].__ray_call__.remote(served))
            assert all(torch.equal(got[n], full[n]) for n in full), label
    finally:
        ctl.close()


@pytest.mark.slow
@pytest.mark.parametrize("off_policy_steps", [0, 1], ids=["split", "split-async"])
def test_the_default_job_learns_with_split_pools(gearshift_ray_cluster, tmp_path, off_policy_steps):
    from gearshift.rl import Trainer

    _ready("train", "fsdp")
    _ready("rollout", "vllm")
    out = tmp_path / "run"
    algorithm = {"off_policy_steps": off_policy_steps, **({"rollout_correction": "tis"} if off_policy_steps else {})}
    Trainer(run={"placement": "split", "output_dir": str(out), "progress": False, "tensorboard": False,
                 "plot": False}, algorithm=algorithm).train()
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 120 and {r["rollout/staleness"] for r in rows[1:]} == {off_policy_steps}
    last = statistics.fmean(r["reward/mean"] for r in rows[-10:])
    print(f"reward: first step {rows[0]['reward/mean']:.3f}, last ten {last:.3f}")
    assert last >= 0.9
