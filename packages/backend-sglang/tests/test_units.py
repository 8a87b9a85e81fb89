"""Parts of the backend that run without starting SGLang: its temporary folder (sockets go there, and AF_UNIX
paths hold 107 bytes), the flush retry, who hears a SIGQUIT, and whether updates go between SGLang's
begin_weight_update and end_weight_update."""

import os
import shutil
import socket
import tempfile
from pathlib import Path

from gearshift_sglang.host import MAX_SOCKET_DIR, temp_dir


def test_a_short_cache_folder_keeps_its_temporary_folder_inside():
    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))  # pytest's own folders can be longer than the limit
    try:
        assert temp_dir(root) == (root / "tmp").resolve()
    finally:
        shutil.rmtree(root)


def test_a_long_cache_folder_gets_a_short_temporary_folder_where_a_socket_binds(tmp_path):
    root = tmp_path / ("deep" * 30) / "cache"
    tmp = temp_dir(root)
    assert len(str(tmp)) <= MAX_SOCKET_DIR and tmp.is_dir() and temp_dir(root) == tmp
    # what multiprocessing's resource sharer makes there: a listener socket two levels down
    (tmp / "pymp-abcdefgh").mkdir(exist_ok=True)
    path = tmp / "pymp-abcdefgh" / "listener-abcdefgh"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    path.unlink()
    (tmp / "pymp-abcdefgh").rmdir()


def test_a_flush_refused_while_the_scheduler_winds_down_is_asked_again():
    """SGLang refuses flush_cache until its scheduler has cleaned up the batch that just ended."""
    from types import SimpleNamespace

    import pytest

    from gearshift.rollout import RolloutError
    from gearshift_sglang.engine import FLUSH_ATTEMPTS, SGLangRolloutEngine

    class Scheduler:
        def __init__(self, busy_answers):
            self.busy, self.calls = busy_answers, 0

        def flush_cache(self):
            self.calls += 1
            return SimpleNamespace(success=self.calls > self.busy, message="")

    engine = object.__new__(SGLangRolloutEngine)  # only _flush is exercised: no SGLang is started
    engine._engine = Scheduler(busy_answers=2)
    engine._flush()
    assert engine._engine.calls == 3
    engine._engine = Scheduler(busy_answers=FLUSH_ATTEMPTS)
    with pytest.raises(RolloutError, match="did not flush"):
        engine._flush()


def test_sigquit_reaches_sglang_only_while_an_engine_runs(monkeypatch):
    import signal
    import time

    from gearshift_sglang import host

    calls = []
    previous = signal.getsignal(signal.SIGQUIT)
    signal.signal(signal.SIGQUIT, lambda signum, frame: calls.append(signum))  # stands for SGLang's handler
    monkeypatch.setattr(host, "_sglang_on_quit", None)
    monkeypatch.setattr(host, "_running", None)
    try:
        running = [True]
        host.guard_sigquit(lambda: running[0])
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(0.05)  # Python runs the handler between bytecodes
        assert calls == [signal.SIGQUIT], "while an engine runs, a failing child must still end the host"
        running[0] = False
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(0.05)
        assert calls == [signal.SIGQUIT], "after close, a child's SIGQUIT must not reach SGLang's handler"
        host.guard_sigquit(lambda: True)  # a second engine: SGLang's own handler stays the one called
        os.kill(os.getpid(), signal.SIGQUIT)
        time.sleep(0.05)
        assert calls == [signal.SIGQUIT] * 2
    finally:
        signal.signal(signal.SIGQUIT, previous)


def test_weight_update_sessions_are_used_only_where_the_engine_has_both_calls():
    from gearshift_sglang.engine import weight_update_sessions

    class Sessions:  # SGLang 0.5.23's Engine
        def begin_weight_update(self, selector="all"): ...

        def end_weight_update(self): ...

    class NoSessions:  # SGLang 0.5.17's Engine
        def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True): ...

    class HalfSessions:
        begin_weight_update = None

        def end_weight_update(self): ...

    assert weight_update_sessions(Sessions) is True
    assert weight_update_sessions(NoSessions) is False
    assert weight_update_sessions(HalfSessions) is False


def test_the_installed_sglang_engine_is_read_as_it_is():
    import importlib.util

    import pytest

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed")
    from importlib.metadata import version

    from gearshift_sglang.engine import import_sglang, weight_update_sessions

    engine = import_sglang()
    has_both = hasattr(engine, "begin_weight_update") and hasattr(engine, "end_weight_update")
    assert weight_update_sessions(engine) is has_both
    if version("sglang") == "0.5.23":  # the CPU build of the suite: it refuses updates outside a session
        assert has_both


