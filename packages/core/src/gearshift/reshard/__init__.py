"""Moving weights from the training layout to the rollout layout.

`plan_reshard` (planner.py) works out once, from the two engines' `WeightSpec`s,
which slice of which weight each rank sends to which rank and where the bucket
boundaries fall: a `ReshardPlan` (plan.py, plain data). `stream_plan`
(stream.py) then walks that list on every switch: local pieces are views or
copies, remote ones point-to-point messages, one bucket at a time, so the extra
memory is one bucket. `export_weights` (export.py) plans and streams a train
engine's weights into any layout, whole on every rank by default.

When every rank already holds each weight whole, in the dtype and on the
device the rollout engine wants (one process, or data parallel on both sides,
fp32 on a CPU), there is nothing to move: a rollout engine that can serve from
the trainer's own tensors (`RolloutEngine.share_weights`) is handed them, and a
sync costs a few pointer swaps (`share_refusal` says why a plan cannot).

Training and rollout may also run on separate pools of ranks: each side's
spec then names its global ranks (`WeightSpec.on_ranks`), the same planner
works out which train rank sends which slice to which rollout rank, and the
slices cross over a `Link` (link.py: a process group over both pools, apart
from each pool's own) through `send_weights` / `receive_weights` (pools.py).

Three resharders ship with the core (resharders.py): `stream` (the above),
`naive` (what a system without a resharder does: the trainer writes a full
safetensors checkpoint and the rollout engine reloads it from that path;
benchmarks compare against it) and `adapter` (a LoRA trainer's adapter alone,
to a rollout engine that serves adapters on its base weights).
"""

from .export import export_weights
from .link import Link, open_store
from .plan import BucketPlan, RankPiece, RankView, ReshardPlan, Transfer
from .planner import DEFAULT_BUCKET_BYTES, plan_reshard, share_refusal
from .pools import plan_between_pools, receive_weights, send_weights
from .resharders import AdapterResharder, NaiveResharder, Resharder, StreamingResharder
from .stream import stream_plan

__all__ = [
    "AdapterResharder", "DEFAULT_BUCKET_BYTES", "BucketPlan", "Link", "NaiveResharder", "RankPiece", "RankView", "ReshardPlan",
    "Resharder", "StreamingResharder", "Transfer", "export_weights", "open_store", "plan_between_pools", "plan_reshard",
    "receive_weights", "send_weights", "share_refusal", "stream_plan",
]
