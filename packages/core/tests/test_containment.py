"""The host's state comes back after a block that changes it the way an in-process engine does."""

import logging
import os
import random
import signal
import tempfile

import torch

from gearshift.containment import RngState, contained, threads


def test_variables_come_back_except_the_engine_own(monkeypatch):
    monkeypatch.setenv("GEARSHIFT_TEST_HOST", "host")
    monkeypatch.delenv("GEARSHIFT_TEST_NEW", raising=False)
    monkeypatch.delenv("ENGINEX_OWN", raising=False)
    with contained({"GEARSHIFT_TEST_BLOCK": "1"}, keep="ENGINEX_") as state:
        assert os.environ["GEARSHIFT_TEST_BLOCK"] == "1"
        os.environ["GEARSHIFT_TEST_HOST"] = "engine"
        os.environ["GEARSHIFT_TEST_NEW"] = "engine"
        os.environ["ENGINEX_OWN"] = "kept"
    try:
        assert os.environ["GEARSHIFT_TEST_HOST"] == "host"
        assert "GEARSHIFT_TEST_NEW" not in os.environ and "GEARSHIFT_TEST_BLOCK" not in os.environ
        assert os.environ["ENGINEX_OWN"] == "kept"
        assert state.changed_env["GEARSHIFT_TEST_HOST"] == ("host", "engine")
        assert state.changed_env["GEARSHIFT_TEST_NEW"] == (None, "engine")
        assert "ENGINEX_OWN" not in state.changed_env
    finally:
        os.environ.pop("ENGINEX_OWN", None)


def test_generators_threads_and_process_state_come_back():
    torch.manual_seed(5)
    random.seed(5)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(5)
    random.seed(5)
    set_num_threads, n = torch.set_num_threads, torch.get_num_threads()
    handler, level, tmp = signal.getsignal(signal.SIGTERM), logging.getLogger().level, tempfile.tempdir
    with contained({}, "/nowhere", keep="ENGINEX_"):
        assert tempfile.tempdir == "/nowhere"
        torch.manual_seed(99)
        random.seed(99)
        torch.set_num_threads = lambda k: None  # what vLLM's CPU worker does
        signal.signal(signal.SIGTERM, lambda *a: None)
        logging.getLogger().setLevel(logging.CRITICAL)
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == n
    assert signal.getsignal(signal.SIGTERM) is handler
    assert logging.getLogger().level == level and tempfile.tempdir == tmp
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_a_seeded_state_leaves_the_host_generators_alone():
    torch.manual_seed(1)
    expected = torch.rand(2)
    torch.manual_seed(1)
    own = RngState.seeded(7)
    assert torch.equal(torch.rand(2), expected)
    host = RngState.capture()
    own.restore()
    first = torch.rand(2)
    RngState.seeded(7).restore()
    assert torch.equal(torch.rand(2), first)
    host.restore()


def test_threads_for_the_block_only():
    n = torch.get_num_threads()
    with threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == n


def test_a_frozen_heap_is_given_back_and_a_heap_frozen_by_another_is_left_frozen(monkeypatch):
    """`heap_frozen` freezes the heap for its block and gives it back; where another froze it first (vLLM's engine
    does at start) it does nothing, since `gc.unfreeze` would give back that one's objects too."""
    from gearshift import containment

    calls, frozen = [], [0]

    class FakeGC:
        def get_freeze_count(self):
            return frozen[0]

        def collect(self):
            calls.append("collect")

        def freeze(self):
            calls.append("freeze")

        def unfreeze(self):
            calls.append("unfreeze")
    monkeypatch.setattr(containment, "gc", FakeGC())
    with containment.heap_frozen(collect=True):
        assert calls == ["collect", "freeze"]
    assert calls == ["collect", "freeze", "unfreeze"]
    calls.clear()
    try:
        with containment.heap_frozen():
            raise KeyError("a failing step")
    except KeyError:
        pass
    assert calls == ["freeze", "unfreeze"]
    calls.clear()
    frozen[0] = 7
    with containment.heap_frozen(collect=True):
        pass
    with containment.heap_frozen(on=False):
        pass
    assert calls == []
