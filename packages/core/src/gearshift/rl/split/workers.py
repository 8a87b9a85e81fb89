"""The processes of each pool: they join their pool's process group as torchrun would, then build engines.

A worker is a plain class that Ray runs as an actor (`cluster.Pool` wraps it),
one per device. It sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT for its pool and joins that group, so the engines it builds are
the same backends, built the same way, as under torchrun. Weights cross from
the train pool to the rollout pool over a `Link` every worker joins.
"""

from __future__ import annotations

import os
import socket
import time
from contextlib import contextmanager
from typing import Any, Sequence

import torch

from ... import dist as gdist
from ...reshard import Link, ReshardPlan, open_store, receive_weights, send_weights
from ...rollout import Rollout, SamplingParams
from ...train import TrainBatch
from .. import checkpoint
from ..agent import Agent
from ..config import Config
from ..engines import build_critic, build_policy, build_reference, build_reward_model, build_rollout
from ..learner import Learner
from ..scoring import Scorer


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


class Worker:
    """What the workers of both pools do: say where they run, join their pool's group and the link."""

    def __init__(self, pool: str, rank: int, size: int) -> None:
        self.pool, self.rank, self.size = pool, rank, size
        self.link: Link | None = None
        self._store = None
        self.plan: ReshardPlan | None = None

    def where(self) -> dict[str, Any]:
        import ray

        gpus = ray.get_gpu_ids()
        return {"node": _node_address(), "pid": os.getpid(), "gpus": ",".join(map(str, gpus))}

    def free_port(self) -> int:
        """A free port on this node, for the pool's rendezvous (its rank 0 serves it)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def join_pool(self, master_addr: str, master_port: int) -> None:
        """Join this pool's process group with torchrun's variables (one GPU per worker: LOCAL_RANK 0)."""
        import ray

        on_gpu = bool(ray.get_gpu_ids())
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.size), MASTER_ADDR=master_addr,
                          MASTER_PORT=str(master_port), LOCAL_RANK="0" if on_gpu else str(self.rank),
                          LOCAL_WORLD_SIZE="1" if on_gpu else str(self.size))
        torch.manual_seed(0)
        gdist.init()

    def open_link(self, size: int) -> tuple[str, int]:
        """Serve the link's store (the link's rank 0 does this first); returns its address."""
        host = _node_address()
        self._store = open_store(host, size)
        return host, self._store.port

    def join_link(self, host: str, port: int, rank: int, size: int) -> None:
        self.link = Link(host, port, rank, size, store=self._store if rank == 0 else None)

    def link_bandwidth(self, sender: int, receiver: int, nbytes: int) -> float | None:
        return self.link.bandwidth(sender, receiver, nbytes)

    def set_plan(self, plan: ReshardPlan) -> None:
        self.plan = plan

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None


@contextmanager
def _timed(times: dict[str, float], name: str):
    start = time.perf_counter()
    yield
    gdist.synchronize()
    times[f"time/{name}"] = time.perf_counter() - start


class TrainWorker(Worker):
    """A rank of the train pool: the policy (and the critic; the reference when it is placed here)."""

    def build(self, config: Config, model_path: str, reward_model_path: str | None) -> Any:
        from transformers import AutoTokenizer

        self.config = cfg = config
        torch.manual_seed(cfg.run.seed)
        policy = build_policy(cfg, model_path)
        reference = build_reference(cfg, model_path) if cfg.run.pools.reference == "train" else None
        critic = build_critic(cfg, model_path)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.learner = Learner(cfg, policy, reference, critic, pad_id=tokenizer.pad_token_id or 0)
        self.scorer = None
        if reward_model_path and cfg.run.pools.reward_model == "train":
            model = build_reward_model(cfg, reward_model_path, policy.device, policy.args.torch_dtype)
            self.scorer = Scorer(cfg, tokenizer, None, model)
        return policy.weight_spec()

    def send_weights(self) -> dict:
        gdist.heartbeat()
        return send_weights(self.plan, self.learner.policy, self.link).to_dict()

    def learn(self, kept: list[Rollout], rewards: list[float], step: int,
              ref_logprobs: Sequence[Sequence[float]] | None) -> dict[str, float]:
        """One update on this rank's groups; metrics averaged over the pool (every rank trains or none does)."""
        gdist.heartbeat()
        times: dict[str, float] = {}
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        if gdist.all_ranks(bool(kept)):
            metrics.update(self.learner.learn(kept, rewards, step, lambda name: _timed(times, name), ref_logprobs))
            metrics["train/skipped"] = 0.0
        else:
            metrics["train/skipped"] = 1.0
        metrics.update(times)
        metrics["time/learn"] = time.perf_counter() - start
        return gdist.average_metrics(metrics)

    def model_scores(self, prompts: list[Any], completions: list[str]) -> tuple[list[float], float]:
        start = time.perf_counter()
        return self.scorer.reward_model.score(prompts, completions), time.perf_counter() - start

    def save(self, root: str, step: int, state: dict) -> str:
        return str(checkpoint.save(root, step, self.learner.engines(), state))

    def load(self, path: str) -> dict:
        return checkpoint.load(path, self.learner.engines())

    def save_hf(self, path: str) -> None:
        self.learner.policy.save_hf(path)