def _arguments_on(on_gpu: bool, options=None, *, free=80e9, weights=15e9, **args):
    """The real `_arguments` of an engine that was not started: only the state it reads; on a "GPU", `free`
    bytes free and `weights` bytes of fp32 weights (served in bf16: half of them)."""
    from types import SimpleNamespace
    from unittest import mock

    import torch
    from transformers import Qwen2Config

    from gearshift.mesh import MeshSpec
    from gearshift.rollout import RolloutArgs
    from gearshift_sglang import SGLangRolloutEngine

    engine = object.__new__(SGLangRolloutEngine)
    engine.args = RolloutArgs(model="m", dtype="bfloat16", **args)
    engine.options = options or SGLangRolloutEngine.Options()
    engine.on_gpu, engine.model_path, engine.dtype = on_gpu, "m", torch.bfloat16
    engine.device, engine.mesh = torch.device("cuda", 0) if on_gpu else torch.device("cpu"), MeshSpec(dp=1)
    engine._spec = [SimpleNamespace(nbytes=int(weights), dtype=torch.float32)]
    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    with mock.patch("gearshift_sglang.arguments.device_free", lambda device, cached: int(free)), \
            mock.patch("gearshift_sglang.arguments.release_cached", lambda device: 0):
        return engine._arguments(config)


def test_on_a_gpu_the_kv_cache_holds_the_batch_not_the_whole_share():
    from gearshift.rollout import KV_MARGIN
    from gearshift_sglang import SGLangRolloutEngine

    kwargs = _arguments_on(True, max_batch_tokens=256 * 320)
    assert kwargs["max_total_tokens"] == int(256 * 320 * KV_MARGIN)
    assert kwargs["mem_fraction_static"] == 0.5  # 7.5 GB of weights and a small KV cache in 80 GB free
    assert "max_total_tokens" not in _arguments_on(True)  # the batch unknown: SGLang's share
    off = SGLangRolloutEngine.Options(kv_cache_to_batch=False)
    assert "max_total_tokens" not in _arguments_on(True, off, max_batch_tokens=256 * 320)
    small = _arguments_on(True, max_batch_tokens=100)  # never less than one sequence of the context
    assert small["max_total_tokens"] == int(512 * KV_MARGIN)


def test_on_a_cpu_the_kv_cache_keeps_its_own_size():
    cpu = _arguments_on(False, max_batch_tokens=256 * 320)
    per_token = 2 * 2 * 2 * 16 * 2  # keys and values, 2 layers, 2 kv heads of 16, bf16
    assert cpu["max_total_tokens"] == (256 << 20) // per_token


def test_on_a_gpu_sglang_samples_in_plain_torch_unless_asked_otherwise():
    from gearshift_sglang import SGLangRolloutEngine

    assert _arguments_on(True)["sampling_backend"] == "pytorch"  # flashinfer's kernels would compile first
    assert "sampling_backend" not in _arguments_on(False)  # the CPU keeps SGLang's own choice
    chosen = SGLangRolloutEngine.Options(sampling_backend="flashinfer")
    assert _arguments_on(True, chosen)["sampling_backend"] == "flashinfer"
    assert _arguments_on(False, chosen)["sampling_backend"] == "flashinfer"
    over = SGLangRolloutEngine.Options(sampling_backend="flashinfer", engine_kwargs={"sampling_backend": "pytorch"})
    assert _arguments_on(True, over)["sampling_backend"] == "pytorch"


def test_on_a_gpu_sglang_captures_decoding_graphs_only_unless_asked():
    from gearshift_sglang import SGLangRolloutEngine

    assert _arguments_on(True)["disable_prefill_cuda_graph"] is True  # 79 s at a fresh machine's first start
    assert "disable_prefill_cuda_graph" not in _arguments_on(True, SGLangRolloutEngine.Options(prefill_cuda_graph=True))
    assert "disable_prefill_cuda_graph" not in _arguments_on(False)  # the CPU captures no graph at all
    assert _arguments_on(False)["disable_cuda_graph"] is True


def _flat_buckets(dtype):
    import pytest
    import torch

    import importlib.util

    if importlib.util.find_spec("sglang") is None:  # importing it needs the backend's stand-ins (below)
        pytest.skip("sglang is not installed")
    from gearshift_sglang.imports import importing_sglang
    from gearshift_sglang.weights import FlatBuckets

    with importing_sglang():
        import sglang.srt.utils  # noqa: F401
    return FlatBuckets(torch.device("cpu"), dtype)


