"""Closing an engine ends the processes its start added and no others: SGLang's own shutdown kills every child
of the host process (a trainer's workers, a Ray cluster, another engine)."""

from __future__ import annotations

import subprocess
import sys

import psutil

from gearshift.rollout import SamplingParams


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
