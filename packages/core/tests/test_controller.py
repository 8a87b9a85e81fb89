"""The RL loop on the reference pair: the Python API, PPO with a critic, and resuming a killed run."""

import os
import signal
import subprocess
import sys
import time

import pytest

from gearshift import Trainer
from gearshift.rl import checkpoint
from gearshift.rl.metrics import read_jsonl

FAST = {"checkpoint_every": 0, "progress": False, "samples_per_step": 0, "tensorboard": False, "plot": False,
        "resume": "never"}


def test_python_api_with_a_callable_reward_and_rows(gearshift_model, tmp_path):
    from gearshift.rl.data import PromptDataset

    calls = []

    def reward(completion, answer):
        calls.append(answer)
        return float(completion.strip() == answer)

    rows = PromptDataset([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)])
    history = Trainer(model=gearshift_model, reward=reward, dataset=rows, rollout={"n": 2, "max_tokens": 3, "backend": "hf"},
                      train={"backend": "torch"},
                      run={"steps": 2, "prompts_per_step": 4, "output_dir": str(tmp_path), **FAST}).train()
    assert len(history) == 2 and len(calls) == 2 * 4 * 2
    for key in ("reward/mean", "train/pg_loss", "train/grad_norm", "mismatch/logprob_max", "time/rollout",
                "switch/share", "rollout/tokens_per_s", "memory/peak_gb"):  # torch + hf on CPU share weights
        assert key in history[0], key
    assert history[0]["mismatch/logprob_max"] < 1e-4  # fp32: rollout and train logprobs agree
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_the_steps_run_with_the_heap_frozen_and_give_it_back_as_found(gearshift_model, tmp_path):
    """No full garbage collection walks the engines and models at every step (with SGLang's host side beside a
    trainer, 0.4-0.6 s each on 2 cores): the steps run with the heap frozen, and it is given back after."""
    import gc

    from gearshift.rl.data import PromptDataset

    during = []

    def reward(completion, answer):
        during.append(gc.get_freeze_count())
        return 0.0

    rows = PromptDataset([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])
    before = gc.get_freeze_count()
    Trainer(model=gearshift_model, reward=reward, dataset=rows, rollout={"n": 2, "max_tokens": 2, "backend": "hf"},
            train={"backend": "torch"},
            run={"steps": 1, "prompts_per_step": 4, "output_dir": str(tmp_path), **FAST}).train()
    assert during and all(n > 0 for n in during)
    assert gc.get_freeze_count() == before


def test_a_policy_that_cannot_train_fails_before_the_rollout_engine_is_built(gearshift_model, tmp_path,
                                                                              monkeypatch):
    from gearshift.memory import MemoryPlanError
    from gearshift.rl import controller

    built, checked = [], []

    def check(policy, longest):
        checked.append(longest)
        raise MemoryPlanError("a train step does not fit (found at start)")

    from gearshift.rl.data import PromptDataset

    monkeypatch.setattr(controller, "check_train_fits", check)
    monkeypatch.setattr(controller, "build_rollout", lambda *a: built.append(a))
    rows = PromptDataset([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])
    with pytest.raises(MemoryPlanError, match="found at start"):
        Trainer(model=gearshift_model, reward=lambda completion, answer: 0.0, dataset=rows,
                rollout={"n": 2, "max_tokens": 3, "backend": "hf"}, train={"backend": "torch"},
                data={"max_prompt_len": 16}, run={"steps": 1, "output_dir": str(tmp_path), **FAST}).train()
    assert checked == [16 + 3] and built == []  # the longest row a step can meet; no rollout engine started


def test_ppo_with_critic_and_kl_runs(gearshift_model, tmp_path):
    def longer_is_better(completion):  # a random model earns it too, so advantages are not all zero
        return len(completion) / 3

    history = Trainer(model=gearshift_model, reward=longer_is_better,
                      algorithm={"name": "ppo", "kl_coef": 0.05, "kl_in": "reward", "kl_estimator": "k1"},
                      rollout={"n": 2, "max_tokens": 3, "backend": "hf"}, train={"backend": "torch"},
                      run={"steps": 2, "prompts_per_step": 4, "output_dir": str(tmp_path), **FAST}).train()
    last = history[-1]
    assert "train/critic/vf_loss" in last and "kl/ref" in last
    assert abs(last["kl/ref"]) > 0  # the policy moved away from the frozen reference (k1 may be < 0)


def _run(args, cwd, **kw):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "gearshift", "train", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _overrides(model, out, steps=6):
    return [f"model.path={model}", f"run.output_dir={out}", "rollout.backend=hf", "train.backend=torch", f"run.steps={steps}", "run.prompts_per_step=4",
            "rollout.n=4", "rollout.max_tokens=3", "run.checkpoint_every=2", "run.tensorboard=false",
            "run.plot=false", "run.progress=false", "run.samples_per_step=0"]