class RolloutWorker(Worker):
    """A rank of the rollout pool: the rollout engine (and the reference or reward model when placed here)."""

    def build(self, config: Config, model_path: str, reward_model_path: str | None) -> Any:
        from transformers import AutoTokenizer

        self.config = cfg = config
        self.engine = build_rollout(cfg, model_path)
        self.version = None  # updates the policy whose weights the engine holds had had (None: not synced yet)
        # the reference lies over this pool's ranks, whatever the train mesh
        self.reference = build_reference(cfg, model_path, mesh=None) if cfg.run.pools.reference == "rollout" else None
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tokenizer.pad_token_id or 0
        self.agent = Agent.from_config(cfg, tokenizer, max_model_len=self.engine.max_model_len)
        self.scorer = None
        if reward_model_path and cfg.run.pools.reward_model == "rollout":
            model = build_reward_model(cfg, reward_model_path, self.engine.device, torch.float32)
            self.scorer = Scorer(cfg, tokenizer, None, model)
        return self.engine.weight_spec()

    def receive_weights(self, version: int) -> dict:
        """Take the weights of the policy after `version` updates; the rollouts after it report that version."""
        gdist.heartbeat()
        report = receive_weights(self.plan, self.engine, self.link).to_dict()
        self.version = version
        return report

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, rows: list[dict] | None) -> dict:
        """This rank's rollouts, with the reference's logprobs and the reward model's scores where those run
        here (`rows`: the prompts' rows, for the reward model)."""
        gdist.heartbeat()
        start = time.perf_counter()
        rollouts = (self.agent.run(self.engine.generate, rows, prompts, sampling) if self.agent is not None
                    else self.engine.generate(prompts, sampling))
        out: dict[str, Any] = {"rollouts": rollouts, "seconds": time.perf_counter() - start, "version": self.version}
        if self.reference is not None:
            start = time.perf_counter()
            batch = TrainBatch.from_sequences([x.prompt_ids for x in rollouts], [x.token_ids for x in rollouts],
                                              pad_id=self.pad_id)
            logprobs = self.reference.forward_logprobs(batch).logprobs.cpu()
            out["ref_logprobs"] = [logprobs[i, len(x.prompt_ids):len(x.prompt_ids) + len(x.token_ids)].tolist()
                                   for i, x in enumerate(rollouts)]
            out["ref_seconds"] = time.perf_counter() - start
        if self.scorer is not None:
            start = time.perf_counter()
            out["learned"] = self.scorer.model_scores(rollouts, rows)
            out["reward_model_seconds"] = time.perf_counter() - start
        return out
