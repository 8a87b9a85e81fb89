"""Rollout backend `sglang`: SGLang's `Engine` inside the training process, weights updated from tensors.

The `Engine` object lives in the host; SGLang runs the model in a scheduler
process it spawns (and detokenizes in another), reached over ZMQ. Weights
travel there as flattened buckets in shared memory (CUDA IPC on GPU) and are
copied there straight into SGLang's parameters (direct.py); those that do not
land in place, or all with `direct_load=False`, go through SGLang's loader,
between `begin_weight_update()` and `end_weight_update()` where SGLang has
them (0.5.23 refuses its loads outside them; 0.5.17, the release that pins the
CUDA torch 2.11, has neither and takes updates as they come:
`weight_update_sessions`); SGLang answers `(ok, message)` rather than raising,
and every answer is checked. What SGLang would fail on
inside its scheduler (a wrong name or shape, resuming memory that was not
released) is refused here first: a scheduler that fails takes the host process
down with it (see host.py).

CPU: SGLang's CPU engine (torch-native attention) with `sgl_kernel` stood in
where it cannot be installed (kernel.py, imports.py). Release and resume of
memory free nothing there (SGLang's memory saver needs CUDA): `sleep` then only
marks the tags and drops the prefix cache, unless `release_memory=True`.

SGLang is imported only when an engine is built, so this package imports (and
`gearshift backends` can say what is missing) without it.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import pickle
import random
import signal
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import psutil
import torch

from gearshift import dist as gdist
from gearshift.hf import routed_experts, weight_spec_of
from gearshift.rollout import ROLLOUT_TAGS, Rollout, RolloutArgs, RolloutEngine, RolloutError, SamplingParams
from gearshift.stored import stored_layout
from gearshift.weights import WeightBucket, WeightError, WeightSpec

from .arguments import SGLangOptions, engine_arguments
from .direct import NOT_FLUSHED
from .host import (FAILED_RUNNING, SchedulerFailed, StartFailed, cache_environment, close_zmq_contexts, contained,
                   default_cache_dir, drop_channels, end_processes, ending_only, failed_before_first_call,
                   failed_while_starting, guard_sigquit, in_call, quiet_custom_handler_line, started_processes,
                   stop_watchdog, watch_schedulers, zmq_contexts)
from .imports import cpu_environment, gpu_environment, importing_sglang
from .weights import FlatBuckets, Sources

logger = logging.getLogger(__name__)

INSTALL = "pip install 'gearshift-sglang[cpu]' && tools/install_sglang.sh (CPU), or 'gearshift-sglang[gpu]'"
CPU_RELEASES_NOTHING = "CPU SGLang releases nothing: its memory saver needs CUDA"
TOP_K_ALL = -1  # SGLang's "no top-k"


#: flush_cache calls before giving up (about 2 s in all)
FLUSH_ATTEMPTS = 28


def _conformance_xfail() -> dict[str, dict[str, str]]:
    """Contracts this backend is known not to keep where it runs (read by the conformance plugin)."""
    if torch.cuda.is_available():
        return {}
    return {"rollout": {"test_sleep_frees_memory": CPU_RELEASES_NOTHING}}


def weight_update_sessions(engine_class) -> bool:
    """True where SGLang's `Engine` wraps updates in `begin_weight_update()` / `end_weight_update()`.

    SGLang 0.5.23 answers `(False, ...)` to `update_weights_from_tensor` outside such a session and changes
    nothing; 0.5.17 has no sessions. Read from the class, not the version number: the releases between
    them were not checked."""
    return callable(getattr(engine_class, "begin_weight_update", None)) and callable(
        getattr(engine_class, "end_weight_update", None))


def import_sglang():
    try:
        with importing_sglang():
            import sglang  # noqa: F401
            from sglang.srt.entrypoints.engine import Engine
    except ImportError as e:
        raise ImportError(f"the sglang rollout backend needs SGLang, which is not importable ({e}): {INSTALL}") from e
    return Engine


class SGLangRolloutEngine(RolloutEngine):
    """SGLang generation with the model's own per-token logprobs; weights loaded from tensors in flat buckets."""

    requires: ClassVar[tuple[str, ...]] = ("sglang",)
    install: ClassVar[str] = INSTALL
    contract: ClassVar[int] = 2
    #: every path casts as it copies: into the flat buffer, and in the scheduler from the trainer's own tensors
    casts_on_load = True
    conformance_xfail: ClassVar[dict[str, dict[str, str]]] = _conformance_xfail()

    Options: ClassVar[type] = SGLangOptions
    #: what a call on a closed engine says
    _closed_because = "the sglang engine is closed"

    def __init__(self, args: RolloutArgs, options: "SGLangRolloutEngine.Options | None" = None) -> None:
        """Start SGLang for `args.model` (a local Hugging Face folder); see `Options` and the README."""
        super().__init__(args, options)
        opts = self.options
        if self.mesh.tp != 1 or self.mesh.pp != 1 or self.mesh.sp != 1:
            raise ValueError(f"the sglang rollout backend runs one engine per rank (mesh dp=N), got {self.mesh}")
        self.model_path = args.model
        self.on_gpu = torch.cuda.is_available()
        self.device = gdist.default_device()
        self.rank = gdist.rank()
        self.dtype = args.torch_dtype
        self.cache_dir = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir()
        self.release_memory = self.on_gpu if opts.release_memory is None else opts.release_memory

        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path)
        experts = routed_experts(config)
        if experts and not self.on_gpu:
            raise ValueError(
                f"SGLang's CPU engine does not compute this mixture-of-experts model ({experts} "
                f"experts a layer) as transformers does: its logprobs differ before any update. On a CPU pick "
                f"rollout.backend=hf for this model")
        self._vocab_size = int(config.vocab_size)
        self._spec = weight_spec_of(self.model_path, self.mesh, self.dtype)
        #: weights the model folder stores otherwise than transformers holds them (experts one by one):
        #: SGLang's loader takes the folder's form
        self._stored = stored_layout(self.model_path)
        kwargs = self._arguments(config)

        self._env = {**cache_environment(self.cache_dir), **(gpu_environment() if self.on_gpu else cpu_environment())}
        self._tmp = Path(self._env["TMPDIR"])  # host.temp_dir: sockets and temporary files
        with contained(self._env, self._tmp) as host:
            Engine = import_sglang()
            from . import children  # prepares the imports on import: only once SGLang is wanted

            class GearshiftEngine(Engine):
                run_scheduler_process_func = staticmethod(children.run_scheduler_process)
                run_detokenizer_process_func = staticmethod(children.run_detokenizer_process)

            self._loop_policy = asyncio.get_event_loop_policy()  # SGLang's (uvloop), set when it was imported
            self._sessions = weight_update_sessions(Engine)
            # a scheduler that fails while starting sends SIGQUIT: an error here, not the whole process killed
            ours = threading.current_thread() is threading.main_thread() and "custom_sigquit_handler" not in kwargs
            if ours:
                kwargs["custom_sigquit_handler"] = failed_while_starting
                quiet_custom_handler_line()
                before = signal.getsignal(signal.SIGQUIT)
                others = zmq_contexts()  # a notebook's, another engine's: a failed start closes only its own
            try:
                with started_processes() as self._processes:
                    self._engine = GearshiftEngine(**kwargs)
            except BaseException as e:
                if ours:  # another engine of this process keeps the rule it had
                    signal.signal(signal.SIGQUIT, before)
                if isinstance(e, StartFailed):
                    end_processes(self._processes)
                    close_zmq_contexts(others)
                raise
            if ours:  # from now on a failed scheduler is an error in the engine's call (host.py)
                signal.signal(signal.SIGQUIT, failed_before_first_call)
                watch_schedulers(self._engine)
            # SGLang shuts an engine down at exit by killing every child of the host; this engine ends its own
            atexit.unregister(self._engine.shutdown)
            atexit.register(self.close)
            self._engine.collective_rpc("gearshift_freeze_gc")  # see children.py: cache flushes walk less
        #: the host's own children the start added (scheduler, detokenizer): one gone means its scheduler failed
        self._watched = [p for p in self._processes if _alive(p) and p.ppid() == os.getpid()]
        _LIVE.add(self)
        guard_sigquit(_any_running)
        #: variables SGLang set in the host, put back after start (and after each call)
        self.host_changes = host.changed_env
        # SGLang keeps a few tokens of the context in reserve: a prompt must be shorter than this
        info = self._engine._scheduler_init_result.scheduler_infos[0]
        self.max_model_len = int(info.get("max_req_input_len", self._engine.tokenizer_manager.context_len))
        self._tokenizer = self._engine.tokenizer_manager.tokenizer
        # a group holds at most the whole model, in the engine's dtype, with room for each tensor's alignment
        whole = self._served_bytes() + len(self._spec) * self.dtype.itemsize
        if opts.load_group_bytes < 1:
            raise ValueError(f"load_group_bytes={opts.load_group_bytes} must be >= 1")
        self._flat = FlatBuckets(self.device, self.dtype, group_bytes=min(int(opts.load_group_bytes), whole))
        #: the trainer's own tensors the scheduler holds and copies from at each sync (lent buckets, direct_load)
        self._sources = Sources()
        self._updates = 0  # numbers each update for the scheduler (it checks its views once per update)
        self._flushed = 0  # the last update whose prefix-cache flush the scheduler did after its last call
        #: the last call of an update flushes the prefix cache in the scheduler (one round trip less)
        self.flush_in_scheduler = True
        self.direct_refusal: str | None = None
        #: the weights written straight into SGLang's parameters (None: direct_load is off)
        self._landed: frozenset[str] | None = self._map_weights(self.model_path) if opts.direct_load else None
        self._rng = random.Random(args.seed + self.mesh.coords(self.rank)["dp"])
        self._released: set[str] = set()  # what SGLang released

    def _arguments(self, config) -> dict[str, Any]:
        """The keyword arguments of `sglang.Engine` for this engine's arguments and options."""
        return engine_arguments(self.args, self.options, config, model_path=self.model_path, on_gpu=self.on_gpu,
                                device=self.device, dtype=self.dtype, dp=self.mesh.dp,
                                served_bytes=self._served_bytes())

    def _served_bytes(self) -> int:
        """The model's weights in the engine's dtype."""
        return sum(p.nbytes // p.dtype.itemsize for p in self._spec) * self.dtype.itemsize

    @contextmanager
    def _calling_sglang(self):
        """Around every call into SGLang: its event loop policy and variables, the host's state kept."""
        if self._engine is None:
            raise RolloutError(self._closed_because)
        try:
            if self._dead():
                raise SchedulerFailed(FAILED_RUNNING)  # it failed between calls
            with in_call(self._engine.tokenizer_manager, self._dead), \
                    contained(self._env, self._tmp, self._loop_policy):
                yield
        except Exception as e:
            if isinstance(e, SchedulerFailed) or self._dead():  # the call ended on a scheduler gone
                self._abandon()
                if not isinstance(e, SchedulerFailed):
                    raise SchedulerFailed(FAILED_RUNNING) from e
            raise

    def _dead(self) -> bool:
        """Whether a process the engine's start added to the host (scheduler, detokenizer) has ended."""
        return not all(_alive(p) for p in self._watched)

    def _abandon(self) -> None:
        """After its scheduler failed: end the engine's processes and close it, the host kept alive."""
        engine, self._engine = self._engine, None
        self._closed_because = f"the sglang engine is closed: {FAILED_RUNNING}"
        atexit.unregister(self.close)
        stop_watchdog(engine)
        end_processes(self._processes)
        others = {t for e in list(_LIVE) if e._engine is not None
                  for t in getattr(e._engine.tokenizer_manager, "asyncio_tasks", ())}
        with contained(self._env, self._tmp, self._loop_policy):
            drop_channels(engine, keep=others)
        self._flat.release()
        self._sources.release()

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Rollout]:
        self.check_prompts(prompts, sampling, self._vocab_size)
        ids = [[int(t) for t in p] for p in prompts for _ in range(sampling.n)]
        params = [self._sampling(sampling, len(p)) for p in prompts for _ in range(sampling.n)]
        with self._calling_sglang():
            if not sampling.greedy:
                # SGLang's CPU sampler draws from its scheduler's global generator: seed it for this batch
                seed = sampling.seed if sampling.seed is not None else self._rng.getrandbits(63)
                self._engine.collective_rpc("gearshift_reseed", seed=int(seed))
            outputs = self._engine.generate(input_ids=ids, sampling_params=params, return_logprob=sampling.logprobs)
        return [self._rollout(ids[j], out, j // sampling.n, j % sampling.n, sampling.logprobs)
                for j, out in enumerate(outputs)]

    def _sampling(self, s: SamplingParams, prompt_len: int) -> dict[str, Any]:
        return {
            "max_new_tokens": min(s.max_tokens, self.max_model_len - prompt_len),
            "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or TOP_K_ALL,
            "stop": list(s.stop) or None, "stop_token_ids": list(s.stop_token_ids) or None,
        }

    def _rollout(self, prompt: list[int], out: dict, index: int, sample: int, logprobs: bool) -> Rollout:
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length"):
            raise RolloutError(f"SGLang ended prompt {index} with finish reason {meta.get('finish_reason')!r}")
        tokens = [int(t) for t in out["output_ids"]]
        values = [float(lp) for lp, _, _ in meta["output_token_logprobs"]] if logprobs else []
        if logprobs and len(values) != len(tokens):
            raise RolloutError(f"SGLang returned {len(values)} logprobs for {len(tokens)} tokens of prompt {index}")
        return Rollout(prompt, tokens, values, reason, prompt_index=index, sample_index=sample, text=out["text"])

    # --- weights ----------------------------------------------------------------------------
    def weight_spec(self) -> WeightSpec:
        return self._spec

    def _map_weights(self, checkpoint: str) -> frozenset[str]:
        """Have the scheduler find where each weight lands in its parameters, keeping the views that hold
        exactly the tensors of the checkpoint in folder `checkpoint` (its weights must still be those);
        the names it will write directly (direct.py)."""
        spec_file, found_file = self._tmp / f"spec-{id(self)}.pkl", self._tmp / f"landed-{id(self)}.json"
        spec_file.write_bytes(pickle.dumps(self._spec))
        try:
            with self._calling_sglang():
                self._engine.collective_rpc("gearshift_map_weights", spec_path=str(spec_file),
                                            checkpoint=str(checkpoint), path=str(found_file))
            found = json.loads(found_file.read_text())
        finally:
            spec_file.unlink(missing_ok=True)
            found_file.unlink(missing_ok=True)
        #: why no weight is written directly, where SGLang or the model rules it out
        self.direct_refusal = found["reason"]
        return frozenset(found["landed"])

    def update_weights(self, buckets: Iterable[WeightBucket]) -> int:
        """Load the buckets, one flat buffer per bucket, into SGLang's parameters.

        Each bucket is checked before any of it is sent; the buckets before a bad one stay applied.
        The prefix cache is flushed once, after the last bucket, however the update ends: by the update's
        last call into the scheduler where it can (one round trip less), else by a call of its own; not at
        all while the KV cache sleeps (`sleep` flushed it). With
        `direct_load`, the buckets are gathered in the flat buffer up to `load_group_bytes` and one call
        into the scheduler per group copies the weights that landed straight into SGLang's parameters and
        hands the rest to its loader (direct.py). Landed weights of lent buckets (the trainer's own
        tensors, on this engine's device) skip the flat buffer: the scheduler copies them from the
        trainer's tensors, which it holds between syncs, in one call at the end (`Sources`). Where every weight lands,
        no begin/end session is opened (it lets SGLang undo and redo its own packing of weights around
        its loader, and a weight it packs never lands).
        """
        loaded, applied = 0, 0
        sources: dict[str, torch.Tensor] = {}  # the trainer's own tensors, copied from in the scheduler at the end
        held = False  # `sources` are the very tensors the scheduler holds, checked when they were handed over
        session = self._sessions and not self._all_landed()
        with self._weight_update(session=session):
            try:
                for bucket in buckets:
                    if bucket.lent and not sources and self._sources.known(bucket.tensors):
                        sources, held = dict(bucket.tensors), True  # nothing to check or sort out again
                        loaded += self._sources.nbytes
                        continue
                    held = False
                    try:
                        tensors = self._spec.check(bucket.tensors, self.rank)
                    except WeightError as e:
                        applied += self._send_group(applied)  # the buckets before it stay applied
                        applied += self._send_sources(sources, applied)
                        raise WeightError(f"{e} ({applied} weights from the buckets before it were applied)") from e
                    if tensors and self._landed is None:
                        self._load(tensors, applied)
                        applied += len(tensors)
                        tensors = {}
                    elif tensors and bucket.lent and self._readable(tensors):
                        sources.update((n, t) for n, t in tensors.items() if n in self._landed)
                        tensors = {n: t for n, t in tensors.items() if n not in self._landed}
                    if tensors:  # gathered into the open group, sent when it is full
                        if not self._flat.add(tensors):
                            applied += self._send_group(applied)
                            self._flat.add(tensors)
                        if self._flat.open_bytes >= self._flat.group_bytes:
                            applied += self._send_group(applied)
                    loaded += bucket.nbytes
                    del tensors, bucket
                # the last call into the scheduler flushes the prefix cache there too (outside a session, whose
                # end comes before the flush)
                fuse = self.flush_in_scheduler and not session and "kv_cache" not in self.asleep
                applied += self._send_group(applied, flush=fuse and not sources)
                applied += self._send_sources(sources, applied, flush=fuse, held=held)
            finally:
                self._flat.drop_open()
        return loaded

    def _readable(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether the scheduler can read these tensors where they are (on the engine's device)."""
        return all(t.device == self.device and t.is_floating_point() for t in tensors.values())

    def _send_sources(self, sources: dict[str, torch.Tensor], applied: int, flush: bool = False,
                      held: bool = False) -> int:
        """Have the scheduler copy `sources` (trainer tensors) into its parameters, handing them over only when
        they are not those it holds (`held`: known to be), and with `flush` flush the prefix cache after; the
        number of weights (0: none)."""
        if not sources:
            return 0
        payload = "" if held or self._sources.known(sources) else self._sources.payload(sources)
        if self.on_gpu:  # the trainer's last writes into them (its optimizer step) finish before the scheduler reads
            torch.cuda.current_stream(self.device).synchronize()
        ok, message = self._call_loading("gearshift_sources", flush, payload=payload, update=self._updates)
        if not ok:
            self._sources.release()  # not known there: handed over again next time
            self._refused(False, message, applied)
        if payload:
            self._sources.handed_over()
        return len(sources)

    def _call_loading(self, method: str, flush: bool, **kwargs) -> tuple[bool, str]:
        """Call one of the scheduler's loading methods (children.py); with `flush`, it flushes the prefix cache
        after the weights, and the update's own flush is left out where it did. (ok, SGLang's message)."""
        try:
            self._engine.collective_rpc(method, flush=flush, **kwargs)
        except AssertionError as e:  # SGLang's collective_rpc asserts its scheduler's answer
            if NOT_FLUSHED not in str(e):
                return False, str(e)
        else:
            if flush:
                self._flushed = self._updates
        return True, ""

    def release_sources(self) -> None:
        """Drop the trainer's tensors the scheduler holds (before the trainer offloads its parameters)."""
        if not self._sources.held or self._engine is None:
            return
        self._sources.release()
        with self._calling_sglang():
            self._engine.collective_rpc("gearshift_release_sources")
        if self.on_gpu:
            torch.cuda.ipc_collect()  # blocks the scheduler mapped are freed now, not when the allocator next looks

    def _send_group(self, applied: int, flush: bool = False) -> int:
        """Send the open group of buckets to the scheduler (with `flush`, the prefix cache flushed after it); the
        number of weights in it (0: none was open)."""
        layout = self._flat.close()
        if layout is None:
            return 0
        self._refused(*self._load_direct(layout, flush), applied)
        return len(layout.metadata)

    @property
    def load_path(self) -> str:
        """How an update reaches SGLang's parameters, in words (benchmarks record it beside their figures)."""
        if self._landed is None:
            return "flattened buckets through SGLang's update_weights_from_tensor (direct_load off)"
        total = len(self._spec.names())
        said = (f"direct: {len(self._landed & set(self._spec.names()))} of {total} weights written into the "
                f"scheduler's parameters, copied from the trainer's own tensors where it lends them (the scheduler "
                f"holds them between syncs), else from a flat buffer in groups of up to "
                f"{self._flat.group_bytes / 1e6:.0f} MB")
        return said + (f"; the rest through SGLang's loader ({self.direct_refusal})" if self.direct_refusal else "")

    def _all_landed(self) -> bool:
        return self._landed is not None and self._landed.issuperset(self._spec.names())

    @contextmanager
    def _weight_update(self, session: bool):
        """Around an update: refused while the weights sleep; SGLang's begin/end session if `session`; the
        prefix cache flushed once at the end, however the update ends."""
        if "weights" in self.asleep or "weights" in self._released:
            raise RolloutError("the engine's weights are asleep: call wake(['weights']) before updating them")
        self._updates += 1
        with self._calling_sglang():
            if session:
                self._answer("begin_weight_update", self._engine.begin_weight_update())
            try:
                yield
            finally:
                if session:
                    self._answer("end_weight_update", self._engine.end_weight_update())
                # nothing to flush when the scheduler did after the update's last call, or while the KV cache
                # sleeps: `sleep` flushed it, and nothing has run since
                if self._flushed != self._updates and "kv_cache" not in self.asleep:
                    self._flush()

    def _load(self, tensors: dict[str, torch.Tensor], applied: int) -> None:
        self._refused(*self._load_flattened(self._flat.pack(dict(self._stored.to_stored(tensors.items())))), applied)

    @staticmethod
    def _refused(ok: bool, message: str, applied: int) -> None:
        """A `WeightError` where SGLang's scheduler refused a load, saying how many weights were applied before."""
        if not ok:
            raise WeightError(f"SGLang refused the weights: {message} ({applied} weights from the buckets before "
                              f"it were applied)")

    def _load_flattened(self, layout) -> tuple[bool, str]:
        return self._engine.update_weights_from_tensor([self._flat.payload(layout)], load_format="flattened_bucket",
                                                       flush_cache=False)

    def _load_direct(self, layout, flush: bool = False) -> tuple[bool, str]:
        # the payload once per buffer and layout: after that the scheduler holds both, and two numbers do
        payload = "" if self._flat.delivered(layout) else self._flat.payload(layout)
        ok, message = self._call_loading("gearshift_load", flush, payload=payload, buffer=self._flat.buffer_id,
                                         layout=layout.id, update=self._updates)
        if ok:
            self._flat.mark_delivered(layout)
        return ok, message

    def own_load(self, buckets: Iterable[WeightBucket]) -> int:
        """The switch bench's `OwnLoad`: SGLang's `update_weights_from_tensor` as its users call it, one call per
        bucket with the named tensors (SGLang serializes each one itself, no flat buffer), in a begin/end
        session where SGLang has them, the cache flushed once after the last bucket. Names and shapes are
        checked first: a wrong one would fail inside SGLang's scheduler and take the process down."""
        loaded = 0
        with self._weight_update(session=self._sessions):
            for bucket in buckets:
                tensors = self._spec.check(bucket.tensors, self.rank)
                if tensors:
                    named = [(n, t.to(self.device, self.dtype)) for n, t in self._stored.to_stored(tensors.items())]
                    self._answer("update_weights_from_tensor",
                                 self._engine.update_weights_from_tensor(named, flush_cache=False))
                loaded += bucket.nbytes
                del tensors, bucket
        return loaded

    @staticmethod
    def _answer(call: str, answer) -> None:
        ok, message = answer if isinstance(answer, tuple) else (getattr(answer, "success", True), answer)
        if not ok:
            raise WeightError(f"SGLang's {call} failed: {message}")

    def reset_cache(self) -> None:
        with self._calling_sglang():
            self._flush()

    def _flush(self) -> None:
        # SGLang flushes only a fully idle scheduler; right after a batch ends it may not have cleaned the
        # batch up yet (it does so on its next loop, which an idle scheduler waiting on its sockets runs
        # when the next message, this one, arrives): ask again, briefly
        for attempt in range(FLUSH_ATTEMPTS):
            answer = self._engine.flush_cache()
            if answer.success:
                return
            time.sleep(0.005 * (attempt + 1))
        raise RolloutError(f"SGLang did not flush its cache after {FLUSH_ATTEMPTS} attempts (it refuses while "
                           f"requests are pending): {answer.message}")

    # --- memory -----------------------------------------------------------------------------
    def sleep(self, tags: Sequence[str] = ROLLOUT_TAGS) -> None:
        """Release the tags through SGLang (`release_memory`), or only mark them; the prefix cache is dropped."""
        tags = set(self._tags(tags)) - self.asleep
        if not tags:
            return
        with self._calling_sglang():
            self._flush()
            if self.release_memory:
                # the KV cache first: SGLang flushes it on release; CUDA graphs go with the weights on GPU
                for tag in [t for t in ("kv_cache", "weights") if t in tags]:
                    sglang_tags = [tag, "cuda_graph"] if tag == "weights" and self.on_gpu else [tag]
                    self._engine.release_memory_occupation(tags=sglang_tags)
                    self._released.add(tag)
        self.asleep |= tags

    def wake(self, tags: Sequence[str] = ROLLOUT_TAGS) -> None:
        """Resume what SGLang released, weights before the KV cache (woken weights still need an update)."""
        tags = set(self._tags(tags))
        with self._calling_sglang():
            for tag in [t for t in ("weights", "kv_cache") if t in tags & self._released]:
                sglang_tags = [tag, "cuda_graph"] if tag == "weights" and self.on_gpu else [tag]
                self._engine.resume_memory_occupation(tags=sglang_tags)
                self._released.discard(tag)
        self.asleep -= tags

    def _report(self) -> dict:
        """The scheduler's report (children.py `gearshift_report`)."""
        report = self._tmp / f"memory-{id(self)}.json"
        with self._calling_sglang():
            self._engine.collective_rpc("gearshift_report", path=str(report))
        held = json.loads(report.read_text())
        report.unlink()
        return held

    def load_times(self) -> dict[str, float]:
        """Seconds each part of the last weight update took inside the scheduler process (written directly into
        its parameters; empty when everything went through SGLang's loader): receive, check, loader, copy,
        wait, and the number of calls. The rest of an update's time is the host's and the calls' round trips."""
        return self._report()["load_times"]

    def resident_bytes(self) -> dict[str, int]:
        """Bytes the scheduler process holds in the model's parameters and the KV cache, measured there."""
        held = self._report()
        return {"weights": 0 if "weights" in self._released and self.on_gpu else held["weights"],
                "kv_cache": 0 if "kv_cache" in self._released and self.on_gpu else held["kv_cache"]}

    def close(self) -> None:
        if getattr(self, "_engine", None) is None:
            return
        try:  # the scheduler lets go of the trainer's tensors first: no CUDA IPC reference outlives it
            self.release_sources()
        except Exception as err:  # a scheduler that died already holds nothing
            logger.warning("sglang: the scheduler did not release the trainer's tensors at close: %s", err)
        engine, self._engine = self._engine, None
        atexit.unregister(self.close)
        with contained(self._env, self._tmp, self._loop_policy), ending_only(self._processes):
            engine.shutdown()
            drop_channels(engine)
        self._flat.release()
        self._sources.release()
        if self.on_gpu:
            torch.cuda.ipc_collect()


#: the engines of this process, running or closed (see host.guard_sigquit)
_LIVE: "weakref.WeakSet[SGLangRolloutEngine]" = weakref.WeakSet()


def _alive(proc) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _any_running() -> bool:
    return any(e._engine is not None for e in list(_LIVE))


__all__ = ["SGLangRolloutEngine", "import_sglang", "weight_update_sessions"]