def test_a_killed_run_resumes_where_its_last_checkpoint_left_off(gearshift_model, tmp_path):
    reference = _run(_overrides(gearshift_model, tmp_path / "ref"), tmp_path)
    killed_dir = tmp_path / "killed"
    proc = _run(_overrides(gearshift_model, killed_dir), tmp_path)
    metrics = killed_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while len(read_jsonl(metrics)) < 3:  # step 3 logged; the step-2 checkpoint is complete
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)  # mid-run: usually in step 4, before its checkpoint
    proc.wait()
    logged_before = len(read_jsonl(metrics))
    # on a busy machine the run may pass the step-4 checkpoint before the kill lands: the resume must then
    # start there; either way from the last checkpoint that was complete when it died
    last = checkpoint.latest(killed_dir / "checkpoints")
    assert last is not None, f"no complete checkpoint after {logged_before} steps"
    at = int(last.name.split("_")[1])
    assert at >= 2 and at % 2 == 0
    resumed = _run(_overrides(gearshift_model, killed_dir), tmp_path)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert "resumed from" in out and f"at step {at}" in out, out
    assert logged_before - at <= 2  # at most the steps since the last checkpoint are redone
    ref_out, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_out
    got, want = read_jsonl(metrics), read_jsonl(tmp_path / "ref" / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(got, want):  # continues as if never stopped
        for key in ("reward/mean", "train/pg_loss", "train/grad_norm", "response_len/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    again = _run(_overrides(gearshift_model, killed_dir), tmp_path)  # the same command once more: all done
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert "at step 6; run.steps=6: nothing left to train (raise run.steps" in out, out
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3, 4, 5, 6]


def test_a_datasets_dataset_trains_and_a_held_out_set_is_evaluated(gearshift_model, tmp_path):
    datasets = pytest.importorskip("datasets")
    from gearshift.rl.metrics import plot_rewards

    def reward(completion, answer):
        return float(answer in completion)

    train = datasets.Dataset.from_list([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)])
    held_out = [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(3)]  # a list of row mappings
    history = Trainer(model=gearshift_model, reward=reward, dataset=train, eval_dataset=held_out,
                      rollout={"n": 2, "max_tokens": 3, "backend": "hf"}, train={"backend": "torch"},
                      run={"steps": 3, "prompts_per_step": 4, "output_dir": str(tmp_path), "eval_every": 2,
                           **FAST}).train()
    evaluated = [i + 1 for i, m in enumerate(history) if "eval/reward_mean" in m]
    assert evaluated == [2, 3], "every run.eval_every steps and after the last"
    assert all(history[s - 1]["eval/samples"] == 3 for s in evaluated)  # greedy: one completion per held-out row
    logged = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in logged if "eval/reward_mean" in r] == [2, 3]
    if plot_rewards(tmp_path / "metrics.jsonl", tmp_path / "reward.png"):  # the training and held-out rewards
        assert (tmp_path / "reward.png").stat().st_size > 0


def test_eval_every_without_a_held_out_set_is_a_config_error(gearshift_model, tmp_path):
    from gearshift.rl.config import ConfigError

    with pytest.raises(ConfigError, match="run.eval_every=2 needs a held-out set: set data.val_path"):
        Trainer(model=gearshift_model, rollout={"backend": "hf"}, train={"backend": "torch"},
                run={"steps": 1, "eval_every": 2, "output_dir": str(tmp_path), **FAST}).train()


def test_the_mismatch_is_measured_on_the_first_step_and_every_tenth(gearshift_model, tmp_path):
    """rollout.logprobs=auto: no rollout correction reads the engine's logprobs, so only the steps that log the
    mismatch figures ask for them; a rollout correction asks at every step."""
    from gearshift.rl.config import MISMATCH_EVERY

    steps = MISMATCH_EVERY + 1
    common = dict(model=gearshift_model, train={"backend": "torch"},
                  run={"steps": steps, "prompts_per_step": 2, "output_dir": str(tmp_path), **FAST})
    history = Trainer(rollout={"n": 2, "max_tokens": 2, "backend": "hf"}, **common).train()
    measured = [i + 1 for i, m in enumerate(history) if "mismatch/logprob_max" in m]
    assert measured == [1, MISMATCH_EVERY + 1]
    assert all(history[i - 1]["mismatch/logprob_max"] < 1e-4 for i in measured)
    common["run"] = {**common["run"], "steps": 2, "output_dir": str(tmp_path / "tis")}
    corrected = Trainer(rollout={"n": 2, "max_tokens": 2, "backend": "hf"}, algorithm={"rollout_correction": "tis"},
                        **common).train()
    assert all("mismatch/logprob_max" in m and "rollout_correction/ratio_mean" in m for m in corrected)
