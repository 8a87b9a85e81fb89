"""Walking a `ReshardPlan` on every switch: this rank's weights in the rollout layout, bucket by bucket."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from .. import dist as gdist
from ..weights import WeightBucket, copy_weights_
from .link import Link, Message
from .plan import BucketPlan, ReshardPlan, numel


def stream_plan(
    plan: ReshardPlan,
    local_weights: Callable[[list[str]], Mapping[str, torch.Tensor]] | None,
    rank: int | None = None,
    group: "dist.ProcessGroup | Link | None" = None,
    cast: bool = True,
    materialized: Callable[[list[str]], AbstractContextManager] | None = None,
    device: torch.device | str | None = None,
    lent: bool = False,
) -> Iterator[WeightBucket]:
    """Yield this rank's weights in the rollout layout, bucket by bucket, running the plan's copies.

    `local_weights(names)` returns this rank's shards in the train layout (views are fine),
    under the train engine's names. `materialized(names)`, when given, is entered around each
    bucket, from before its weights are read until the consumer asks for the next bucket (an
    engine that gathers weights per bucket keeps them only that long); every rank enters it for
    every bucket in the same order. A piece that is already whole and in the right dtype is passed
    on as is: no copy. `cast=False` passes whole local pieces on in the trainer's dtype too, for a
    receiver that casts as it copies (`RolloutEngine.casts_on_load`): one pass over the bytes
    instead of two. Pieces bound for another rank travel packed: one message per peer (and dtype)
    per bucket, so a switch sends a few large messages rather than one per weight slice.

    Between separate pools (a plan whose specs name their global ranks), `rank` is this rank on
    the `Link` given as `group`: a train rank passes `local_weights` and gets empty buckets (it
    only sends: iterate them to drive the sends), a rollout rank passes None and gets its
    tensors, on `device` (default: the CPU).

    `lent`: `local_weights` returns the train engine's own tensors, which keep their place between
    syncs (`TrainEngine.can_lend_weights`, no LoRA merge); a bucket passed on as those tensors
    themselves, nothing cut or cast, is marked `WeightBucket.lent`. Such buckets hold no memory of
    their own, so they are passed on as one, after the others: a receiver's work per bucket (checks, a
    call, a batched copy) is then paid once a sync (at 7B, about 105 buckets of 128 MiB). Where every
    weight is lent whole, the export itself is one look-up of them all (`materialized` entered once around it):
    no work per bucket on the sender's side either.
    """
    rank = gdist.rank() if rank is None else rank
    sends = plan.src.mesh_rank(rank) is not None
    if sends and local_weights is None:
        raise ValueError(f"rank {rank} holds training weights under this plan: pass local_weights")
    materialized = materialized or (lambda names: nullcontext())
    dtypes = sorted({str(p.dtype) for p in plan.dst})

    def tag(bucket: BucketPlan, dtype: torch.dtype) -> int:  # both ends work it out from the plan alone
        return bucket.index * len(dtypes) + dtypes.index(str(dtype))

    whole = plan.whole_plan(rank) if lent and sends else None
    # every weight lent as it is (the plan's dtypes ask no cast): one look-up and one bucket for the whole sync
    if whole and (not cast or all(plan.source(n).dtype == d for n, d in whole)):
        sources = [plan.source_names[n] for n, _ in whole]
        with materialized(sources):
            by_source = local_weights(sources)
            if all(not cast or by_source[s].dtype == d for (_, d), s in zip(whole, sources)):
                yield WeightBucket({n: by_source[s] for (n, _), s in zip(whole, sources)},
                                   plan.buckets[0].index, lent=True)
                return
            by_source = None  # a tensor of another dtype than its spec says: bucket by bucket below
    kept: WeightBucket | None = None  # the lent buckets so far, as one
    for bucket in plan.buckets:
        if not sends:
            yield _assemble(plan, bucket, {}, rank, group, cast, tag, device)
            continue
        sources = [plan.source_names[n] for n in bucket.names]
        with materialized(sources):
            by_source = local_weights(sources)
            local = {name: by_source[src] for name, src in zip(bucket.names, sources)}
            bucket_out = _assemble(plan, bucket, local, rank, group, cast, tag, device)
            if lent and bucket_out.tensors and all(bucket_out.tensors[n] is local[n] for n in bucket_out.tensors):
                if kept is None:
                    kept = WeightBucket({}, bucket_out.index, lent=True)
                kept.tensors.update(bucket_out.tensors)
            else:
                yield bucket_out
            by_source = local = bucket_out = None  # a gathered bucket (ZeRO-3) must not outlive its gather
    if kept is not None:
        yield kept


def _assemble(plan, bucket, local, rank, group, cast, tag, device=None) -> WeightBucket:
    whole = plan.whole_bucket(rank, bucket) if local else None
    if whole is not None:  # nothing to cut, send or receive: the trainer's own tensors (cast if asked)
        if not cast:
            return WeightBucket({n: local[n] for n, _ in whole}, bucket.index)
        return WeightBucket({n: t if t.dtype == d else t.to(d) for n, d in whole for t in (local[n],)}, bucket.index)
    out: dict[str, torch.Tensor] = {}
    # the tensors this rank assembles are views into one buffer per dtype: one allocation, not one per weight
    sizes: dict[torch.dtype, int] = {}
    for name in bucket.names:
        view = plan.rank_view(rank, name)
        if not view.whole and view.shape is not None:
            dtype = plan.target(name).dtype
            sizes[dtype] = sizes.get(dtype, 0) + numel(view.shape)
    if local:
        device = next(iter(local.values())).device
    device = torch.device(device) if device is not None else torch.device("cpu")
    arena = {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
    used = dict.fromkeys(arena, 0)
    sends: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    recvs: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, tuple[slice, ...], tuple[int, ...]]]] = {}
    into: list[torch.Tensor] = []  # pieces this rank keeps, copied in one batched call
    pieces: list[torch.Tensor] = []
    for name in bucket.names:
        dtype = plan.target(name).dtype
        view = plan.rank_view(rank, name)
        if view.whole:
            t = local[name]
            out[name] = t if t.dtype == dtype or not cast else t.to(dtype)
            continue
        if view.shape is not None:
            start, n = used[dtype], numel(view.shape)
            out[name] = arena[dtype][start:start + n].view(view.shape)
            used[dtype] = start + n
        for piece in view.pieces:
            if piece.src == rank:
                part = local[name][piece.src_slices]
                if piece.dst == rank:
                    into.append(out[name][piece.dst_slices])
                    pieces.append(part)
                else:
                    sends.setdefault((piece.dst, dtype), []).append(part.reshape(-1))
            else:
                recvs.setdefault((piece.src, dtype), []).append((out[name], piece.dst_slices, piece.shape))
    if into:
        copy_weights_(into, pieces)
    if sends or recvs:
        _exchange(bucket, sends, recvs, device, group, tag)
    return WeightBucket(out, bucket.index)  # its tensors keep the arena alive; the consumer decides when it goes


def _exchange(bucket, sends, recvs, device, group, tag) -> None:
    """One message per peer and dtype: packed (and cast) in one pass, split out where it lands."""
    messages: list[Message] = []
    for (peer, dtype), flats in sends.items():
        flat = torch.empty(sum(f.numel() for f in flats), dtype=dtype, device=device)
        torch.cat(flats, out=flat)
        messages.append(("send", flat, peer, tag(bucket, dtype)))
    landing = []
    for (peer, dtype), places in recvs.items():
        flat = torch.empty(sum(numel(shape) for _, _, shape in places), dtype=dtype, device=device)
        messages.append(("recv", flat, peer, tag(bucket, dtype)))
        landing.append((flat, places))
    if isinstance(group, Link):
        group.exchange(messages)
    else:
        ops = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group, tg)
               for kind, t, peer, tg in messages]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    dsts, srcs = [], []
    for flat, places in landing:
        for (buf, where, shape), part in zip(places, flat.split([numel(shape) for _, _, shape in places])):
            dsts.append(buf[where])
            srcs.append(part.view(shape))
    if dsts:
        copy_weights_(dsts, srcs)
