"""tools/gpu/grpo_scenario.py's bookkeeping, without a GPU: a cell's time estimate, a budget stop, a cell's
process group ended at the budget."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "grpo_scenario.py"


def load():
    spec = importlib.util.spec_from_file_location("grpo_scenario", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_estimate_grows_with_the_answer_length_and_covers_the_7b_1024_cell_seen_on_the_h200():
    s = load()
    cell = s.parse_cell("7b-1024-fsdp-auto")
    # seen: 19 steps of 47.4 s (median) and the engines' start filled a 1,000 s budget
    assert s.expected_s(cell, 20) > 1000
    assert s.expected_s(s.parse_cell("7b-256-fsdp-auto"), 20) < s.expected_s(cell, 20) / 3
    assert s.expected_s(s.parse_cell("0.5b-1024-fsdp-auto"), 20) < s.expected_s(cell, 20)


def test_the_estimate_counts_zero3s_slower_step_at_the_larger_shapes():
    s = load()
    # seen on an H100: 29.2 s a step at 1.5B x 1024 with deepspeed forced, 16.5 s with fsdp
    assert s.expected_s(s.parse_cell("1.5b-1024-deepspeed-forced"), 20) > 20 * 29
    fsdp = s.expected_s(s.parse_cell("1.5b-1024-fsdp-forced"), 20) - s.START_S["vllm"]
    assert 20 * 16 < fsdp < 20 * 20
    assert s.expected_s(s.parse_cell("0.5b-256-deepspeed-auto"), 20) == s.expected_s(
        s.parse_cell("0.5b-256-fsdp-auto"), 20)


def test_the_estimate_counts_sglangs_slower_first_start():
    s = load()
    cell = s.parse_cell("0.5b-256-deepspeed-forced")
    # seen on an H100: SGLang's first start had not finished its graphs 150 s in
    assert s.expected_s(cell, 0, "sglang") > 150 > s.expected_s(cell, 0, "vllm")
    assert set(s.START_S) == set(s.ROLLOUTS)


def test_a_cell_stopped_at_the_budget_says_so_and_keeps_its_steps():
    s = load()
    rows = [{"time/step": 40.0 + i, "time/rollout": 20.0, "time/train": 20.0} for i in range(5)]
    stopped = s.summarize(s.parse_cell("7b-1024-fsdp-auto"), rows, s.STOPPED, 1000.0, "Capturing CUDA graphs ...")
    assert stopped["error"] == "stopped at the time budget after 5 steps"
    assert stopped["steps"] == 5 and stopped["step_s"] == 43.0  # the median after the first two steps
    failed = s.summarize(s.parse_cell("7b-1024-fsdp-auto"), rows, 1, 10.0, "CUDA out of memory")
    assert failed["error"] == "CUDA out of memory"


def test_a_cell_past_its_time_is_ended_with_its_process_group():
    s = load()
    t0 = time.time()
    code, output = s.run_cell([sys.executable, "-c", "import subprocess, sys, time; print('up', flush=True); "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                               "time.sleep(60)"], timeout=3)
    assert code == s.STOPPED and "up" in output
    assert time.time() - t0 < 30  # the child holding the pipe was killed too


def test_a_shared_cell_asks_for_shared_prompts_and_a_bad_cell_names_the_form():
    import pytest

    s = load()
    plain, shared = s.parse_cell("7b-256-fsdp-auto"), s.parse_cell("7b-256-fsdp-auto-shared")
    assert not plain["shared"] and shared["shared"] and shared["model"] == "7b" and shared["offload"] == "auto"
    out = Path("/tmp/out")
    assert "train.share_prompts=true" in s.overrides(shared, 2, out, 32, 8)
    assert not any("share_prompts" in a for a in s.overrides(plain, 2, out, 32, 8))
    with pytest.raises(SystemExit, match=r"\[-shared\]"):
        s.parse_cell("7b-256-fsdp-auto-extra")


def test_the_table_of_every_cell_takes_the_latest_run_of_a_cell_on_each_device(tmp_path):
    import json

    spec = importlib.util.spec_from_file_location("scenario_table", SCRIPT.parent / "scenario_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    s = load()
    rows = [{"time/step": 10.0, "time/rollout": 4.0, "time/train": 6.0, "memory/peak_gb": 70.0}] * 3

    def write(folder, cell, code, steps):
        (tmp_path / folder).mkdir(exist_ok=True)
        result = s.summarize(s.parse_cell(cell), rows[:steps], code, 100.0, "")
        (tmp_path / folder / f"scenario-{cell}.json").write_text(json.dumps({"cells": [result], "not_run": []}))

    write("2026-12-01-h200-realistic", "7b-256-fsdp-auto", 1, 1)  # failed, then run again
    write("2026-12-03-h200-realistic", "7b-256-fsdp-auto", 0, 3)
    write("2026-12-05-h100-realistic", "7b-256-fsdp-auto", s.STOPPED, 2)
    write("notes", "0.5b-256-fsdp-auto", 0, 3)  # not a <date>-<device> folder: not a measurement
    every = table.runs(tmp_path)
    assert [(r["date"], r["device"]) for r in every] == [("2026-12-01", "h200"), ("2026-12-03", "h200"),
                                                         ("2026-12-05", "h100")]
    last = table.latest(every)
    assert [(r["device"], r["date"], r["exit"]) for r in last] == [("h100", "2026-12-05", s.STOPPED),
                                                                   ("h200", "2026-12-03", 0)]
    text = table.table(last)
    assert "| 2026-12-05 | H100 | 7b-256-fsdp-auto | vllm | 2 (budget) | 10.00 |" in text
    assert "| 2026-12-03 | H200 | 7b-256-fsdp-auto | vllm | 3 | 10.00 | 4.00 | 6.00 |" in text


def test_the_missing_cells_are_those_of_the_matrix_no_vllm_run_has_finished_to_step_20(tmp_path):
    spec = importlib.util.spec_from_file_location("scenario_table", SCRIPT.parent / "scenario_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    base = {"date": "2026-12-05", "device": "h100"}
    rows = [{**base, "cell": "7b-256-fsdp-auto", "steps": 20, "exit": 0},
            {**base, "cell": "7b-1024-fsdp-auto", "steps": 19, "exit": 124},
            {**base, "cell": "0.5b-256-fsdp-auto", "steps": 8, "exit": 0},
            {**base, "cell": "0.5b-256-fsdp-forced", "steps": 20, "exit": 0, "rollout": "sglang"},
            {**base, "cell": "1.5b-256-fsdp-auto", "steps": 3, "exit": 1},
            {**base, "cell": "1.5b-256-fsdp-auto", "steps": 20, "exit": 0, "date": "2026-12-06"}]
    left = dict(table.missing(rows))
    assert len(table.MATRIX) == 24 and "7b-256-fsdp-auto" not in left and "1.5b-256-fsdp-auto" not in left
    assert left["7b-1024-fsdp-auto"] == "19 of 20 (budget), 2026-12-05 H100"
    assert left["0.5b-256-fsdp-auto"].startswith("8 of 20 (fewer asked)")
    assert left["0.5b-256-fsdp-forced"] == "never run"  # an SGLang run is not the matrix's vLLM cell
    stopped = {**base, "cell": "1.5b-1024-deepspeed-auto", "steps": 17, "exit": 124, "error": "terminated after 17"}
    assert dict(table.missing(rows + [stopped]))["1.5b-1024-deepspeed-auto"] == "17 of 20 (stopped), 2026-12-05 H100"
    assert len(left) == 22


def test_a_terminated_scenario_ends_the_running_cell_with_its_process_group(tmp_path):
    """`timeout` around the script sends it SIGTERM: the cell's `gearshift train` (in a session of its own, out
    of reach of the signal) must not run on holding the GPU."""
    import json
    import os
    import signal
    import subprocess

    pid_file = tmp_path / "cell.pid"
    (tmp_path / "cell.py").write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                                      "print('up', flush=True)\ntime.sleep(60)\n")
    (tmp_path / "driver.py").write_text(
        "import importlib.util, json, signal, sys\n"
        f"spec = importlib.util.spec_from_file_location('s', {str(SCRIPT)!r})\n"
        "s = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(s)\n"
        "signal.signal(signal.SIGTERM, s._terminate)\n"
        f"code, out = s.run_cell([sys.executable, {str(tmp_path / 'cell.py')!r}], timeout=60)\n"
        "print(json.dumps([code, out, s.terminated]))\n")
    proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py")], stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not pid_file.exists() and time.time() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    code, output, terminated = json.loads(out.strip().splitlines()[-1])
    assert code == load().STOPPED and "up" in output and terminated
    try:
        os.kill(child, 0)  # a zombie no more: the driver reaped it
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive, "the cell's process outlived the terminated scenario"
