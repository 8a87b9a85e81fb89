"""run.placement=split: training and rollout on separate pools of Ray workers (Ray's local test cluster).

The cluster (two nodes of 2 CPUs) starts once per session; each test starts its pools on it: one
`torch` trainer and `hf` rollout workers, on a tiny model.
"""

import os
import signal
import threading
import time

import pytest
import torch

from gearshift.rl.config import ConfigError, build_config
from gearshift.rl.metrics import read_jsonl


def config(model, out, steps=2, pools=None, **sections):
    run = {"placement": "split", "steps": steps, "prompts_per_step": 4, "output_dir": str(out), "progress": False,
           "tensorboard": False, "plot": False, "checkpoint_every": 0, "pools": {"train": 1, "rollout": 1, **(pools or {})},
           **sections.pop("run", {})}
    return build_config(None, {"model": {"path": model}, "rollout": {"backend": "hf", "n": 2, "max_tokens": 3,
                                                                                "logprobs": "always"},
                               "train": {"backend": "torch", "lr": 1e-2}, "run": run, **sections})


def test_split_keys_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="needs run.placement=split"):
        build_config(None, {"algorithm": {"off_policy_steps": 1}}).validate()
    with pytest.raises(ConfigError) as err:
        build_config(None, {"run": {"placement": "split", "prompts_per_step": 6,
                                    "pools": {"train": 4, "rollout": 0}},
                            "train": {"mesh": "dp=2"}}).validate()
    for expected in ("divide evenly over the 4 workers of run.pools.train", "run.pools.rollout=0",
                     "train.mesh: mesh dp=2 spans 2 ranks but the world has 4"):
        assert expected in str(err.value)
    with pytest.raises(ConfigError, match="run.pools.reference='driver': use train or rollout"):
        build_config(None, {"run": {"pools": {"reference": "driver"}}})
    with pytest.raises(ConfigError, match="use colocated or split"):
        build_config(None, {"run": {"placement": "ray"}})


def length(completion, **row):
    """A reward that varies between samples of a tiny random model, so every step has something to learn."""
    return float(len(completion))


def _call(actor, fn, *args):
    import ray

    return ray.get(actor.__ray_call__.remote(fn, *args))


def test_pools_of_their_own_and_every_rollout_rank_gets_the_trainers_weights(gearshift_ray_cluster, gearshift_model,
                                                                             tmp_path):
    from safetensors.torch import load_file

    from gearshift.rl.split import SplitController

    # the reference and a reward model beside the policy, on the train pool
    cfg = config(gearshift_model, tmp_path / "run", steps=2, pools={"rollout": 2, "reward_model": "train"},
                 algorithm={"kl_coef": 0.01}, reward={"model": "tiny-rm", "weights": [1.0, 0.5]})
    ctl = SplitController(cfg, reward_fn=length)
    try:
        workers = ctl.workers()
        assert sorted(workers) == ["rollout/0", "rollout/1", "train/0"]
        assert len({w["pid"] for w in workers.values()}) == 3

        def group(self):
            import torch.distributed as dist

            return dist.get_rank(), dist.get_world_size(), self.link.rank, self.link.size

        # each pool its own process group; the link numbers the train ranks first
        assert {k: _call(w["actor"], group) for k, w in workers.items()} == {
            "train/0": (0, 1, 0, 3), "rollout/0": (0, 2, 1, 3), "rollout/1": (1, 2, 2, 3)}
        history = ctl.fit()
        assert [m["rollout/staleness"] for m in history] == [0, 0]
        assert all("kl/ref" in m and "reward/model_mean" in m for m in history)
        model_bytes = sum(t.numel() * t.element_size() for t in load_file(f"{gearshift_model}/model.safetensors").values())
        assert history[1]["switch/transfer_mb"] == pytest.approx(2 * model_bytes / 1e6)  # whole, to each replica
        assert history[1]["switch/link_gbps"] > 0
        # the rollout engines sampled with the weights the trainer had: their logprobs are the trainer's
        assert all(m["mismatch/logprob_max"] < 1e-4 for m in history)
        ctl.sync_weights()

        def trained(self):
            policy = self.learner.policy
            return {n: t.clone() for n, t in policy.local_weights(policy.weight_spec().names()).items()}

        def served(self):
            return {n: p.detach().clone() for n, p in self.engine.model.named_parameters()}

        want = _call(workers["train/0"]["actor"], trained)
        start = load_file(f"{gearshift_model}/model.safetensors")
        assert any(not torch.equal(want[n], start[n]) for n in want if n in start)  # training moved them
        for label in ("rollout/0", "rollout/1"):
            got = _call(workers[label]["actor"], served)
            assert set(want) <= set(got)
            assert all(torch.equal(got[n], want[n]) for n in want), label
    finally:
        ctl.close()


