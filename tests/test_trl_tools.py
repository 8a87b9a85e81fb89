"""The pure parts of the TRL comparison tools: the job TRL's side is given (tools/trl_side.py), the GPU driver's
step times, records and requirement check (tools/gpu/trl_h200.py), and the job tools/trl_compare.py writes."""

from __future__ import annotations

import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


trl_side = _load("trl_side", "tools/trl_side.py")
trl_h200 = _load("trl_h200", "tools/gpu/trl_h200.py")


def _job(**extra) -> dict:
    settings = {"prompts": 32, "n": 8, "max_tokens": 256, "temperature": 1.0, "lr": 3e-4, "clip": 0.2,
                "weight_decay": 0.0, "max_grad_norm": 1.0, "entropy_coef": 0.01, "max_prompt_len": 64,
                "model_dtype": "float32", "rollout_dtype": "bfloat16"}
    return {"trl_dir": "/tmp/x", "seed": 3, "steps": 7, "settings": settings, **extra}


def test_a_cpu_job_trains_the_whole_batch_at_once_on_the_cpu_without_vllm():
    args = trl_side.grpo_args(_job(gradient_checkpointing=False))
    assert args["use_cpu"] and not args.get("use_vllm") and not args["bf16"]
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (256, 1)
    assert args["gradient_checkpointing"] is False and args["entropy_coef"] == 0.01
    assert (args["seed"], args["max_steps"], args["num_generations"], args["max_completion_length"]) == (3, 7, 8, 256)
    assert args["beta"] == 0.0 and args["loss_type"] == "dapo" and args["epsilon"] == 0.2


def test_an_old_job_keeps_trls_own_gradient_checkpointing():
    assert trl_side.grpo_args(_job())["gradient_checkpointing"] is True


def test_a_gpu_job_accumulates_micro_batches_into_one_step_and_generates_with_colocated_vllm():
    trl = {"use_vllm": True, "bf16": True, "micro_batch": 32, "gradient_checkpointing": False,
           "vllm_enable_sleep_mode": True, "vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": 320}
    args = trl_side.grpo_args(_job(device="cuda", trl=trl))
    assert not args["use_cpu"] and args["bf16"]
    assert args["per_device_train_batch_size"] * args["gradient_accumulation_steps"] == 256
    assert args["gradient_accumulation_steps"] == 8
    assert args["use_vllm"] and args["vllm_mode"] == "colocate" and args["vllm_enable_sleep_mode"]
    assert args["vllm_max_model_length"] == 320 and args["vllm_gpu_memory_utilization"] == 0.3
    assert args["vllm_importance_sampling_correction"] is False


def test_a_micro_batch_that_does_not_divide_the_batch_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        trl_side.grpo_args(_job(device="cuda", trl={"micro_batch": 24}))


def test_the_steady_step_times_leave_out_the_first_steps():
    ends = [10.0, 13.0, 14.0, 16.0, 17.5]
    assert trl_h200.steady(ends, 2) == [1.0, 2.0, 1.5]  # steps 3, 4, 5
    assert trl_h200.steady(ends, 0) == [3.0, 1.0, 2.0, 1.5]  # the first step has no gap of its own
    assert trl_h200.steady(ends[:2], 2) == []


def test_a_side_that_ran_out_of_time_keeps_the_steps_it_finished():
    r = trl_h200.side_result("trl", [0.0, 5.0, 9.0, 14.0], [], 2, None, 300.0, 10)
    assert r["timed_out"] and r["steps_run"] == 4 and r["steps"] == 10 and r["step_s"] == 4.5
    assert "timed out" in trl_h200.line("7b", trl_h200.merge(None, r))


def test_the_record_of_both_sides_gives_gearshifts_step_as_a_multiple_of_trls():
    gs = trl_h200.side_result("gearshift", [0, 10, 20, 30, 40], [], 2, 0, 60.0, 5)
    trl = trl_h200.side_result("trl", [0, 20, 40, 60, 80], [], 2, 0, 90.0, 5)
    record = trl_h200.merge(gs, trl, {"model": "m"})
    assert record["ratio"] == pytest.approx(0.5) and record["unequal"] == trl_h200.UNEQUAL
    assert "0.50x TRL's step" in trl_h200.line("0.5b", record)
    assert trl_h200.merge(gs, None)["ratio"] is None


def test_the_summary_merges_the_sides_found_in_a_folder(tmp_path):
    (tmp_path / "gearshift.json").write_text(json.dumps(trl_h200.side_result("gearshift", [0, 1, 2, 3], [], 1, 0, 9, 4)))
    (tmp_path / "job-0.json").write_text(json.dumps({"model": "m"}))
    record = trl_h200.summarize_dir(tmp_path)
    assert record["trl"] is None and record["job"] == {"model": "m"} and record["gearshift"]["step_s"] == 1
    assert json.loads((tmp_path / "summary.json").read_text())["gearshift"]["steps_run"] == 4


