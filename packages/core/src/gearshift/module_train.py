"""`ModuleTrainEngine`: the part of a trainer every backend built on a torch `nn.Module` would write again.

It loads any `AutoModelForCausalLM` from a local folder (dropout off unless
asked, a value head for a critic), runs micro-batched AdamW steps with global
gradient clipping (micro-batches from gearshift.micro_batch), computes
log-probabilities, describes its weights, offloads state to host memory and
back bit-exactly, checkpoints, and writes a Hugging Face folder through its own
export. A sharding backend passes a `Sharding` (gearshift.sharding: placement,
local shard and full shape of each weight, the parameters it trains, the
update, the forward) and overrides public methods only where its state lives
elsewhere (`offload`/`onload`/`offloaded`, `save`/`load`, `close`).

LoRA (`lora_r > 0`, through peft; see gearshift.lora) comes with the base: only the
adapters train and hold optimizer state, the weight spec lists the base weights under
their Hugging Face names and an export merges each adapter into its weight, so any
rollout engine takes them unchanged. A sharding that gathers weights itself (ZeRO-3)
gathers the parameters its `materialized` is handed (`export_parameters(names)`).
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from . import dist as gdist
from .hf import load_causal_lm, tied_aliases, write_hf_folder
from .lora import LoraWeights, add_lora, hf_name
from .micro_batch import even_out, micro_batch_rows, select_micro_batches, sum_metrics
from .offload import HostStash
from .options import option
from .policy import ValueHeadModel, position_ids
from .prompt_sharing import PromptSharing
from .reshard import export_weights
from .shared_prefix import Layout
from .sharding import Sharding, adam_state_sizes, refuse_moved_hooks
from .tags import TRAIN_TAGS, check_tags
from .train import LossFn, PolicyOutput, TrainArgs, TrainBatch, TrainEngine
from .weights import Adapter, ParamSpec, WeightSpec


class ModuleTrainEngine(TrainEngine):
    """AdamW over a Hugging Face causal LM held as a torch module, laid over the mesh by its `Sharding`."""

    #: what a step too large for the device can change in this engine's own options (`memory.MemoryPlanError`)
    memory_hints: tuple[str, ...] = ()

    @dataclass(frozen=True)
    class Options:
        device: str | None = option(None, "device to train on (None: this rank's GPU if there is one, else the CPU)")
        betas: tuple[float, float] = option((0.9, 0.999), "AdamW betas")
        gradient_checkpointing: bool = option(False, "recompute activations during backward to save memory")
        lora_r: int = option(0, "LoRA rank through peft (0: no LoRA, every weight trains)")
        lora_alpha: int = option(16, "LoRA alpha: the adapter is scaled by alpha / r")
        lora_dropout: float = option(0.0, "dropout on the adapters' input while training")
        lora_target_modules: tuple[str, ...] = option(("all-linear",), "layers that get an adapter: names or "
                                                                       "suffixes (q_proj, v_proj), or all-linear")
        keep_grads: bool = option(False, "keep the last step's gradients after the optimizer step (they are freed "
                                         "otherwise, leaving their memory to the rollout engine)")
        compile: bool = option(False, "torch.compile each decoder layer (gearshift.layers; the first step compiles)")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        refuse_moved_hooks(cls)

    def __init__(self, args: TrainArgs, options=None, sharding: Sharding | None = None) -> None:
        super().__init__(args, options)
        #: how the model lies over the mesh (default: one process, every weight whole)
        self.sharding = sharding = sharding if sharding is not None else Sharding()
        sharding.check(self.mesh)
        opts = self.options
        self.device = torch.device(opts.device) if opts.device else gdist.default_device()
        self.dtype = args.torch_dtype
        #: the dtype forward and backward compute in (a sharding may compute below its master dtype)
        self.compute_dtype = sharding.compute_dtype or self.dtype
        if not sharding.lends_weights:
            self.can_lend_weights = False
        torch.manual_seed(args.seed)
        self.hf_model = load_causal_lm(args.model, self.dtype, dropout=args.dropout)
        self.hf_model.config.use_cache = False
        if opts.lora_r:
            add_lora(self.hf_model, r=opts.lora_r, alpha=opts.lora_alpha, dropout=opts.lora_dropout,
                     target_modules=opts.lora_target_modules)
        if opts.gradient_checkpointing:
            self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module = ValueHeadModel(self.hf_model) if args.value_head else self.hf_model
        aliases = tied_aliases(module)
        #: with LoRA, the base weights under Hugging Face names, read merged with their adapters
        self.lora = LoraWeights(module, hf_prefix="lm." if args.value_head else "") if opts.lora_r else None
        self.model = sharding.parallelize(module, self.hf_model, self.device)
        if opts.compile:  # after parallelize: hooks around a layer (FSDP's) stay outside the compiled code
            sharding.compile(self.model, self.mesh)
        #: the parameters that train, under Hugging Face names; the frozen ones (LoRA's base)
        self.trained = dict(sharding.trained_parameters(self.model))
        self.frozen = [p for p in self.model.parameters() if not p.requires_grad]
        self.optimizer = sharding.optimizer(list(self.trained.values()), args.lr, args.weight_decay, opts.betas)
        exported = self.trained
        if self.lora is not None:
            self.lora.bind()
            exported = self.lora.base_parameters()
            aliases = {hf_name(a): hf_name(t) for a, t in aliases.items()}
        self._spec = WeightSpec(self.mesh, tuple(
            ParamSpec(n, sharding.full_shape(n, p), p.dtype, sharding.placement(n, p, self.mesh))
            for n, p in exported.items()
        ), {a: t for a, t in aliases.items() if t in exported})
        self._stashes = {tag: HostStash() for tag in TRAIN_TAGS}  # kept: their host buffers are reused
        self._local_views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (storage owner, its view)
        #: a prompt computed once for all its rows (`train.share_prompts`)
        self.prompt_sharing = PromptSharing(args.share_prompts, self.hf_model.config, sharding,
                                            value_head=args.value_head, compute_dtype=self.compute_dtype,
                                            mesh=self.mesh)

    def state_tensors(self, tag: str) -> list[torch.Tensor]:
        """This rank's tensors behind an offload tag (params, grads, optimizer)."""
        local = self.sharding.local
        with torch.no_grad():
            if tag == "params":
                return [local(p) for p in (*self.trained.values(), *self.frozen)]
            if tag == "grads":
                return [local(p.grad) for p in self.trained.values() if p.grad is not None]
            return [local(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]

    # --- interface ------------------------------------------------------------------------
    def weight_spec(self) -> WeightSpec:
        return self._spec

    @torch.no_grad()
    def local_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        self.need_onloaded(["params"], "export weights")
        if self.lora is not None:  # each adapter merged into this rank's slice of its weight
            base, rank = self.lora.base_parameters(), gdist.rank()
            specs = self._spec.by_name()
            return {n: self.lora.merged(n, self.sharding.local(base[n]),
                                        specs[n].placement.local_box(specs[n].shape, rank)) for n in names}
        if not self.can_lend_weights:  # gathered per export (ZeRO-3): a view kept would keep the gathered storage
            return {n: self.sharding.local(self.trained[n]).detach() for n in names}
        # every sync reads every weight: each one's view is made once and kept while it still is the parameter's
        # storage (the check is an identity and a pointer, no dispatch through a DTensor per weight)
        cache, params, out, local = self._local_views, self.trained, {}, self.sharding.local
        for n in names:
            p = params[n]
            inner = getattr(p, "_local_tensor", p)  # a DTensor's shard, or the parameter itself
            hit = cache.get(n)
            if hit is None or hit[0] is not inner or hit[1].data_ptr() != inner.data_ptr():
                hit = cache[n] = (inner, local(p).detach())
            out[n] = hit[1]
        return out

    @property
    def lora_rank(self) -> int:
        return self.options.lora_r

    def export_adapter(self) -> Adapter | None:
        if self.lora is None:
            return None
        self.need_onloaded(["params"], "export the adapter")
        return self.lora.adapter(self.hf_model, self.args.model)

    @contextmanager
    def materialized(self, names: list[str]) -> Iterator[None]:
        """What the sharding gathers for an export of `names` and, with LoRA, the adapters of `names` gathered
        whole (they are small), while the bucket is read."""
        self.need_onloaded(["params"], "export weights")
        with self.sharding.materialized(self.export_parameters(names)), \
                (self.lora.gathered(names) if self.lora is not None else nullcontext()):
            yield

    def export_parameters(self, names: list[str]) -> list[torch.Tensor]:
        """The parameters an export of `names` reads (with LoRA: their bases and adapters)."""
        return self.lora.parameters_read(names) if self.lora is not None else [self.trained[n] for n in names]

    def shares_prompts(self) -> bool:
        """Whether micro-batches run their rows packed by prompt now (`prompt_sharing`: gearshift.prompt_sharing)."""
        return self.prompt_sharing.on(self.device)

    def _forward(self, batch: TrainBatch, with_entropy: bool,
                 layout: Layout | None = None) -> PolicyOutput:
        if layout is None:
            return self.sharding.forward(self.model, batch.to(self.device), with_entropy, self.args.value_head)
        return self.sharding.forward(self.model, batch.to(self.device), with_entropy, self.args.value_head,
                                     layout=layout, mask_kind=self.prompt_sharing.mask_kind)

    def _layout(self, batch: TrainBatch) -> Layout | None:
        return self.prompt_sharing.layout(batch, self.model, self.device) if self.shares_prompts() else None

    def micro_batches(self, batch: TrainBatch,
                      training: bool = True) -> list[tuple[TrainBatch, torch.Tensor | None]]:
        """The micro-batches of `batch` with the rows each holds (None: a filler; see gearshift.micro_batch).

        Consecutive runs of `micro_batch_size` rows, or, with `max_tokens_per_micro_batch`, rows packed
        by length and each micro-batch trimmed to its longest row. On a GPU with neither set, rows are
        packed under the token budget that fits in free device memory (`token_budget`). With shared
        prompts (`shares_prompts`) the budget counts packed sequences, a prompt's rows kept together
        (`shared_prefix.packed_micro_batches`). A sharded model
        runs collectives in every forward and backward, so every rank of the mesh runs as many
        micro-batches as the rank with the most.
        """
        budget = self.args.max_tokens_per_micro_batch or self.token_budget(batch, training)
        if self.shares_prompts() and self.prompt_sharing.pays(batch, budget):  # a prompt's rows kept together
            groups = self.prompt_sharing.micro_batches(batch, budget, self.args.micro_batch_size)
        else:
            groups = micro_batch_rows(batch, max_rows=self.args.micro_batch_size, max_tokens=budget)
        count = len(groups)
        if self.mesh.world_size > 1 and gdist.is_distributed():
            most = torch.tensor([count], device=gdist.collective_device())
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            count = int(most.item())
        return select_micro_batches(batch, even_out(groups, count), trim=bool(budget))

    def token_budget(self, batch: TrainBatch, training: bool = True) -> int | None:
        """Tokens per micro-batch when no micro-batching was asked for: on a GPU, what fits in the device
        memory free now (`memory.gpu_token_budget`, which raises `MemoryPlanError` naming what to change when
        a step cannot fit); on a CPU, `memory.CPU_TOKENS_PER_MICRO_BATCH` (None with `micro_batch_size`)."""
        if self.args.micro_batch_size:
            return None
        from . import memory

        if self.device.type != "cuda":  # rows packed by length: less padding computed (memory.py says why)
            return memory.CPU_TOKENS_PER_MICRO_BATCH
        budget = memory.engine_token_budget(self, int(batch.lengths.max()), training=training)
        if training:  # more free memory would have made fewer, larger micro-batches
            self.memory_bound = budget < min(memory.MAX_AUTO_TOKENS, int(batch.lengths.sum()))
        return budget

    def step_bytes(self) -> tuple[int, int]:
        """Device bytes a train step allocates beyond its activations and the state held now: the gradients
        (beside the activations), and the update (after them: the gradients, Adam's moments before the first
        step makes them, one temporary the size of the trained weights: foreach AdamW's, counted for fused)."""
        trained = 0
        for p in self.trained.values():
            local = self.sharding.local(p)
            if local.device.type != "cpu":
                trained += local.numel() * local.element_size()
        moments = 0 if getattr(self.optimizer, "state", None) else 2 * trained
        return trained, trained + moments + trained

    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> PolicyOutput:
        self.need_onloaded(["params"], "run forward")
        self.model.eval()
        try:
            parts = [(self._forward(mb, with_entropy, self._layout(mb)), rows)
                     for mb, rows in self.micro_batches(batch, training=False)]
        finally:
            self.sharding.release(self.model)  # no backward comes to free what the forward gathered

        def gather(name: str):
            if getattr(parts[0][0], name) is None:
                return None
            first = getattr(parts[0][0], name)
            full = first.new_zeros(batch.size, batch.width)
            for out, rows in parts:
                if rows is not None:
                    part = getattr(out, name)
                    full[rows.to(full.device), :part.shape[1]] = part
            return full

        return PolicyOutput(gather("logprobs"), gather("entropy"), gather("values"))

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        self.need_onloaded(TRAIN_TAGS, "train")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        seen: list[tuple[str, Any, float, bool]] = []  # (key, value, weight, a real micro-batch)
        computed = real = 0  # positions computed, and the tokens among them
        micro_batches = self.micro_batches(batch)
        for mb, rows in micro_batches:
            # weighted by their share of the sequences: losses that divide by the whole batch's counts
            # (token_mean with tokens_per_seq) then add up to the whole batch's loss, whatever the sizes
            weight = 0.0 if rows is None else mb.size / batch.size
            layout = self._layout(mb)
            out = self._forward(mb, with_entropy=True, layout=layout)
            loss, metrics = loss_fn(out, mb.to(self.device))
            self.sharding.backward(loss * weight)
            if rows is not None:
                computed += layout.computed if layout else mb.size * mb.width
                real += layout.real if layout else int(mb.lengths.sum())
            seen += [(k, v, weight, rows is not None) for k, v in {"loss": loss.detach(), **metrics}.items()]
        totals = sum_metrics(seen)
        totals["grad_norm"] = self.sharding.clip_and_step(list(self.trained.values()), self.optimizer,
                                                         self.args.max_grad_norm)
        if not self.options.keep_grads:  # recomputed from zero at the next step: their memory is free till then
            self.optimizer.zero_grad(set_to_none=True)
        totals["lr"] = self.optimizer.param_groups[0]["lr"]
        totals["micro_batches"] = float(len(micro_batches))
        totals["pad_frac"] = 1.0 - real / max(computed, 1)  # share of the computed positions that are padding
        # share of the batch's tokens a shared prompt computed once for several rows
        totals["shared_frac"] = 1.0 - real / max(float(batch.lengths.sum()), 1.0)
        return gdist.average_metrics(totals)

    def offload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        """Copy the tagged state to host memory and free it on the device.

        State already in host memory (on a CPU) stays where it is and counts 0 bytes:
        nothing is copied for show.
        """
        tags = check_tags(tags, TRAIN_TAGS)
        if "params" in tags:
            self.sharding.release(self.model)
        moved = 0
        for tag in tags:
            if not len(self._stashes[tag]):
                moved += self._stashes[tag].offload(t for t in self.state_tensors(tag) if t.device.type != "cpu")
        return moved

    def onload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        return sum(self._stashes[tag].restore() for tag in check_tags(tags, TRAIN_TAGS))

    def offloaded(self) -> list[str]:
        """The tags whose state is in host memory now (`offload` moved it; `onload` brings it back)."""
        return [t for t in TRAIN_TAGS if len(self._stashes[t])]

    def _storage_sizes(self, tag: str) -> list[int]:
        """Bytes of each device storage behind `tag` now; before the first step, the optimizer's as AdamW will
        allocate them (`sharding.adam_state_sizes`: two moments per trained parameter, fused AdamW's steps)."""
        if tag == "optimizer" and not self.optimizer.state and self.device.type != "cpu":
            trained = [self.sharding.local(p) for group in self.optimizer.param_groups for p in group["params"]]
            return adam_state_sizes(trained, fused=bool(getattr(self.optimizer, "defaults", {}).get("fused")))
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self.state_tensors(tag) if t.device.type != "cpu"}
        return list(storages.values())

    def state_bytes(self) -> dict[str, int]:
        """Device bytes each tag holds now (0 in host memory; before the first step, AdamW's moments to come)."""
        return {tag: sum(self._storage_sizes(tag)) for tag in TRAIN_TAGS}

    def reserve_host(self, tags: Sequence[str]) -> int:
        """Allocate (and pin) the host buffers `offload(tags)` will use, now, so the first switch copies at the
        speed of every later one; returns the host bytes held."""
        for tag in check_tags(tags, TRAIN_TAGS):
            self._stashes[tag].reserve(HostStash.room_for(self._storage_sizes(tag)))
        return sum(self._stashes[t].host_bytes for t in TRAIN_TAGS)

    def save(self, path: str) -> None:
        if gdist.world_size() > 1:
            raise NotImplementedError(f"{type(self).__name__} writes one-process checkpoints; a sharding "
                                      f"backend writes its own")
        self.need_onloaded(TRAIN_TAGS, "save a checkpoint")
        Path(path).mkdir(parents=True, exist_ok=True)
        model_state = self.model.state_dict()
        if self.lora is not None:  # the frozen base is the model it was built from: the adapters are the state
            trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
            model_state = {k: v for k, v in model_state.items() if k in trained}
        torch.save({"model": model_state, "optimizer": self.optimizer.state_dict()},
                   os.path.join(path, "train_state.pt"))

    def load(self, path: str) -> None:
        self.need_onloaded(TRAIN_TAGS, "load a checkpoint")
        state = torch.load(os.path.join(path, "train_state.pt"), map_location=self.device, weights_only=True)
        if self.lora is not None:
            missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
            trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
            if unexpected or trained & set(missing):
                raise RuntimeError(f"{path} does not hold this engine's LoRA adapters: missing "
                                   f"{sorted(trained & set(missing))[:3]}, unexpected {sorted(unexpected)[:3]} "
                                   f"(same lora_r and lora_target_modules?)")
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def save_hf(self, path: str) -> None:
        """Gather the full weights bucket by bucket through `export_weights`; rank 0 writes the folder.

        With LoRA the folder holds the merged weights, and `path/adapter` the adapter alone in peft's
        format (`PeftModel.from_pretrained(base, path/adapter)`, or vLLM's LoRA requests).
        """
        rank = gdist.rank()
        state: dict[str, torch.Tensor] = {}
        for bucket in export_weights(self):
            if rank == 0:
                state.update((k, v.detach().to("cpu", copy=True)) for k, v in bucket.items())
        adapter = self.export_adapter()  # every rank: it may gather
        if rank == 0:
            write_hf_folder(path, self.hf_model, state, self.args.model, value_head=self.args.value_head)
            if adapter is not None:
                adapter.write(os.path.join(path, "adapter"))
        del state
        gdist.barrier()

    def close(self) -> None:
        for stash in self._stashes.values():
            stash.close()
        self._local_views.clear()
        self.trained.clear()
        self.frozen, self.lora, self.optimizer = [], None, None
        self.model = self.hf_model = None

    def need_onloaded(self, tags: Sequence[str], action: str) -> None:
        """Raise a clear error, naming `action`, if any of `tags` is offloaded."""
        away = [t for t in tags if t in self.offloaded()]
        if away:
            raise RuntimeError(f"cannot {action}: {away} are offloaded to host memory; call onload({away}) first")


__all__ = ["ModuleTrainEngine", "Sharding", "ValueHeadModel", "position_ids", "write_hf_folder"]