def test_a_bucket_is_cast_into_typed_views_of_the_buffer_and_read_back_as_sglang_reads_it():
    import torch

    flat = _flat_buckets(torch.bfloat16)  # first: sglang imports inside the backend's stand-ins
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    tensors = {"a.weight": torch.randn(3, 5), "b.bias": torch.randn(7), "c.weight": torch.randn(2, 2, 2)}
    layout = flat.pack(tensors)
    for view, t in zip(layout.views, tensors.values()):
        assert view.dtype == torch.bfloat16 and torch.equal(view, t.to(torch.bfloat16))
    data = MultiprocessingSerializer.deserialize(flat.payload(layout))
    bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    read = dict(bucket.reconstruct_tensors())
    assert list(read) == list(tensors)
    assert all(torch.equal(read[n], t.to(torch.bfloat16)) for n, t in tensors.items())


def test_a_layout_is_kept_with_its_buffer_and_worked_out_again_when_the_buffer_grows():
    import torch

    flat = _flat_buckets(torch.float32)
    small = {"a": torch.ones(4), "b": torch.ones(2, 2)}
    first = flat.pack(small)
    flat.mark_delivered(first)
    again = flat.pack({"a": torch.zeros(4), "b": torch.zeros(2, 2)})
    assert again is first and flat.delivered(again) and flat.buffer_id == 1
    assert torch.equal(again.views[0], torch.zeros(4))  # the same views, new values
    other = flat.pack({"b": torch.ones(2, 2), "a": torch.ones(4)})  # another order: another layout
    assert other.id != first.id and not flat.delivered(other) and flat.buffer_id == 1
    grown = flat.pack({"c": torch.ones(100)})
    assert flat.buffer_id == 2 and not flat.delivered(grown)
    relaid = flat.pack(small)
    assert relaid is not first and not flat.delivered(relaid), "the old views were into the old buffer"
    assert torch.equal(relaid.views[1], torch.ones(2, 2))


def test_buckets_added_to_a_group_read_back_as_one_layout_and_the_same_group_is_the_same_layout():
    import torch

    flat = _flat_buckets(torch.bfloat16)  # first: sglang imports inside the backend's stand-ins
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat.group_bytes = 64
    first, second = {"a": torch.randn(3, 5), "b": torch.randn(7)}, {"c": torch.randn(2, 2, 2)}
    assert flat.add(first) and flat.add(second)
    assert flat.open_bytes == (15 + 7 + 8) * 2
    layout = flat.close()
    assert flat.open_bytes == 0 and flat.close() is None
    data = MultiprocessingSerializer.deserialize(flat.payload(layout))
    read = dict(FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"],
                                      metadata=data["metadata"]).reconstruct_tensors())
    both = {**first, **second}
    assert list(read) == list(both) and all(torch.equal(read[n], t.to(torch.bfloat16)) for n, t in both.items())
    flat.mark_delivered(layout)
    assert flat.add({"a": torch.zeros(3, 5), "b": torch.zeros(7)}) and flat.add({"c": torch.zeros(2, 2, 2)})
    again = flat.close()
    assert again is layout and flat.delivered(again) and torch.equal(again.views[2], torch.zeros(2, 2, 2))
    # the same names in one bucket at the start of a group: `pack`'s layout is the group's
    assert flat.pack({"a": torch.ones(3, 5), "b": torch.ones(7), "c": torch.ones(2, 2, 2)}) is layout


def test_a_bucket_that_does_not_fit_beside_the_open_group_is_refused_and_an_empty_group_grows_the_buffer():
    import torch

    flat = _flat_buckets(torch.float32)
    flat.group_bytes = 32
    assert flat.add({"a": torch.ones(4)}) and flat.buffer_id == 1  # a buffer of group_bytes
    assert not flat.add({"b": torch.ones(6)}), "16 + 24 bytes do not fit in 32"
    assert flat.open_bytes == 16, "a refused bucket copies nothing"
    flat.close()
    assert flat.add({"b": torch.ones(6)}) and flat.buffer_id == 1
    flat.close()
    assert flat.add({"big": torch.full((20,), 2.0)}) and flat.buffer_id == 2, "one bucket larger than the buffer"
    assert torch.equal(flat.close().views[0], torch.full((20,), 2.0))
    flat.add({"a": torch.ones(4)})
    flat.drop_open()
    assert flat.open_bytes == 0


