"""Moving weights from a pool of training ranks to a separate pool of rollout ranks.

The plan is the colocated one (`plan_reshard`) over global ranks: each spec
names the ranks of its pool on the `Link` (`WeightSpec.on_ranks`: train ranks
first, then rollout ranks), so each training rank sends exactly the slices
each rollout rank wants, packed per peer and bucket, and no rank gathers the
whole model. Every train rank calls `send_weights` and every rollout rank
`receive_weights`, at the same time; the rollout engine takes the buckets
through its own `update_weights`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..profiler import PhaseTimer, SwitchReport
from ..weights import WeightSpec
from .link import Link
from .plan import ReshardPlan
from .planner import DEFAULT_BUCKET_BYTES, plan_reshard
from .resharders import _TimedIterator
from .stream import stream_plan

if TYPE_CHECKING:
    from ..rollout import RolloutEngine
    from ..train import TrainEngine


def plan_between_pools(train: WeightSpec, rollout: WeightSpec,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ReshardPlan:
    """The plan from a train pool (link ranks 0..T-1) to a rollout pool (link ranks T..T+R-1)."""
    senders = train.mesh.world_size
    return plan_reshard(train.on_ranks(range(senders)),
                        rollout.on_ranks(range(senders, senders + rollout.mesh.world_size)), bucket_bytes)


#: the tag of the message that starts a sync (above every bucket's)
READY_TAG = 1 << 24


def _ready(plan: ReshardPlan, link: Link, timer: PhaseTimer, device) -> None:
    """Phase `wait`: a one-element message from each train rank to each rollout rank it feeds, so that the
    phases after it time the transfer, not the wait for the other pool to finish what it was doing."""
    sent, received = plan.peer_bytes(link.rank)
    with timer.phase("wait"):
        link.exchange([("send", torch.zeros(1, device=device), peer, READY_TAG) for peer in sent]
                      + [("recv", torch.empty(1, device=device), peer, READY_TAG) for peer in received])


def send_weights(plan: ReshardPlan, train: "TrainEngine", link: Link) -> SwitchReport:
    """This train rank's part of a sync: its slices to the rollout ranks that want them, bucket by bucket.

    Phases: `wait` (for the rollout ranks to be ready) and `send`, with the bytes sent."""
    timer = PhaseTimer(train.device, "send")
    sent = sum(plan.peer_bytes(link.rank)[0].values())
    _ready(plan, link, timer, link.device)
    with timer.phase("send", sent):
        for _ in stream_plan(plan, train.local_weights, rank=link.rank, group=link, materialized=train.materialized):
            pass
    return timer.report


def receive_weights(plan: ReshardPlan, rollout: "RolloutEngine", link: Link) -> SwitchReport:
    """This rollout rank's part of a sync: its shards from the train ranks, into `update_weights`.

    Phases: `wait` (for the train ranks to be ready), `receive` (the messages, and unpacking them)
    and `load` (the engine's own work on the buckets), with the bytes that land on this rank.
    """
    timer = PhaseTimer(rollout.device, "receive")
    _ready(plan, link, timer, link.device)
    stream = _TimedIterator(stream_plan(plan, None, rank=link.rank, group=link, device=rollout.device))
    with timer.phase("sync") as total:
        rollout.update_weights(stream)
    timer.report.phases.remove(total)
    timer.add("receive", stream.seconds, plan.bytes_received(link.rank))
    timer.add("load", max(total.seconds - stream.seconds, 0.0))
    return timer.report
