"""`ModuleTrainEngine`: the part of a trainer every backend built on a torch `nn.Module` would write again.

It loads any `AutoModelForCausalLM` from a local folder (dropout off unless
asked, a value head for a critic), runs micro-batched AdamW steps with global
gradient clipping, computes log-probabilities, describes its weights, offloads
state to host memory and back bit-exactly, checkpoints, and writes a Hugging
Face folder through its own export. A sharding backend overrides hooks only:

- `_check_mesh()`: refuse meshes it cannot run.
- `_parallelize(model) -> module`: wrap or shard the model (default: move it to `device`).
- `_placement(name, param) -> Placement`: where `param` lies on the mesh (default: replicated).
- `_local(tensor) -> tensor`: this rank's shard of a parameter, gradient or state tensor (default: itself).
- `_full_shape(name, param) -> shape`: the whole weight's shape (default: the parameter's).
- `_named_parameters()`: the trainable parameters under Hugging Face names (default: the module's).
- `_build_optimizer() -> Optimizer`, `_backward(loss)`, `_clip_and_step() -> grad norm`.
- `_state_tensors(tag)`: the local tensors behind an offload tag.
- `save(path)` / `load(path)`: a resumable checkpoint (default: one file; needs one process).

LoRA (`lora_r > 0`, through peft; see gearshift.lora) comes with the base: only the
adapters train and hold optimizer state, the weight spec lists the base weights under
their Hugging Face names and an export merges each adapter into its weight, so any
rollout engine takes them unchanged. A subclass gets it through the hooks above; one that
gathers weights itself (ZeRO-3) gathers `_export_parameters(names)`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from . import dist as gdist
from .hf import load_causal_lm, tied_aliases
from .lora import LoraWeights, add_lora, hf_name
from .mesh import Placement
from .offload import HostStash
from .options import option
from .reshard import export_weights
from .tags import TRAIN_TAGS, check_tags
from .train import LossFn, PolicyOutput, TrainArgs, TrainBatch, TrainEngine, token_logprobs
from .weights import Adapter, ParamSpec, WeightSpec


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count only real tokens, so left and right padding give the same logits."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class ValueHeadModel(nn.Module):
    """The causal LM's decoder, then a linear map of each position's last hidden state to a value (PPO's critic)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.hidden_size, 1, dtype=next(lm.parameters()).dtype)
        nn.init.zeros_(self.value_head.weight)  # start from value 0 everywhere: no bias in early advantages
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, **kw) -> torch.Tensor:
        hidden = self.lm.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
        ).last_hidden_state
        return self.value_head(hidden)[..., 0].float().clone()  # not a view: FSDP hooks need a tensor of its own


