"""Closing an engine ends the processes its start added and no others: SGLang's own shutdown kills every child
of the host process (a trainer's workers, a Ray cluster, another engine)."""

from __future__ import annotations

import subprocess
import sys

import psutil

from gearshift.rollout import RolloutError, SamplingParams


def test_closing_an_engine_ends_its_own_processes_and_no_other(serving_model_weights, gearshift_model,
                                                               sglang_options):
    from gearshift_sglang import SGLangRolloutEngine

    before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        engine = SGLangRolloutEngine.build(gearshift_model, **sglang_options)
        after = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        own = list(engine._processes)
        assert own, "the engine's start added no process"
        assert before.pid not in {p.pid for p in own}
        engine.close()
        assert not [p.pid for p in own if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert before.poll() is None and after.poll() is None  # bystanders, started before and after, live on
        # the session's engine (another engine of this process) still serves
        out = serving_model_weights.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert len(out) == 1 and out[0].token_ids
    finally:
        for proc in (before, locals().get("after")):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_a_scheduler_that_fails_to_start_is_an_error_in_the_host_and_leaves_no_process(
        serving_model_weights, gearshift_model, sglang_options, tmp_path):
    """SGLang's scheduler sends SIGQUIT when its start fails, and SGLang's own handler then kills the whole
    process tree, host included: a run ended with status 137 and no word of gearshift's."""
    import json
    import shutil
    import signal

    import pytest

    from gearshift_sglang import SGLangRolloutEngine
    from gearshift_sglang.host import StartFailed

    model = tmp_path / "unknown-architecture"
    shutil.copytree(gearshift_model, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]  # only SGLang's scheduler resolves the class by this name
    (model / "config.json").write_text(json.dumps(config))
    running_rule = signal.getsignal(signal.SIGQUIT)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(StartFailed, match="failed while the engine started"):
        SGLangRolloutEngine.build(str(model), **sglang_options)
    assert signal.getsignal(signal.SIGQUIT) is running_rule, "the running engine's SIGQUIT rule was not put back"
    left = _children_left(before)
    assert not left, f"the failed start left processes behind: {left}"
    out = serving_model_weights.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out) == 1 and out[0].token_ids  # the session's engine still serves


def _children_left(before: set[int]) -> list[str]:
    return [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            and "resource_tracker" not in " ".join(p.cmdline())]


def test_a_scheduler_that_fails_while_generating_is_an_error_in_the_call_and_the_host_lives_on(
        serving_model_weights, sglang_options, tmp_path):
    """phi builds in SGLang 0.5.23's CPU engine, then its scheduler fails at the first prefill (the CPU attention's
    KV-cache write) and sends SIGQUIT: SGLang's handler, which its event loop takes, killed the host (status 137)."""
    import pytest

    from gearshift.models import resolve_model
    from gearshift_sglang import SGLangRolloutEngine
    from gearshift_sglang.host import SchedulerFailed

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = SGLangRolloutEngine.build(resolve_model("tiny-phi", cache_dir=tmp_path), **sglang_options)
    try:
        with pytest.raises(SchedulerFailed, match="failed while its engine ran"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=1.0))
        assert not _children_left(before), "the failed engine left processes behind"
        with pytest.raises(RolloutError, match="engine is closed: an SGLang scheduler"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    finally:
        engine.close()  # a no-op once closed
    out = serving_model_weights.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out) == 1 and out[0].token_ids  # the session's engine still serves


def test_a_scheduler_gone_between_calls_is_an_error_in_the_next_call(serving_model_weights, gearshift_model,
                                                                     sglang_options):
    """A scheduler that dies while the trainer trains (killed, out of host memory) is found at the next call,
    which would otherwise wait forever on it. A SIGQUIT of no process of the engine in a call (the watchdog of an
    engine ended before) leaves that call be."""
    import os
    import signal

    import pytest

    from gearshift_sglang import SGLangRolloutEngine
    from gearshift_sglang.host import SchedulerFailed

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    engine = SGLangRolloutEngine.build(gearshift_model, **sglang_options)
    try:
        assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        scheduler = next(p for p in engine._watched if "detokenizer" not in " ".join(p.cmdline()).lower())
        os.kill(scheduler.pid, signal.SIGKILL)
        scheduler.wait(30)
        with pytest.raises(SchedulerFailed, match="failed while its engine ran"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
        assert not _children_left(before), "the failed engine left processes behind"
    finally:
        engine.close()
    os.kill(os.getpid(), signal.SIGQUIT)  # the event loop hands it to the next call: the session engine's
    out = serving_model_weights.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(out) == 1 and out[0].token_ids