def test_the_trl_section_follows_the_shape_unless_told():
    args = trl_h200.parser().parse_args(["run", "--shape", "7b"])
    s = _job()["settings"]
    on_gpu = trl_h200.trl_section(args, s, True)
    assert on_gpu["use_vllm"] and on_gpu["bf16"] and on_gpu["micro_batch"] == 8 and on_gpu["vllm_enable_sleep_mode"]
    assert on_gpu["vllm_max_model_length"] == 320 and not on_gpu["gradient_checkpointing"]
    assert trl_h200.trl_section(args, s, True, device_gib=79.2)["micro_batch"] == 4  # an H100: 8 did not fit
    assert trl_h200.trl_section(args, s, True, device_gib=139.8)["micro_batch"] == 8
    assert not on_gpu["importance_sampling"], "like gearshift's rollout_correction=none unless asked"
    as_it_comes = trl_h200.parser().parse_args(["run", "--shape", "7b", "--trl-gradient-checkpointing",
                                                "--trl-importance-sampling"])
    defaults = trl_h200.trl_section(as_it_comes, s, True)
    assert defaults["gradient_checkpointing"] and defaults["importance_sampling"]
    assert trl_side.grpo_args({**_job(), "trl": defaults, "device": "cuda"})["vllm_importance_sampling_correction"]
    args = trl_h200.parser().parse_args(["run", "--shape", "7b", "--trl-sleep", "off", "--trl-micro-batch", "512"])
    on_cpu = trl_h200.trl_section(args, dict(s, prompts=4, n=4), False)
    assert not on_cpu["use_vllm"] and not on_cpu["bf16"] and not on_cpu["vllm_enable_sleep_mode"]
    assert on_cpu["micro_batch"] == 16  # never more than the batch


def _wheel(path: Path, name: str, version: str, requires: list[str]) -> Path:
    meta = "\n".join([f"Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                      *[f"Requires-Dist: {r}" for r in requires]]) + "\n\nA description.\nRequires-Dist: not-a-header\n"
    whl = path / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return whl


def test_a_wheels_requirements_are_read_from_its_metadata_headers(tmp_path):
    whl = _wheel(tmp_path, "datasets", "5.0.1", ["dill<0.4.2,>=0.3.0", 'pytest; extra == "test"'])
    assert trl_h200.wheel_metadata(whl) == ("datasets", "5.0.1", ["dill<0.4.2,>=0.3.0", 'pytest; extra == "test"'])


def test_unmet_requirements_name_what_is_missing_or_at_a_wrong_version():
    requires = ["dill<0.4.2,>=0.3.0", "fsspec[http]<=2026.6.0", "multiprocess<0.70.20", 'vllm<=0.31.0,>=0.22.0; extra == "vllm"',
                'pytest; extra == "test"', 'tomli; python_version < "3"']
    have = {"dill": "0.4.1", "fsspec": "2026.9.0", "vllm": "0.24.0"}
    found = trl_h200.unmet(requires, have, ("vllm",))
    assert found == ["fsspec[http]<=2026.6.0 (found 2026.9.0)", "multiprocess<0.70.20 (missing)"]
    assert trl_h200.unmet(['vllm>=0.22.0; extra == "vllm"'], {}, ()) == []  # an extra not asked for
    assert trl_h200.unmet(['vllm>=0.22.0; extra == "vllm"'], {"vllm": "0.32.0"}, ("vllm",)) == []
    assert trl_h200.unmet(['vllm<=0.31.0; extra == "vllm"'], {"vllm": "0.32.0"}, ("vllm",)) == [
        'vllm<=0.31.0; extra == "vllm" (found 0.32.0)']


def test_the_check_passes_when_the_carried_wheels_meet_each_other(tmp_path, capsys):
    _wheel(tmp_path, "alpha_pkg", "1.0", ["beta-pkg>=2"])
    _wheel(tmp_path, "beta_pkg", "2.1", [])
    args = trl_h200.parser().parse_args(["check", str(tmp_path), "--extras"])
    assert trl_h200.check(args) == 0
    _wheel(tmp_path, "gamma", "1.0", ["beta-pkg>=3"])
    assert trl_h200.check(args) == 1
    assert "gamma 1.0: UNMET beta-pkg>=3 (found 2.1)" in capsys.readouterr().out


def test_trl_compare_writes_the_prompts_gearshift_serves_and_the_settings_trl_needs(tmp_path, monkeypatch):
    monkeypatch.setenv("GEARSHIFT_CACHE", str(tmp_path / "cache"))
    trl_compare = _load("trl_compare", "tools/trl_compare.py")
    job, overrides = trl_compare.write_job(tmp_path, 1, 3, "default", ["model.path=tiny", "algorithm.entropy_coef=0.01"])
    rows = [json.loads(x) for x in Path(job["prompts"]).read_text().splitlines()]
    assert len(rows) == 3 * job["settings"]["prompts"] and {"prompt", "answer"} <= set(rows[0])
    assert job["settings"]["entropy_coef"] == 0.01 and job["gradient_checkpointing"] is False
    assert "run.seed=1" in overrides and Path(job["model"]).is_dir()
    assert json.loads((tmp_path / "job-1.json").read_text()) == job
    with pytest.raises(SystemExit, match="rollout correction"):
        trl_compare.write_job(tmp_path, 1, 3, "default", ["model.path=tiny", "algorithm.rollout_correction=tis"])
