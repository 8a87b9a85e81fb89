"""The RL loop: rollout -> reward -> reference logprobs -> advantages -> policy (and critic) update -> switch.

Plain Python over the core interfaces; every rank runs it in step (SPMD).
Each rank rolls out its share of the step's prompts and trains on them; the
train engine's own process group averages the gradients.
"""

from __future__ import annotations

import random
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch

from .. import dist as gdist, registry
from . import checkpoint
from .algos import (
    ROLLOUT_WEIGHTS, TOKENS_PER_SEQ, compute_advantages, kl_estimate, kl_in_reward, make_policy_loss_fn,
    make_value_loss_fn, rollout_correction, tokens_per_seq,
)
from .config import Config, ConfigError
from ..hybrid import HybridActor
from ..profiler import peak_memory_bytes
from .metrics import MetricsLogger, plot_rewards
from ..rollout import Rollout
from ..train import TrainBatch

RewardFn = Callable[..., "float | None"]
SHARE = {"auto": None, "on": True, "off": False}


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


class Controller:
    """Builds the engines a config names and runs its steps."""

    def __init__(self, config: Config, reward_fn: RewardFn | None = None, dataset=None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from ..models import resolve_model
        from .data import PromptDataset
        from .rewards import load_reward

        gdist.init()
        self.rank, self.world = gdist.rank(), gdist.world_size()
        self.config = config.validate(self.world, reward_given=reward_fn is not None)
        cfg = self.config
        # every backend is found before anything is built: a missing or ambiguous one fails first
        for kind, name in (("train", cfg.train.backend), ("rollout", cfg.rollout.backend),
                           ("reshard", cfg.switch.resharder)):
            registry.load(kind, name)
        random.seed(cfg.run.seed + self.rank)
        torch.manual_seed(cfg.run.seed)
        self.out = Path(cfg.run.output_dir)
        self.model_path = resolve_model(cfg.model.path) if self.rank == 0 else None
        self.model_path = gdist.broadcast_object(self.model_path)
        self._check_context(AutoConfig.from_pretrained(self.model_path))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        rule = reward_fn or cfg.reward.rule(cfg.data)  # none when a reward model alone scores
        self.reward_fn = load_reward(rule) if rule else None
        self.data = dataset if dataset is not None else PromptDataset.from_config(cfg.data)
        if self.reward_fn is not None:
            self.reward_fn.check_columns(self.data.columns)  # a missing column fails now, not after a rollout
        self.data.bind(self.tokenizer, max_prompt_len=cfg.data.max_prompt_len)
        t, r, sw = cfg.train, cfg.rollout, cfg.switch
        common = dict(model=self.model_path, dtype=cfg.model.dtype, seed=cfg.run.seed)
        train_opts = {**common, "mesh": t.mesh or None, "lr": t.lr, "weight_decay": t.weight_decay,
                      "max_grad_norm": t.max_grad_norm, "micro_batch_size": t.micro_batch_size or None,
                      "max_tokens_per_micro_batch": t.max_tokens_per_micro_batch or None,
                      "dropout": cfg.model.dropout, **cfg.model.lora.train_options(), **t.options}
        self.policy = registry.create("train", t.backend, **train_opts)
        self.reward_model = self._reward_model() if cfg.reward.model else None
        self._reward_metrics: dict[str, float] = {}
        rollout = registry.create("rollout", r.backend, **{**common, "dtype": r.dtype or cfg.model.dtype},
                                  mesh=r.mesh or None,
                                  max_model_len=r.max_model_len, **r.options)
        if rollout.max_model_len < cfg.data.max_prompt_len + r.max_tokens:
            raise ConfigError(cfg.context_problem(rollout.max_model_len) + f" (the {r.backend} engine's context)")
        resharder = registry.create("reshard", sw.resharder, bucket_bytes=sw.bucket_mb << 20, **sw.options,
                                    **({"share": SHARE[sw.share]} if sw.resharder == "stream" else {}))
        self.actor = HybridActor(self.policy, rollout, resharder, offload=cfg.offload_tags(),
                                 offload_params=sw.offload_params)
        a = cfg.algorithm
        self.reference = None
        if a.kl_coef > 0:  # a frozen copy of the starting policy; it never steps, so it holds no optimizer state
            self.reference = registry.create("train", t.backend, **train_opts)
        self.critic = None
        if a.name == "ppo":
            self.critic = registry.create("train", t.backend, **{**train_opts, "lr": a.critic_lr}, value_head=True)
        self.advantage = a.advantage or ("gae" if a.name == "ppo" else "grpo")
        self.policy_loss = make_policy_loss_fn(
            a.policy_loss, kl_coef=a.kl_coef if a.kl_in == "loss" else 0.0, kl_estimator=a.kl_estimator,
            kl_in_loss=a.kl_in == "loss", entropy_coef=a.entropy_coef, agg=a.loss_agg,
            **({"clip_low": a.clip_low, "clip_high": a.clip_high} if a.policy_loss == "ppo_clip" else {}),
        )
        self.value_loss = make_value_loss_fn(clip=a.value_clip, agg=a.loss_agg) if self.critic else None
        self.step = 0
        self.logger = MetricsLogger(self.out, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                                    wandb_project=cfg.run.wandb_project, config=cfg.to_dict(),
                                    enabled=self.rank == 0)
        self._maybe_resume()

    def _reward_model(self):
        """The learned reward of `reward.model`, on the policy's device (built once, by rank 0, if a preset)."""
        from ..models import resolve_model
        from .reward_model import RewardModel

        cfg = self.config
        path = gdist.broadcast_object(resolve_model(cfg.reward.model) if self.rank == 0 else None)
        return RewardModel(path, device=self.policy.device, dtype=self.policy.args.torch_dtype,
                           batch_size=cfg.reward.model_batch_size)

    def _check_context(self, model_config) -> None:
        """Prompt and completion must fit the model's context before anything is built."""
        cfg = self.config
        context = cfg.rollout.max_model_len or getattr(model_config, "max_position_embeddings", None) or \
            getattr(model_config, "n_positions", None)
        if context and cfg.data.max_prompt_len + cfg.rollout.max_tokens > context:
            raise ConfigError(cfg.context_problem(context))

    # --- checkpoints ----------------------------------------------------------------------
    def _engines(self) -> dict:
        engines = {"policy": self.policy}
        if self.critic is not None:
            engines["critic"] = self.critic
        return engines

    def _maybe_resume(self) -> None:
        resume = self.config.run.resume
        if resume == "never":
            return
        path = Path(resume) if resume != "auto" else checkpoint.latest(self.out / "checkpoints")
        if path is None:
            return
        state = checkpoint.load(path, self._engines())
        self.step = state["step"]
        self.data.load_state_dict(state["data"])
        self.logger.truncate_after(self.step)
        if self.rank == 0:
            print(f"gearshift: resumed from {path} at step {self.step}")

    def save_checkpoint(self) -> Path:
        return checkpoint.save(self.out / "checkpoints", self.step, self._engines(),
                               {"step": self.step, "data": self.data.state_dict()})

    # --- one step -------------------------------------------------------------------------
    def run_step(self) -> dict[str, Any]:
        """One RL step; returns its metrics (averaged over ranks where that makes sense)."""
        cfg = self.config
        times: dict[str, float] = {}

        @contextmanager
        def timed(name: str):
            t0 = time.perf_counter()
            yield
            gdist.synchronize()
            times[f"time/{name}"] = time.perf_counter() - t0

        step_start = time.perf_counter()
        rows = self.data.next_batch(cfg.run.prompts_per_step)[self.rank::self.world]
        prompts = [row["prompt_ids"] for row in rows]
        sampling = cfg.sampling(seed=cfg.run.seed * 1_000_003 + self.step * 1009 + self.rank)
        switch_in = self.actor.to_rollout()
        with timed("rollout"):
            rollouts = self.actor.generate(prompts, sampling)
        switch_out = self.actor.to_train()
        with timed("reward"):
            kept, rewards = self._score(rollouts, rows)
        metrics: dict[str, Any] = {}
        # every rank trains or none does: a rank left without samples (all dropped by the reward)
        # would otherwise skip the collectives the others wait in
        if gdist.all_ranks(bool(kept)):
            metrics.update(self._learn(kept, rewards, timed))
            metrics["train/skipped"] = 0.0
        else:
            metrics["train/skipped"] = 1.0
            if self.rank == 0:
                print(f"gearshift: step {self.step + 1} not trained: the reward dropped every sample of a rank")
        gen_tokens = sum(len(x.token_ids) for x in rollouts)
        metrics.update({
            "reward/mean": _mean(rewards), "reward/max": max(rewards, default=0.0),
            "reward/min": min(rewards, default=0.0), "reward/dropped": len(rollouts) - len(kept),
            "response_len/mean": _mean([len(x.token_ids) for x in rollouts]),
            "rollout/tokens_per_s": gen_tokens / max(times["time/rollout"], 1e-9),
            "time/switch_to_rollout": switch_in.seconds, "time/switch_to_train": switch_out.seconds,
            **{f"switch/{p.name}": p.seconds for p in switch_in.phases + switch_out.phases},
            "memory/peak_gb": peak_memory_bytes() / 2**30, **times, **self._reward_metrics,
        })
        metrics = gdist.average_metrics(metrics)
        metrics["time/step"] = time.perf_counter() - step_start
        self.step += 1
        self.samples = [(self.tokenizer.decode(x.prompt_ids, skip_special_tokens=True), x.text or "", rw)
                        for x, rw in zip(kept[: cfg.run.samples_per_step], rewards)]
        return metrics

    def _score(self, rollouts: list[Rollout], rows: list[dict]) -> tuple[list[Rollout], list[float]]:
        for x in rollouts:
            if x.text is None:
                x.text = self.tokenizer.decode(x.token_ids, skip_special_tokens=True)
        values = None
        if self.reward_fn is not None:  # checked: a finite float, or None to drop the sample
            values = [self.reward_fn(x.text, **{k: v for k, v in rows[x.prompt_index].items() if k != "prompt_ids"})
                      for x in rollouts]
        if self.reward_model is not None:
            values = self._with_reward_model(rollouts, rows, values)
        kept = [(x, v) for x, v in zip(rollouts, values) if v is not None]
        return [x for x, _ in kept], [v for _, v in kept]

    def _with_reward_model(self, rollouts: list[Rollout], rows: list[dict], rule: list | None) -> list:
        """The reward model's scores, weighed with the rule reward's (`reward.weights`: [fn, model])."""
        from .reward_model import combine

        start = time.perf_counter()
        prompts = [rows[x.prompt_index][self.config.data.prompt_key] for x in rollouts]
        learned = self.reward_model.score(prompts, [x.text for x in rollouts])
        self._reward_metrics = {"time/reward_model": time.perf_counter() - start, "reward/model_mean": _mean(learned)}
        if rule is not None:
            self._reward_metrics["reward/fn_mean"] = _mean([v for v in rule if v is not None])
        return combine(rule, learned, self.config.reward.weights)

    def _learn(self, kept: list[Rollout], rewards: list[float], timed) -> dict[str, float]:
        cfg, a = self.config, self.config.algorithm
        pad = self.tokenizer.pad_token_id or 0
        batch = TrainBatch.from_sequences([x.prompt_ids for x in kept], [x.token_ids for x in kept], pad_id=pad)
        mask = batch.loss_mask
        group_ids = torch.tensor([x.prompt_index for x in kept])
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        with timed("old_logprobs"):
            old = self.policy.forward_logprobs(batch).logprobs.cpu()
        rollout_lp = torch.zeros_like(old)
        for i, x in enumerate(kept):
            rollout_lp[i, len(x.prompt_ids):len(x.prompt_ids) + len(x.token_ids)] = torch.tensor(x.logprobs)
        gap = (old - rollout_lp).abs() * mask
        out = {"mismatch/logprob_max": float(gap.max()),
               "mismatch/logprob_mean": float(gap.sum() / mask.sum().clamp(min=1))}
        extras = {"old_logprobs": old}
        weights, corrected = rollout_correction(old, rollout_lp, mask, mode=a.rollout_correction,
                                                level=a.rollout_correction_level, cap=a.rollout_correction_cap)
        out.update({f"rollout_correction/{k}": v for k, v in corrected.items()})
        if weights is not None:
            extras[ROLLOUT_WEIGHTS] = weights
        token_rewards = reward_t
        if self.reference is not None:
            with timed("ref_logprobs"):
                ref = self.reference.forward_logprobs(batch).logprobs.cpu()
            extras["ref_logprobs"] = ref
            out["kl/ref"] = float((kl_estimate(old, ref, a.kl_estimator) * mask).sum() / mask.sum().clamp(min=1))
            if a.kl_in == "reward":
                token_rewards, _ = kl_in_reward(reward_t, mask, old, ref, kl_coef=a.kl_coef, estimator=a.kl_estimator)
        values = None
        if self.critic is not None:
            with timed("values"):
                values = self.critic.forward_logprobs(batch).values.cpu() * mask
            extras["old_values"] = values
        options = {"gamma": a.gamma, "lam": a.lam} if self.advantage == "gae" else {}
        if self.advantage == "grpo":
            options["norm_by_std"] = a.norm_adv_by_std
        adv, returns = compute_advantages(self.advantage, token_rewards, mask, group_ids=group_ids,
                                          values=values, **options)
        extras.update(advantages=adv, returns=returns)
        batch.extras.update(extras)
        train_metrics: list[dict[str, float]] = []
        with timed("train"):
            for _ in range(a.epochs):
                for mini in batch.micro_batches(cfg.train.mini_batch_size or None):
                    # exact token means across micro-batches need each mini-batch's token counts
                    mini.extras[TOKENS_PER_SEQ] = tokens_per_seq(mini.loss_mask)
                    train_metrics.append(self.policy.train_step(mini, self.policy_loss))
                    if self.critic is not None:
                        critic_m = self.critic.train_step(mini, self.value_loss)
                        train_metrics[-1].update({f"critic/{k}": v for k, v in critic_m.items()})
        keys = {k for m in train_metrics for k in m}
        out.update({f"train/{k}": _mean([m[k] for m in train_metrics if k in m]) for k in sorted(keys)})
        return out

    # --- the whole run --------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        """Run until `run.steps`, checkpointing as configured; returns every step's metrics."""
        from tqdm import tqdm

        cfg = self.config.run
        history = []
        bar = tqdm(total=cfg.steps, initial=self.step, desc="gearshift", unit="step",
                   disable=not cfg.progress or self.rank != 0, dynamic_ncols=True)
        try:
            while self.step < cfg.steps:
                metrics = self.run_step()
                history.append(metrics)
                self.logger.log(self.step, metrics)
                if self.rank == 0:
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics.get('kl/ref', 0):.3f}",
                                    len=f"{metrics['response_len/mean']:.1f}")
                    for prompt, text, rw in self.samples:
                        bar.write(f"[step {self.step}] {prompt!r} -> {text!r} (reward {rw:g})")
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            bar.close()
            self.logger.close()
        if self.rank == 0 and cfg.plot:
            plot_rewards(self.logger.path, self.out / "reward.png")
        return history

    def export(self, path: str | Path) -> None:
        """Write the policy as a Hugging Face folder (loads with transformers and vLLM)."""
        self.policy.save_hf(str(path))
