"""`export_weights`: a train engine's weights in the layout a spec asks for, bucket by bucket.

The trainer says what it holds (`weight_spec`, `local_weights`, `materialized`);
this function plans the move from that layout to the one asked for and streams
it. A checkpoint writer, a naive sync and the tests read whole weights this way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from ..weights import WeightBucket, WeightSpec
from .planner import DEFAULT_BUCKET_BYTES, plan_reshard
from .stream import stream_plan

if TYPE_CHECKING:
    from ..train import TrainEngine


def export_weights(train: "TrainEngine", spec: WeightSpec | None = None,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
    """`train`'s weights in the layout `spec` asks for (default: whole on every rank), bucket by bucket.

    Every rank of the train mesh calls it and walks the whole stream (it may exchange
    slices between ranks, and `train.materialized` may gather).
    """
    mine = train.weight_spec()
    target = spec if spec is not None else mine.replicated()
    yield from stream_plan(plan_reshard(mine, target, bucket_bytes), train.local_weights,
                           materialized=train.materialized)
