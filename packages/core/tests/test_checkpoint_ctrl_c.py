"""Ctrl-C while a checkpoint is written: the write finishes, then the run stops; a second Ctrl-C stops at once."""

import os
import signal

import pytest

from gearshift.rl import checkpoint


class Engine:
    """Writes its state in two parts, with Ctrl-C pressed `presses` times between them."""

    def __init__(self, presses: int):
        self.presses = presses

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "part1"), "w") as f:
            f.write("one")
        for _ in range(self.presses):
            os.kill(os.getpid(), signal.SIGINT)  # delivered before the next line runs
        with open(os.path.join(path, "part2"), "w") as f:
            f.write("two")


def test_ctrl_c_during_a_write_stops_once_the_checkpoint_is_complete(tmp_path, capsys):
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 3, {"policy": Engine(presses=1)}, {"step": 3})
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000003"  # whole: the same command resumes from it
    assert (tmp_path / "step_000003" / "policy" / "part2").read_text() == "two"
    assert "stopping once checkpoint 3 is written" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C is plain again afterwards


def test_a_second_ctrl_c_stops_the_write_at_once(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 3, {"policy": Engine(presses=2)}, {"step": 3})
    assert not (tmp_path / "step_000003" / "policy" / "part2").exists()
    assert checkpoint.latest(tmp_path) is None  # no marker: never resumed from
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_write_without_ctrl_c_and_a_failing_one_are_unchanged(tmp_path):
    assert checkpoint.save(tmp_path, 1, {"policy": Engine(presses=0)}, {"step": 1}) == tmp_path / "step_000001"

    class Failing:
        def save(self, path):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(tmp_path, 2, {"policy": Failing()}, {"step": 2})
    assert checkpoint.latest(tmp_path) == tmp_path / "step_000001"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_program_with_its_own_ctrl_c_handler_keeps_it(tmp_path):
    seen = []
    previous = signal.signal(signal.SIGINT, lambda *a: seen.append(1))
    try:
        checkpoint.save(tmp_path, 1, {"policy": Engine(presses=1)}, {"step": 1})
        assert seen == [1] and signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