def test_one_step_off_policy_rollout_runs_ahead_on_the_previous_weights(gearshift_ray_cluster, gearshift_model,
                                                                        tmp_path):
    from gearshift.rl.split import SplitController

    # the reference and a reward model beside the rollout engine, scoring each batch as it is generated
    cfg = config(gearshift_model, tmp_path / "run", steps=4, pools={"reference": "rollout"},
                 algorithm={"off_policy_steps": 1, "rollout_correction": "tis", "kl_coef": 0.01},
                 reward={"model": "tiny-rm", "weights": [1.0, 0.5]})
    ctl = SplitController(cfg, reward_fn=length)
    try:
        history = ctl.fit()
    finally:
        ctl.close()
    # the batch of step k+1 was generated (by the rollout worker's own account) with the weights of step k-1
    assert [m["rollout/staleness"] for m in history] == [0, 1, 1, 1]
    assert history[0]["mismatch/logprob_max"] < 1e-4
    assert all(m["mismatch/logprob_max"] > 1e-3 for m in history[1:])  # the trainer had moved on
    # the rollout correction weighs those samples by the trainer's over the rollout engine's probabilities
    assert all(m["rollout_correction/ratio_max"] > 1 or m["rollout_correction/ratio_min"] < 1 for m in history[1:])
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert all("kl/ref" in m and "reward/model_mean" in m and "time/ref_logprobs" in m for m in history)


def test_a_worker_killed_mid_run_stops_the_run_naming_it_and_the_run_resumes(gearshift_ray_cluster, gearshift_model,
                                                                           tmp_path):
    import ray
    from ray.exceptions import RayActorError

    from gearshift.rl.split import SplitController, WorkerLost

    out = tmp_path / "run"
    ctl = SplitController(config(gearshift_model, out, steps=40, run={"checkpoint_every": 2}), reward_fn=length)
    workers = ctl.workers()
    errors = []

    def fit():
        try:
            ctl.fit()
        except Exception as err:  # noqa: BLE001 - the test inspects it
            errors.append(err)

    thread = threading.Thread(target=fit)
    thread.start()
    deadline = time.monotonic() + 300
    while len(read_jsonl(out / "metrics.jsonl")) < 3 and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.1)
    os.kill(workers["train/0"]["pid"], signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], WorkerLost), errors
    assert errors[0].worker == "train/0"
    for w in workers.values():  # every worker was ended, none left waiting on the dead one
        with pytest.raises(RayActorError):
            ray.get(w["actor"].where.remote(), timeout=60)
    logged = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
    resumed = SplitController(config(gearshift_model, out, steps=logged[-1] + 2, run={"checkpoint_every": 2}),
                              reward_fn=length)
    try:
        assert resumed.step >= 2 and resumed.step % 2 == 0 and resumed.step <= logged[-1]
        resumed.fit()
    finally:
        resumed.close()
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, logged[-1] + 3))


def test_episodes_run_on_the_rollout_pool_one_step_off_policy(gearshift_ray_cluster, gearshift_model, tmp_path):
    from gearshift.rl.split import SplitController

    cfg = config(gearshift_model, tmp_path / "run", steps=2, data={"task": "guess"},
                 agent={"max_turns": 3, "max_tokens": 16}, algorithm={"off_policy_steps": 1})
    ctl = SplitController(cfg)
    try:
        history = ctl.fit()
    finally:
        ctl.close()
    assert all(1 <= m["agent/turns_mean"] <= 3 and m["agent/model_token_share"] < 1 for m in history)
    assert history[0]["mismatch/logprob_max"] < 1e-4  # environment tokens (logprob 0) stay out of it
