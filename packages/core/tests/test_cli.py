"""The command line: help, backends, env, and the conformance command catching a broken backend."""

import pytest

from gearshift.cli import build_parser, main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name in ("train", "backends", "env", "bench", "conformance"):
        assert name in out
    for name in ("train", "backends", "env", "conformance"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        assert "usage: gearshift " + name in capsys.readouterr().out


def test_backends_lists_reference_backends_ready(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    lines = {tuple(line.split()[:2]): line for line in out.splitlines()[2:]}
    assert "ready" in lines[("rollout", "hf")]
    assert "ready" in lines[("train", "torch")]
    for name in ("vllm", "sglang", "fsdp", "deepspeed"):
        assert any(k[1] == name for k in lines), f"{name} missing from:\n{out}"


def test_env_reports_versions(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out and "python" in out


def test_unknown_backend_is_a_clear_error(capsys):
    assert main(["conformance", "--rollout", "no-such-engine"]) == 2
    assert "no rollout backend named 'no-such-engine'" in capsys.readouterr().err


def test_parser_builds():
    assert build_parser().prog == "gearshift"


# an environment with only the run install's packages but without one optional module: importing it fails
WITHOUT = "import sys; sys.modules[{module!r}] = None; from gearshift.cli import main; sys.exit(main(sys.argv[1:]))"


def _gearshift_without(module: str, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", WITHOUT.format(module=module), *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("command", ["", "train", "backends", "env", "bench", "conformance"])
def test_every_command_starts_without_pytest(command):
    run = _gearshift_without("pytest", *([command] if command else []), "--help")
    assert run.returncode == 0, run.stderr
    assert "usage: gearshift" in run.stdout


def test_a_command_that_needs_a_missing_extra_says_what_to_install():
    run = _gearshift_without("pytest", "conformance", "--train", "torch")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "needs pytest, which is not installed: pip install 'gearshift[conformance]'" in run.stderr


def test_env_states_the_backend_contract(capsys):
    from gearshift import contract

    assert main(["env"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("backend contract"))
    assert row.split()[-1] == str(contract.VERSION)


def test_bench_step_splits_a_step_into_its_phases_and_the_loops_own_time(gearshift_model, tmp_path, capsys,
                                                                         monkeypatch):
    import json

    from gearshift.rl.controller import Controller

    closed = []
    real_close = Controller.close
    monkeypatch.setattr(Controller, "close", lambda self: (closed.append(self), real_close(self)))
    out = tmp_path / "step.json"
    assert main(["bench", "step", f"model.path={gearshift_model}", "rollout.backend=hf", "train.backend=torch",
                 "run.prompts_per_step=4", "rollout.n=2", "rollout.max_tokens=3", f"run.output_dir={tmp_path}",
                 "--steps", "3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "rollout" in printed and "loop" in printed and "% of the step" in printed
    result = json.loads(out.read_text())
    assert result["steps"] == 2 and {"step", "rollout", "reward", "train", "loop"} <= set(result)
    assert result["train_tflops"] > 0 and "train TFLOP/s" in printed  # no MFU: a CPU has no peak in the table
    parts = sum(result.get(k, 0) for k in ("rollout", "reward", "train", "switch_to_rollout", "switch_to_train"))
    assert result["loop"] == pytest.approx(result["step"] - parts, abs=0.05 * result["step"] + 1e-3)
    assert len(closed) == 1  # its engines closed before the interpreter's exit (vLLM's finalizer, else)


def test_check_names_an_engine_option_the_backend_lacks(capsys):
    from gearshift.cli import main

    assert main(["train", "rollout.backend=hf", "train.backend=torch", "rollout.options.max_batch_sise=8",
                 "--check"]) == 2
    err = capsys.readouterr().err
    assert "rollout.options: rollout backend 'hf': HFRolloutEngine has no option 'max_batch_sise'" in err
    assert main(["train", "rollout.backend=hf", "train.backend=torch", "rollout.options.max_batch_size=8",
                 "--check"]) == 0


def test_check_reads_the_data_and_loads_the_reward(tmp_path, capsys, monkeypatch):
    from gearshift.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "rw.py").write_text("def score(completion, **row):\n    return 1.0\n")
    (tmp_path / "ok.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\nnot json\n')
    def run(*overrides):
        return main(["train", "rollout.backend=hf", "train.backend=torch", *overrides, "--check"])

    assert run("data.path=ok.jsonl", "reward.fn=rw.py:score") == 0
    assert run("data.path=bad.jsonl", "reward.fn=rw.py:score") == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert run("data.path=ok.jsonl", "reward.fn=rw.py:scor") == 2
    assert "rw.py has no function 'scor'; it offers: score" in capsys.readouterr().err
    assert run("algorithm.advantage=grp") == 2
    assert "did you mean 'grpo'" in capsys.readouterr().err


def test_engine_options_given_as_json_that_is_not_an_object_name_their_flag(capsys):
    from gearshift.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "rollout", "--backends", "hf", "--options", "{bad"])
    assert e.value.code == 2
    assert "argument --options: '{bad' is not JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["conformance", "--train", "torch", "--train-options", "[1]"])
    assert "argument --train-options: '[1]' is not a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["bench", "rollout", "--prompts", "0"], "argument --prompts: 0 is less than 1"),
    (["bench", "rollout", "--n", "two"], "argument --n: 'two' is not a whole number"),
    (["bench", "switch", "--switches", "0"], "argument --switches: 0 is less than 1"),
    (["bench", "switch", "--naive-switches", "-1"], "argument --naive-switches: -1 is less than 0"),
    (["bench", "step", "--steps", "0"], "argument --steps: 0 is less than 1"),
    (["bench", "train", "--batch-size", "0"], "argument --batch-size: 0 is less than 1"),
])
def test_a_bench_count_out_of_range_is_an_error_naming_its_flag_before_anything_is_built(argv, message, capsys):
    from gearshift.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