class ModuleTrainEngine(TrainEngine):
    """AdamW over a Hugging Face causal LM held as a torch module; subclasses shard it through the hooks."""

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

    def __init__(self, args: TrainArgs, options=None) -> None:
        super().__init__(args, options)
        self._check_mesh()
        opts = self.options
        self.device = torch.device(opts.device) if opts.device else gdist.default_device()
        self.dtype = args.torch_dtype
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
        self.model = self._parallelize(module)
        self.optimizer = self._build_optimizer()
        self._params = dict(self._named_parameters())
        self._frozen = [p for p in self.model.parameters() if not p.requires_grad]
        exported = self._params
        if self.lora is not None:
            self.lora.bind()
            exported = self.lora.base_parameters()
            aliases = {hf_name(a): hf_name(t) for a, t in aliases.items()}
        self._spec = WeightSpec(self.mesh, tuple(
            ParamSpec(n, self._full_shape(n, p), p.dtype, self._placement(n, p)) for n, p in exported.items()
        ), {a: t for a, t in aliases.items() if t in exported})
        self._stashes = {tag: HostStash() for tag in TRAIN_TAGS}  # kept: their host buffers are reused
        self._local_views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (storage owner, its view)
        #: the dtype forward and backward compute in (a sharding backend may compute below its master dtype)
        self.compute_dtype = getattr(self, "compute_dtype", None) or self.dtype

    # --- hooks ----------------------------------------------------------------------------
    def _check_mesh(self) -> None:
        if self.mesh.world_size != 1:
            raise ValueError(f"{type(self).__name__} runs in one process; for mesh {self.mesh} use a sharding "
                             f"backend such as 'fsdp'")

    def _parallelize(self, model: nn.Module) -> nn.Module:
        return model.to(self.device)

    def _placement(self, name: str, param: torch.Tensor) -> Placement:
        return Placement.replicated(self.mesh)

    def _local(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def _full_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        """The whole weight's shape (a DTensor's is; ZeRO-3 keeps it beside an empty local tensor)."""
        return tuple(param.shape)

    def _named_parameters(self):
        return ((n, p) for n, p in self.model.named_parameters() if p.requires_grad)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.args.lr,
                                 weight_decay=self.args.weight_decay, betas=tuple(self.options.betas))

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _clip_and_step(self) -> float:
        """Clip to `max_grad_norm` over every shard, step; returns the norm before clipping."""
        params = [p for p in self._params.values() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if hasattr(norm, "full_tensor"):  # a DTensor: the norm of this rank's shards, reduced here
            norm = norm.full_tensor()
        if self.args.max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, self.args.max_grad_norm, norm, foreach=True)
        self.optimizer.step()
        return float(norm)

    def _state_tensors(self, tag: str) -> list[torch.Tensor]:
        with torch.no_grad():
            if tag == "params":
                return [self._local(p) for p in (*self._params.values(), *self._frozen)]
            if tag == "grads":
                return [self._local(p.grad) for p in self._params.values() if p.grad is not None]
            return [self._local(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]

    # --- interface ------------------------------------------------------------------------
    def weight_spec(self) -> WeightSpec:
        return self._spec

    @torch.no_grad()
    def local_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        self._need_onloaded(["params"], "export weights")
        if self.lora is not None:  # each adapter merged into this rank's slice of its weight
            base, rank = self.lora.base_parameters(), gdist.rank()
            specs = self._spec.by_name()
            return {n: self.lora.merged(n, self._local(base[n]), specs[n].placement.local_box(specs[n].shape, rank))
                    for n in names}
        if not self.can_lend_weights:  # gathered per export (ZeRO-3): a view kept would keep the gathered storage
            return {n: self._local(self._params[n]).detach() for n in names}
        # every sync reads every weight: each one's view is made once and kept while it still is the parameter's
        # storage (the check is an identity and a pointer, no dispatch through a DTensor per weight)
        cache, params, out = self._local_views, self._params, {}
        for n in names:
            p = params[n]
            inner = getattr(p, "_local_tensor", p)  # a DTensor's shard, or the parameter itself
            hit = cache.get(n)
            if hit is None or hit[0] is not inner or hit[1].data_ptr() != inner.data_ptr():
                hit = cache[n] = (inner, self._local(p).detach())
            out[n] = hit[1]
        return out

    @property
    def lora_rank(self) -> int:
        return self.options.lora_r

    def export_adapter(self) -> Adapter | None:
        if self.lora is None:
            return None
        self._need_onloaded(["params"], "export the adapter")
        return self.lora.adapter(self.hf_model, self.args.model)

    def materialized(self, names: list[str]):
        """With LoRA, the adapters of `names` gathered whole (they are small) while the bucket is read."""
        return self.lora.gathered(names) if self.lora is not None else super().materialized(names)

    def _export_parameters(self, names: list[str]) -> list[torch.Tensor]:
        """The parameters an export of `names` reads (with LoRA: their bases and adapters)."""
        return self.lora.parameters_read(names) if self.lora is not None else [self._params[n] for n in names]

    def _forward(self, batch: TrainBatch, with_entropy: bool) -> PolicyOutput:
        batch = batch.to(self.device)
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                         position_ids=position_ids(batch.attention_mask), use_cache=False)
        if self.args.value_head:  # a critic: values instead of log-probabilities
            # aligned like logprobs: values[:, t] is the value of the state token t is chosen in, i.e. of the
            # prefix before it; the head's output at t has already seen token t, so it moves one to the right
            values = torch.cat([out.new_zeros(out.shape[0], 1), out[:, :-1]], dim=1)
            return PolicyOutput(torch.zeros_like(values), values=values)
        return token_logprobs(out.logits, batch.input_ids, with_entropy)

    def _micro_batches(self, batch: TrainBatch, training: bool = True) -> list[tuple[TrainBatch, torch.Tensor | None]]:
        """The micro-batches of `batch` with the rows each holds (None: a filler, see below).

        Consecutive runs of `micro_batch_size` rows, or, with `max_tokens_per_micro_batch`, rows packed
        by length and each micro-batch trimmed to its longest row. On a GPU with neither set, rows are
        packed under the token budget that fits in free device memory (`token_budget`). A sharded model
        runs collectives in every forward and backward, so every rank of the mesh runs as many
        micro-batches as the rank with the most: a rank with fewer splits its largest ones, and one with
        fewer rows than that count adds fillers (a forward and backward of one row that count for nothing).
        """
        args = self.args
        budget = args.max_tokens_per_micro_batch or self.token_budget(batch, training)
        if budget:
            groups = batch.packed_rows(budget, args.micro_batch_size)
        else:
            size = args.micro_batch_size or batch.size
            groups = [torch.arange(start, min(start + size, batch.size)) for start in range(0, batch.size, size)]
        groups = self._as_many_on_every_rank(groups)
        out: list[tuple[TrainBatch, torch.Tensor | None]] = []
        for rows in groups:
            if rows is None:
                out.append((batch.select(slice(0, 1)), None))
            elif budget:
                out.append((batch.select(rows).trimmed(), rows))
            else:  # a contiguous slice, as wide as the batch
                out.append((batch.select(slice(int(rows[0]), int(rows[-1]) + 1)), rows))
        return out

    def _as_many_on_every_rank(self, groups: list[torch.Tensor]) -> list[torch.Tensor | None]:
        if self.mesh.world_size == 1 or not gdist.is_distributed():
            return list(groups)
        import torch.distributed as dist

        count = torch.tensor([len(groups)], device=gdist.collective_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        target, groups = int(count.item()), list(groups)
        while len(groups) < target:
            largest = max(range(len(groups)), key=lambda i: len(groups[i]))
            rows = groups[largest]
            if len(rows) < 2:
                break
            half = (len(rows) + 1) // 2
            groups[largest:largest + 1] = [rows[:half], rows[half:]]
        return groups + [None] * (target - len(groups))

    def token_budget(self, batch: TrainBatch, training: bool = True) -> int | None:
        """Tokens per micro-batch that fit in the device memory free now, when no micro-batching was asked
        for and the engine runs on a GPU (None otherwise: the whole batch at once).

        Free memory (torch's cached blocks included: training allocates through torch) less the gradients
        the backward allocates beside the activations and a margin, over `memory.activation_bytes_per_token`.
        A step whose longest row, or whose optimizer update, does not fit raises `MemoryPlanError` naming
        what to change.
        """
        if self.device.type != "cuda" or self.args.micro_batch_size:
            return None
        from .memory import GiB, MAX_AUTO_TOKENS, MemoryPlanError, activation_bytes_per_token, device_free, release_cached

        per_token = activation_bytes_per_token(
            self.hf_model.config, training=training, checkpointing=self.options.gradient_checkpointing,
            compute_itemsize=self.compute_dtype.itemsize)
        total = torch.cuda.get_device_properties(self.device).total_memory
        margin = max(int(0.04 * total), GiB)
        # torch's cached blocks are in pieces that a micro-batch's logits (GiBs in one tensor) may not fit:
        # count what the driver has free once they went back
        release_cached(self.device)
        free = device_free(self.device, cached=False)
        grads, update = self.step_bytes() if training else (0, 0)
        longest = int(batch.lengths.max())
        tokens = (free - grads - margin) // per_token
        if tokens < longest or free < update + margin:
            what = (f"rows of {longest} tokens need about {(longest * per_token + grads) / GiB:.1f} GiB"
                    if tokens < longest else f"the optimizer's update needs {update / GiB:.1f} GiB")
            raise MemoryPlanError(
                f"a {'train step' if training else 'forward'} does not fit: {what} beyond the state held, and "
                f"{free / GiB:.1f} GiB of device memory are free. Set train.options.gradient_checkpointing=true, "
                f"shorten the rows (rollout.max_tokens, data.max_prompt_len), give the rollout engine less memory "
                f"(rollout.options: gpu_memory_utilization for vllm, mem_fraction_static for sglang), train in "
                f"bfloat16 (model.dtype=bfloat16), or move the optimizer off the device during rollout "
                f"(switch.offload=optimizer,grads)")
        return int(min(tokens, MAX_AUTO_TOKENS))

    def step_bytes(self) -> tuple[int, int]:
        """Device bytes a train step allocates beyond its activations and the state held now: the gradients
        (beside the activations), and the optimizer's update (after them: the gradients, Adam's moments
        before the first step creates them, and one temporary the size of the trained weights)."""
        trained = 0
        for p in self._params.values():
            local = self._local(p)
            if local.device.type != "cpu":
                trained += local.numel() * local.element_size()
        moments = 0 if getattr(self.optimizer, "state", None) else 2 * trained
        return trained, trained + moments + trained

    @torch.no_grad()
    def forward_logprobs(self, batch: TrainBatch, with_entropy: bool = False) -> PolicyOutput:
        self._need_onloaded(["params"], "run forward")
        self.model.eval()
        parts = [(self._forward(mb, with_entropy), rows) for mb, rows in self._micro_batches(batch, training=False)]

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
        self._need_onloaded(TRAIN_TAGS, "train")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        computed = 0
        micro_batches = self._micro_batches(batch)
        for mb, rows in micro_batches:
            # weighted by their share of the sequences: losses that divide by the whole batch's counts
            # (token_mean with tokens_per_seq) then add up to the whole batch's loss, whatever the sizes
            weight = 0.0 if rows is None else mb.size / batch.size
            out = self._forward(mb, with_entropy=True)
            loss, metrics = loss_fn(out, mb.to(self.device))
            self._backward(loss * weight)
            computed += 0 if rows is None else mb.size * mb.width
            for k, v in {"loss": float(loss.detach()), **metrics}.items():  # a filler adds its keys, at 0
                if k.endswith("_max"):  # an extreme over the micro-batches, not a weighted sum
                    totals[k] = max(totals.get(k, float("-inf")), float(v) if rows is not None else float("-inf"))
                else:
                    totals[k] = totals.get(k, 0.0) + float(v) * weight
        totals = {k: (0.0 if v == float("-inf") else v) for k, v in totals.items()}  # a rank of fillers only
        totals["grad_norm"] = self._clip_and_step()
        if not self.options.keep_grads:  # recomputed from zero at the next step: their memory is free till then
            self.optimizer.zero_grad(set_to_none=True)
        totals["lr"] = self.optimizer.param_groups[0]["lr"]
        totals["micro_batches"] = float(len(micro_batches))
        totals["pad_frac"] = 1.0 - float(batch.lengths.sum()) / max(computed, 1)  # share of computed tokens
        return gdist.average_metrics(totals)

    def offload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        """Copy the tagged state to host memory and free it on the device.

        State already in host memory (on a CPU) stays where it is and counts 0 bytes:
        nothing is copied for show.
        """
        moved = 0
        for tag in check_tags(tags, TRAIN_TAGS):
            if not len(self._stashes[tag]):
                moved += self._stashes[tag].offload(t for t in self._state_tensors(tag) if t.device.type != "cpu")
        return moved

    def onload(self, tags: Sequence[str] = TRAIN_TAGS) -> int:
        return sum(self._stashes[tag].restore() for tag in check_tags(tags, TRAIN_TAGS))

    def _storage_sizes(self, tag: str) -> list[int]:
        """Bytes of each device storage behind `tag` now; before the first step, the optimizer's as AdamW will
        allocate them (two moments per trained parameter, each a storage of its own)."""
        if tag == "optimizer" and not self.optimizer.state and self.device.type != "cpu":
            trained = [self._local(p) for group in self.optimizer.param_groups for p in group["params"]]
            return [t.numel() * t.element_size() for t in trained for _ in range(2)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self._state_tensors(tag) if t.device.type != "cpu"}
        return list(storages.values())

    def state_bytes(self) -> dict[str, int]:
        """Device bytes each tag holds now (state in host memory counts 0); before the first step, the
        optimizer's as AdamW will hold it: two moments per trained parameter."""
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
        self._need_onloaded(TRAIN_TAGS, "save a checkpoint")
        Path(path).mkdir(parents=True, exist_ok=True)
        model_state = self.model.state_dict()
        if self.lora is not None:  # the frozen base is the model it was built from: the adapters are the state
            trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
            model_state = {k: v for k, v in model_state.items() if k in trained}
        torch.save({"model": model_state, "optimizer": self.optimizer.state_dict()},
                   os.path.join(path, "train_state.pt"))

    def load(self, path: str) -> None:
        self._need_onloaded(TRAIN_TAGS, "load a checkpoint")
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
        self._params.clear()
        self._frozen = []
        self.lora = None
        self.optimizer = None
        self.model = self.hf_model = None

    def _need_onloaded(self, tags: Sequence[str], action: str) -> None:
        away = [t for t in tags if len(self._stashes[t])]
        if away:
            raise RuntimeError(f"cannot {action}: {away} are offloaded to host memory; call onload({away}) first")


def write_hf_folder(path: str, hf_model: nn.Module, state: dict[str, torch.Tensor], source: str,
                    value_head: bool = False) -> None:
    """Write `state` as a Hugging Face folder of `hf_model`'s class and config, with `source`'s tokenizer;
    a critic's value head goes beside it in value_head.safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if value_head:
        lm = {k[len("lm."):]: v.contiguous() for k, v in state.items() if k.startswith("lm.")}
        head = {k[len("value_head."):]: v.contiguous() for k, v in state.items() if k.startswith("value_head.")}
        hf_model.save_pretrained(path, state_dict=lm)
        save_file(head, os.path.join(path, "value_head.safetensors"))
    else:
        hf_model.save_pretrained(path, state_dict=state)
    try:
        AutoTokenizer.from_pretrained(source).save_pretrained(path)
    except (OSError, ValueError) as err:
        warnings.warn(f"save_hf: no tokenizer copied from {source}: {err}", stacklevel=2)
