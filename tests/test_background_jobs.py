"""tools/gpu/background.sh: GPU jobs that run on between device calls, checked here with plain shell jobs."""

from __future__ import annotations

import os
import subprocess
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu" / "background.sh"


def bg(tmp_path: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {**os.environ, "BG": str(tmp_path / "bg"), "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_a_job_runs_on_after_its_call_and_its_exit_code_and_output_are_kept(tmp_path):
    (tmp_path / "out").mkdir()
    started = bg(tmp_path, "start", "first", 'sleep 1; echo "made in $OUT" > "$OUT/result"; echo hello; exit 3')
    assert started.returncode == 0 and "first started" in started.stdout
    # the starting call has returned; the job has not ended yet
    assert "first: running" in bg(tmp_path, "status").stdout
    # a second job waits for the first, as a chain of GPU runs does
    bg(tmp_path, "start", "second", f'bash {SCRIPT} wait first 30 >/dev/null; test -f "$BG/first/rc" && echo after')
    waited = bg(tmp_path, "wait", "first", "20")
    assert "hello" in waited.stdout and "first ended: exit 3" in waited.stdout
    assert (tmp_path / "bg" / "first" / "out" / "result").read_text().strip() == \
        f"made in {tmp_path / 'bg' / 'first' / 'out'}"
    assert "after" in bg(tmp_path, "wait", "second", "20").stdout, "the second job ran once the first had ended"
    assert bg(tmp_path, "start", "first", "true").returncode == 2, "a name is taken once"
    bg(tmp_path, "collect")
    with tarfile.open(tmp_path / "out" / "bg.tgz") as tar:
        names = tar.getnames()
    assert "./first/out/result" in names and "./first/rc" in names


def test_waiting_gives_up_at_its_limit_and_stop_ends_the_whole_job(tmp_path):
    bg(tmp_path, "start", "long", "sleep 60 & sleep 60; echo never")
    waited = bg(tmp_path, "wait", "long", "1")
    assert "long still running" in waited.stdout
    bg(tmp_path, "stop", "long")
    pid = int((tmp_path / "bg" / "long" / "pid").read_text())
    deadline = time.time() + 10
    while time.time() < deadline and subprocess.run(["pgrep", "-s", str(pid)], capture_output=True).stdout:
        time.sleep(0.2)
    assert not subprocess.run(["pgrep", "-s", str(pid)], capture_output=True).stdout, \
        "every process of the job's session is gone"
