"""Rollout backend `hf`: Hugging Face `generate` with a KV cache, a replica per dp rank.

The reference every other rollout backend is compared with; slow, but it runs
wherever transformers does. With `mesh` tp > 1 each replica is cut over its tp
ranks by the model's own tensor-parallel plan (`gearshift.tensor_parallel`,
DTensor: gloo on a CPU, NCCL on GPUs): each rank keeps, and its weight spec
lists, only its slice of the column- and row-parallel weights, and the ranks of
a tp group generate together (the same prompts, the same seed: the group's
first rank's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

import torch

from .. import dist as gdist
from ..hf import load_causal_lm, tied_aliases
from ..options import option
from ..rollout import Rollout, RolloutArgs, RolloutEngine, RolloutError, SamplingParams, text_before_stop
from ..tensor_parallel import local_tensor, parallelize_tensor, tp_placement
from ..weights import ParamSpec, WeightBucket, WeightError, WeightSpec, copy_weights_


class HFRolloutEngine(RolloutEngine):
    """Batched sampling with per-token logprobs; weights updated in place, or borrowed from the trainer."""

    contract = 2
    can_share_weights = True
    casts_on_load = True  # `copy_` casts: a float32 trainer's tensors need no bf16 copy on the way

    @dataclass(frozen=True)
    class Options:
        device: str | None = option(None, "device to generate on (None: this rank's GPU if there is one, else the CPU)")
        max_batch_size: int = option(64, "prompts generated together in one call of transformers' generate")

    def __init__(self, args: RolloutArgs, options: "HFRolloutEngine.Options | None" = None) -> None:
        from transformers import AutoTokenizer

        super().__init__(args, options)
        if self.mesh.dp * self.mesh.tp != self.mesh.world_size:
            raise ValueError(f"the hf rollout backend runs replicas (dp) cut by tensor parallelism (tp), but mesh "
                             f"{self.mesh} has pp or sp > 1: use mesh dp={self.mesh.world_size} or tp=...,dp=...")
        self.device = torch.device(self.options.device) if self.options.device else gdist.default_device()
        self.model = load_causal_lm(args.model, args.torch_dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.max_model_len = int(args.max_model_len or self.model.config.max_position_embeddings)
        self.max_batch_size = self.options.max_batch_size
        aliases = tied_aliases(self.model)
        self._tp_group = self._parallelize() if self.mesh.tp > 1 else None
        self._params = dict(self.model.named_parameters())
        #: this rank's part of each weight (the weight itself without tensor parallelism): what a sync writes
        self._local = {n: local_tensor(p) for n, p in self._params.items()}
        for p in self._params.values():
            p.requires_grad_(False)
        self._spec = WeightSpec(self.mesh, tuple(
            ParamSpec(n, tuple(p.shape), p.dtype, tp_placement(p, self.mesh)) for n, p in self._params.items()
        ), aliases)
        self._borrowed: set[str] = set()  # weights whose storage is the caller's (share_weights)
        self._pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        with self._generators():  # the engine's own generators, seeded by args.seed: unseeded sampling draws here
            torch.manual_seed(args.seed)
        self._own_rng = self._rng_state()

    def _generators(self):
        """Fork the host's generators (CPU, and this engine's GPU): what happens inside leaves them as they were."""
        return torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else [])

    @contextlib.contextmanager
    def _own_generators(self):
        """Inside, torch draws from the engine's own generators, which move on; the host's are put back after."""
        with self._generators():
            self._set_rng_state(self._own_rng)
            yield
            self._own_rng = self._rng_state()

    def _rng_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.random.get_rng_state(), cuda

    def _set_rng_state(self, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        torch.random.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], self.device)

    def _parallelize(self):
        """Cut the model over this rank's tp group; returns the group. The engine then copies in place only."""
        from torch.distributed.device_mesh import init_device_mesh

        gdist.ensure_process_group(self.device)
        mesh = init_device_mesh(self.device.type, (self.mesh.dp, self.mesh.tp), mesh_dim_names=("dp", "tp"))
        parallelize_tensor(self.model, self.model, mesh["tp"])
        self.can_share_weights = False  # a slice is served from DTensors the engine made: it copies into them
        return mesh["tp"].get_group()

    def _in_step(self, prompts: list[list[int]], sampling: SamplingParams) -> SamplingParams:
        """The seed every rank of the tp group samples with (its first rank's); the prompts must be the same."""
        import torch.distributed as dist

        seed = sampling.seed
        if seed is None:
            with self._own_generators():
                seed = int(torch.randint(2**62, ()))
        mine = [seed, prompts, sampling]
        box = list(mine)
        dist.broadcast_object_list(box, group=self._tp_group, group_src=0)
        if box[1:] != mine[1:]:
            raise RolloutError("the ranks of a tensor-parallel group must generate for the same prompts with the "
                               "same sampling parameters: give every rank of the group the same request")
        return replace(sampling, seed=box[0])

    # --- generation -----------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[Rollout]:
        self.check_prompts(prompts, sampling, self.model.config.vocab_size)
        if self._tp_group is not None:
            sampling = self._in_step([list(map(int, p)) for p in prompts], sampling)
        out: list[Rollout] = []
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = [list(map(int, p)) for p in prompts[start:start + self.max_batch_size]]
            out.extend(self._generate(chunk, sampling, start))
        return out

    @torch.no_grad()
    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, offset: int) -> list[Rollout]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every row ends where generation starts
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        eos = [self.tokenizer.eos_token_id, *sampling.stop_token_ids]
        ids, mask = ids.to(self.device), mask.to(self.device)
        kwargs = dict(
            input_ids=ids, attention_mask=mask,
            max_new_tokens=min(sampling.max_tokens, self.max_model_len - width),
            num_return_sequences=sampling.n, eos_token_id=eos, pad_token_id=self._pad,
            output_logits=sampling.logprobs, return_dict_in_generate=True, use_cache=True,
        )
        if sampling.n > 1 and width > 1:
            kwargs.update(self._shared_prefill(ids, mask, sampling.n))
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        else:
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k or None)
        if sampling.stop:
            kwargs.update(stop_strings=list(sampling.stop), tokenizer=self.tokenizer)
        # the host's generators are left as they were: a seeded call repeats exactly, an unseeded one draws
        # from the engine's own generators, which move on
        with self._own_generators() if sampling.seed is None else self._generators():
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            result = self.model.generate(**kwargs)
        new = result.sequences[:, width:].cpu()
        picked = None
        if sampling.logprobs:  # else every step's logits were not even kept
            logp = torch.log_softmax(torch.stack(result.logits, dim=1).float(), dim=-1).cpu()
            picked = logp.gather(-1, new[:, :, None]).squeeze(-1)
        rollouts = []
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            n, reason = self._finish(tokens, set(eos), sampling.stop)
            prompt_index = row // sampling.n
            rollouts.append(Rollout(
                prompts[prompt_index], tokens[:n], picked[row, :n].tolist() if picked is not None else [], reason,
                prompt_index=offset + prompt_index, sample_index=row % sampling.n,
                text=text_before_stop(self.tokenizer.decode(tokens[:n], skip_special_tokens=True), sampling.stop),
            ))
        return rollouts

    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, n: int) -> dict:
        """The KV cache of each prompt but its last token, computed once and repeated for its `n` samples.

        `generate` with `num_return_sequences=n` repeats every prompt n times before its first forward, so the
        prompt is computed n times over. Here the prompts go through the model once, the cache is repeated row
        by row, and `generate` starts from it: it runs only the last prompt token and the new ones, at the
        positions it would have given them (left padding counted out, as `generate` counts it)."""
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                         use_cache=True)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        return dict(input_ids=ids.repeat_interleave(n, dim=0), attention_mask=mask.repeat_interleave(n, dim=0),
                    past_key_values=cache, num_return_sequences=1)

    def _finish(self, tokens: list[int], eos: set[int], stop: tuple[str, ...]) -> tuple[int, str]:
        """Length and finish reason, found again from the tokens (finished rows are padded after)."""
        for i, t in enumerate(tokens):
            if t in eos:
                return i + 1, "stop"
            if stop:
                text = self.tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)
                if any(s in text for s in stop):
                    return i + 1, "stop"
        return len(tokens), "length"

    # --- weights and memory ---------------------------------------------------------------
    def weight_spec(self) -> WeightSpec:
        return self._spec

    @torch.no_grad()
    def update_weights(self, buckets: Iterable[WeightBucket]) -> int:
        if "weights" in self.asleep:
            raise RolloutError("the engine's weights are asleep: call wake(['weights']) before updating them")
        handed, applied = 0, 0
        try:
            for bucket in buckets:
                try:
                    tensors = self._spec.check(bucket.tensors, gdist.rank())
                    for name, tensor in tensors.items():
                        if not tensor.is_floating_point():
                            raise WeightError(f"weight {name!r} has dtype {tensor.dtype}: floating-point tensors only")
                except WeightError as err:
                    raise WeightError(f"{err} ({applied} weights from the buckets before it were applied)") from err
                if self._borrowed:  # writing in place would write into the lender's tensors
                    for name in self._borrowed:
                        self._params[name].data = self._params[name].data.clone()
                        self._local[name] = self._params[name]
                    self._borrowed.clear()
                # one batched cast-copy per bucket rather than one call per weight
                copy_weights_([self._local[n].data for n in tensors], list(tensors.values()))
                handed += bucket.nbytes
                applied += len(tensors)
        finally:
            self.reset_cache()
        return handed

    @torch.no_grad()
    def share_weights(self, buckets: Iterable[WeightBucket]) -> int:
        borrowed = 0
        for bucket in buckets:
            tensors = self._spec.check(bucket.tensors, gdist.rank())
            for name, tensor in tensors.items():
                p = self._params[name]
                if tensor.dtype != p.dtype or tensor.device != p.device:
                    raise WeightError(
                        f"weight {name!r} is {tensor.dtype} on {tensor.device}; the engine serves "
                        f"{p.dtype} on {p.device}: only tensors it can use as they are can be shared")
            for name, tensor in tensors.items():
                self._params[name].data = tensor.detach()
                self._local[name] = self._params[name]
                self._borrowed.add(name)
                borrowed += tensor.numel() * tensor.element_size()
        self.asleep.discard("weights")
        self.reset_cache()
        return borrowed

    def sleep(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Weights are dropped (the next sync refills them); generate keeps no KV cache between calls."""
        self.reset_cache()
        for tag in self._tags(tags):
            if tag == "weights" and tag not in self.asleep:
                for name, p in self._params.items():
                    if self._tp_group is not None:  # a DTensor's own storage is let go of, and taken back on wake
                        self._local[name].untyped_storage().resize_(0)
                    else:
                        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                        self._local[name] = p
                self._borrowed.clear()
            self.asleep.add(tag)

    def wake(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        by_name = self._spec.by_name()
        for tag in self._tags(tags):
            if tag == "weights" and tag in self.asleep:
                for name, p in self._params.items():
                    if self._tp_group is not None:
                        local = self._local[name]
                        local.untyped_storage().resize_(local.numel() * local.element_size())
                    else:
                        p.data = torch.empty(by_name[name].shape, dtype=p.dtype, device=p.device)
                        self._local[name] = p
            self.asleep.discard(tag)

    def reset_cache(self) -> None:
        """`generate` builds a fresh KV cache per call: there is no prefix cache to drop (nor one to go stale)."""

    def resident_bytes(self) -> dict[str, int]:
        """Weights borrowed through `share_weights` are the lender's memory and do not count."""
        held = (lambda t: t.untyped_storage().nbytes()) if self._tp_group is not None else \
            (lambda t: t.numel() * t.element_size())  # a DTensor's slice sleeps as a storage of 0 bytes
        weights = sum(held(t) for n, t in self._local.items() if n not in self._borrowed)
        return {"weights": weights, "kv_cache": 0}

    def close(self) -> None:
        self.model = None
        self._params.clear()
        self._local.clear()