def test_on_a_gpu_sglangs_share_of_free_memory_fits_the_weights_and_the_batchs_kv_cache_or_says_what_to_set():
    """SGLang sizes its pool as mem_fraction_static x the free memory it sees at start; weights that do not fit
    in it fail inside its scheduler, which then kills the host. The engine works the share out first."""
    import pytest

    from gearshift.options import OptionError
    from gearshift_sglang import SGLangRolloutEngine
    from gearshift_sglang.memory import MAX_FRACTION

    # a 7B model in bf16 (15.2 GB) where a trainer left 45 GB free on an 80 GB card: 0.5 fits the weights
    assert _arguments_on(True, free=45e9, weights=30.4e9)["mem_fraction_static"] == 0.5
    # 30 GB free: 0.5 would leave no KV cache; the share grows to what the weights need, with a margin
    grown = _arguments_on(True, free=30e9, weights=30.4e9, max_batch_tokens=256 * 320)["mem_fraction_static"]
    assert 0.55 < grown <= MAX_FRACTION
    # a share given too small for the weights: an error at build that names the option and the least that fits
    small = SGLangRolloutEngine.Options(mem_fraction_static=0.3)
    with pytest.raises(OptionError, match=r"mem_fraction_static to at least 0\.3[6-9]"):
        _arguments_on(True, small, free=45e9, weights=30.4e9)
    assert _arguments_on(True, SGLangRolloutEngine.Options(mem_fraction_static=0.4), free=45e9,
                         weights=30.4e9)["mem_fraction_static"] == 0.4
    # nothing fits: say what to free or shrink
    with pytest.raises(OptionError, match="free memory before the rollout engine starts"):
        _arguments_on(True, free=10e9, weights=30.4e9)
    # the user's own engine_kwargs go to SGLang unchecked, as they are
    raw = SGLangRolloutEngine.Options(engine_kwargs={"mem_fraction_static": 0.2})
    assert _arguments_on(True, raw, free=10e9, weights=30.4e9)["mem_fraction_static"] == 0.2


def test_the_walk_over_zmq_contexts_passes_weak_proxies_whose_referent_is_gone():
    """`isinstance` asks a weak proxy for its referent's class: one left dangling raised ReferenceError at the
    next engine's start (seen after an engine whose scheduler failed)."""
    import weakref

    import zmq

    from gearshift_sglang.host import zmq_contexts

    class Thing:
        pass

    thing = Thing()
    proxy = weakref.proxy(thing)
    del thing
    context = zmq.Context()
    try:
        assert id(context) in zmq_contexts()
        assert proxy is not None  # dangling, and still tracked by the collector
    finally:
        context.term()


def test_the_updates_flush_runs_between_issuing_the_copies_and_waiting_for_them(monkeypatch):
    """The prefix-cache flush is host work in the scheduler: run while the device still copies the weights, it costs
    the sync nothing of its own. The wait for the copies comes however the flush ends (the trainer writes its next
    step into the tensors read as soon as the call returns)."""
    import pytest
    import torch

    from gearshift_sglang import direct

    events = []
    monkeypatch.setattr(direct, "copy_weights_", lambda dsts, srcs: events.append("copy"))

    class Stream:
        def synchronize(self):
            events.append("wait")
    monkeypatch.setattr(direct.torch.cuda, "current_stream", lambda *a: Stream())

    class OnDevice:  # what the scheduler's views report on a GPU
        is_cuda = True
    plan = direct.Layout(named=[("w", OnDevice())], dsts=[torch.zeros(2)], srcs=[torch.ones(2)], rest=[])
    load = direct.DirectLoad(runner=None)
    load._apply(plan, loader_allowed=True, while_copying=lambda: events.append("flush"))
    assert events == ["copy", "flush", "wait"] and set(load.times) >= {"copy", "flush", "wait"}
    events.clear()

    def refused():
        events.append("flush")
        raise RuntimeError(direct.NOT_FLUSHED)
    with pytest.raises(RuntimeError, match="not flushed"):
        load._apply(plan, loader_allowed=True, while_copying=refused)
    assert events == ["copy", "flush", "wait"]


def test_a_mixture_of_experts_is_refused_on_a_cpu_before_sglang_is_imported(tmp_path):
    import pytest
    import torch

    from gearshift import registry
    from gearshift.models import build_model

    if torch.cuda.is_available():
        pytest.skip("the refusal is the CPU engine's")
    model = build_model(tmp_path / "mixtral", preset="tiny", arch="mixtral")
    with pytest.raises(ValueError, match=r"mixture-of-experts model \(4 experts a layer\).*rollout.backend=hf"):
        registry.create("rollout", "sglang", model=model, cache_dir=str(tmp_path / "cache"))
