"""The RL loop: rollout -> reward -> reference logprobs -> advantages -> policy (and critic) update -> switch.

Plain Python over the core interfaces; every rank runs it in step (SPMD).
Each rank rolls out its share of the step's prompts and trains on them; the
train engine's own process group averages the gradients. Shares go by
data-parallel index (`shares.py`): tensor- and sequence-parallel peers get the
same prompts and samples.
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
from .config import Config, ConfigError
from .engines import (
    build_critic, build_policy, build_reference, build_resharder, build_reward_model, build_rollout, check_context,
    check_options,
)
from ..containment import heap_frozen
from ..hybrid import HybridActor
from ..memory import check_train_fits
from ..profiler import device_used_bytes, step_peak_bytes
from .agent import Agent, episode_metrics
from .learner import Learner, check_algorithm
from .metrics import MetricsLogger, plot_rewards
from .scoring import Scorer
from .shares import Shares

RewardFn = Callable[..., "float | None"]


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


class Controller:
    """Builds the engines a config names and runs its steps."""

    def __init__(self, config: Config, reward_fn: RewardFn | None = None, dataset=None, eval_dataset=None) -> None:
        from transformers import AutoTokenizer

        from ..models import resolve_model
        from .data import PromptDataset, as_prompt_dataset
        from .rewards import load_reward

        gdist.init()
        self.rank, self.world = gdist.rank(), gdist.world_size()
        self.config = config.validate(self.world, reward_given=reward_fn is not None,
                                      eval_given=eval_dataset is not None)
        cfg = self.config
        check_options(cfg)  # every backend found, and given only options it has, before anything is built
        if cfg.model.lora.adapter_sync and not registry.load("rollout", cfg.rollout.backend).can_load_adapters:
            raise ConfigError(f"model.lora.sync=adapter: rollout.backend={cfg.rollout.backend} cannot serve LoRA "
                              f"adapters; use a backend that can (vllm), or model.lora.sync=merged")
        random.seed(cfg.run.seed + self.rank)
        torch.manual_seed(cfg.run.seed)
        self.out = Path(cfg.run.output_dir)
        self.model_path = resolve_model(cfg.model.path) if self.rank == 0 else None
        self.model_path = gdist.broadcast_object(self.model_path)
        check_context(cfg, self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        rule = reward_fn or cfg.reward_rule()  # none when a reward model or the environment alone scores
        reward = load_reward(rule) if rule else None
        check_algorithm(cfg)  # after the reward's module: what it registers counts
        key = cfg.data.prompt_key
        self.data = (as_prompt_dataset(dataset, prompt_key=key, seed=cfg.data.seed) if dataset is not None
                     else PromptDataset.from_config(cfg.data))
        given_val = eval_dataset if eval_dataset is not None else cfg.data.val_path
        #: the held-out rows evaluated every `run.eval_every` steps and after the last (None: no evaluation)
        self.val_data = as_prompt_dataset(given_val, prompt_key=key, shuffle=False) if given_val is not None else None
        #: the episode loop of the agent section (None: one completion a sample)
        self.agent = Agent.from_config(cfg, self.tokenizer)
        tools = self.agent.schemas() if self.agent else None  # chat prompts show the template's tools
        for data in filter(None, (self.data, self.val_data)):
            if reward is not None:
                reward.check_columns(data.columns)  # a missing column fails now, not after a rollout
            data.bind(self.tokenizer, max_prompt_len=cfg.data.max_prompt_len, tools=tools)
        self.plot_path: Path | None = None  # the reward curve, once drawn
        self.policy = build_policy(cfg, self.model_path)
        # a policy that cannot train even with the device to itself fails now, before the rollout engine starts
        check_train_fits(self.policy, cfg.data.max_prompt_len + cfg.rollout.max_tokens)
        self.scorer = Scorer(cfg, self.tokenizer, reward, self._reward_model() if cfg.reward.model else None)
        rollout = build_rollout(cfg, self.model_path)
        if self.agent is not None:
            self.agent.max_model_len = rollout.max_model_len
        self.actor = HybridActor(self.policy, rollout, build_resharder(cfg), offload=cfg.offload_tags(),
                                 offload_params=cfg.switch.offload_params)
        self.shares = Shares(rollout.mesh, self.policy.mesh)
        self.reference = build_reference(cfg, self.model_path)
        self.critic = build_critic(cfg, self.model_path)
        self.learner = Learner(cfg, self.policy, self.reference, self.critic, pad_id=self.tokenizer.pad_token_id or 0)
        self.step = 0
        self.logger = MetricsLogger(self.out, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                                    wandb_project=cfg.run.wandb_project, config=cfg.to_dict(),
                                    enabled=self.rank == 0)
        self._maybe_resume()

    def _reward_model(self):
        """The learned reward of `reward.model`, on the policy's device (built once, by rank 0, if a preset)."""
        from ..models import resolve_model

        cfg = self.config
        path = gdist.broadcast_object(resolve_model(cfg.reward.model) if self.rank == 0 else None)
        return build_reward_model(cfg, path, self.policy.device, self.policy.args.torch_dtype)

    # --- checkpoints ----------------------------------------------------------------------
    def _engines(self) -> dict:
        return self.learner.engines()

    def _maybe_resume(self) -> None:
        path = checkpoint.to_resume(self.config.run.resume, self.out / "checkpoints")
        if path is None:
            return
        state = checkpoint.load(path, self._engines())
        self.step = state["step"]
        self.data.load_state_dict(state["data"])
        self.logger.truncate_after(self.step)
        if self.rank == 0:
            print(checkpoint.resumed(path, self.step, self.config.run.steps))

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
        rows = self.shares.rollout_rows(self.data.next_batch(cfg.run.prompts_per_step))
        prompts = [row["prompt_ids"] for row in rows]
        sampling = cfg.sampling(seed=cfg.run.seed * 1_000_003 + self.step * 1009 + self.shares.rollout_dp,
                                step=self.step)
        switch_in = self.actor.to_rollout()
        with timed("rollout"):
            rollouts = self._generate(rows, prompts, sampling)
        used = [device_used_bytes()]
        switch_out = self.actor.to_train()
        train_rows, train_rollouts = self.shares.to_train(rows, rollouts)
        with timed("reward"):
            kept, rewards = self.scorer.score(train_rollouts, train_rows)
        metrics: dict[str, Any] = {}
        # every rank trains or none does: a rank left without samples (all dropped by the reward)
        # would otherwise skip the collectives the others wait in
        if gdist.all_ranks(bool(kept)):
            metrics.update(self.learner.learn(kept, rewards, self.step, timed))
            metrics["train/skipped"] = 0.0
            used.append(device_used_bytes())
        else:
            metrics["train/skipped"] = 1.0
            if self.rank == 0:
                print(f"gearshift: step {self.step + 1} not trained: the reward dropped every sample of a rank")
        gen_tokens = sum(len(x.token_ids) for x in rollouts)
        metrics.update({
            "reward/mean": _mean(rewards), "reward/max": max(rewards, default=0.0),
            "reward/min": min(rewards, default=0.0), "reward/dropped": len(train_rollouts) - len(kept),
            "response_len/mean": _mean([len(x.token_ids) for x in rollouts]),
            "rollout/tokens_per_s": gen_tokens / max(times["time/rollout"], 1e-9),
            "time/switch_to_rollout": switch_in.seconds, "time/switch_to_train": switch_out.seconds,
            **{f"switch/{p.name}": p.seconds for p in switch_in.phases + switch_out.phases},
            # what the memory plan moved: train state to host memory, and whether the rollout engine slept
            "switch/offload_gb": sum(p.bytes for p in switch_in.phases if p.name.startswith("offload")) / 2**30,
            "switch/rollout_slept": float(switch_out.phase("sleep") is not None),
            "memory/peak_gb": step_peak_bytes(used) / 2**30, **times, **self.scorer.metrics,
            **episode_metrics(rollouts),
        })
        metrics = gdist.average_metrics(metrics)
        metrics["time/step"] = time.perf_counter() - step_start
        self.step += 1
        if self._eval_due():
            metrics.update(self.evaluate())
        self.samples = [(self.tokenizer.decode(x.prompt_ids, skip_special_tokens=True), x.text or "", rw)
                        for x, rw in zip(kept[: cfg.run.samples_per_step], rewards)]
        return metrics

    def _generate(self, rows: list, prompts: list, sampling) -> list:
        """The rollouts of `prompts`: episodes when the run has an agent, else one completion a sample."""
        if self.agent is None:
            return self.actor.generate(prompts, sampling)
        return self.agent.run(self.actor.generate, rows, prompts, sampling)

    # --- held-out evaluation --------------------------------------------------------------
    def _eval_due(self) -> bool:
        every, last = self.config.run.eval_every, self.config.run.steps
        return self.val_data is not None and ((every and self.step % every == 0) or self.step == last)

    def evaluate(self) -> dict[str, float]:
        """The current policy's reward on the held-out rows (each rank its share): greedy, one completion a
        prompt, unless `run.eval_greedy` is false (then the rollout section's sampling)."""
        from ..rollout import SamplingParams

        cfg, start = self.config, time.perf_counter()
        rows = self.shares.rollout_rows(self.val_data.all_rows())  # each rollout replica its share
        if cfg.run.eval_greedy:
            sampling = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.rollout.max_tokens,
                                      stop=tuple(cfg.rollout.stop), logprobs=False)
        else:
            sampling = cfg.sampling(seed=cfg.run.seed * 7919 + self.step * 1009 + self.shares.rollout_dp)
        self.actor.to_rollout()
        try:  # a rank with no held-out rows still switches: the switch is collective
            rollouts = self._generate(rows, [r["prompt_ids"] for r in rows], sampling) if rows else []
        finally:
            self.actor.to_train()
        kept, rewards = self.scorer.score(rollouts, rows)
        out = {"eval/reward_mean": _mean(rewards), "eval/response_len": _mean([len(x.token_ids) for x in rollouts]),
               "eval/dropped": float(len(rollouts) - len(kept))}
        out = gdist.average_metrics(out)
        out["eval/samples"] = float(len(self.val_data) * (1 if cfg.run.eval_greedy else cfg.rollout.n))
        out["time/eval"] = time.perf_counter() - start
        return out

    # --- the whole run --------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        """Run until `run.steps`, checkpointing as configured; returns every step's metrics.

        The steps run with the heap as it stands at their start frozen (`heap_frozen`): the engines, models and
        data live to the end, and no full collection walks them again (vLLM's engine freezes it likewise)."""
        from tqdm import tqdm

        cfg = self.config.run
        history = []
        bar = tqdm(total=cfg.steps, initial=self.step, desc="gearshift", unit="step",
                   disable=not cfg.progress or self.rank != 0, dynamic_ncols=True)
        try:
            with heap_frozen(collect=True):
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
        if self.rank == 0 and cfg.plot and plot_rewards(self.logger.path, self.out / "reward.png"):
            self.plot_path = self.out / "reward.png"
        return history

    def close(self) -> None:
        """Release every engine the run built (the rollout engine first).

        Engines release GPU memory and their own process groups here, while the
        process group of one the engines share still exists: left to the
        interpreter's exit, an engine's finalizer can run after that group is gone.
        """
        for engine in (self.actor.rollout, self.policy, self.reference, self.critic, self.scorer.reward_model):
            if engine is not None:
                engine.close()

    def export(self, path: str | Path) -> None:
        """Write the policy as a Hugging Face folder (loads with transformers and vLLM)."""
        self.policy.save_hf(str(path))
