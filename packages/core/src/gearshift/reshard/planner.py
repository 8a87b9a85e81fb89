"""Working out a `ReshardPlan` from the two sides' `WeightSpec`s, once, at start-up."""

from __future__ import annotations

from ..mesh import intersect
from ..weights import WeightError, WeightSpec
from .plan import Box, BucketPlan, ReshardPlan, Transfer

DEFAULT_BUCKET_BYTES = 128 * 2**20


def plan_reshard(src: WeightSpec, dst: WeightSpec, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ReshardPlan:
    """Plan moving `src` (train layout) into `dst` (rollout layout).

    Ranks are global: by default both meshes cover ranks 0 to N-1 (training and rollout share
    them); a spec that names its ranks (`WeightSpec.on_ranks`) lies on those, so the two sides
    may be separate pools of ranks (the train pool sends, the rollout pool receives). Each
    receiving rank takes each piece it needs from a rank that holds it, itself first, else
    spread over the holders; weights are grouped into buckets of about `bucket_bytes`.
    """
    if not src.ranks and not dst.ranks and src.mesh.world_size != dst.mesh.world_size:
        raise WeightError(
            f"train mesh {src.mesh} spans {src.mesh.world_size} ranks but rollout mesh {dst.mesh} spans "
            f"{dst.mesh.world_size}: both must cover the same ranks (or, for separate pools, give each "
            f"spec its global ranks with WeightSpec.on_ranks)"
        )
    source_names: dict[str, str] = {}
    missing = []
    for p in dst:
        found = src.find(p.name, dst.aliases)
        if found is None:
            missing.append(p.name)
        else:
            source_names[p.name] = found.name
    if missing:
        listed = sorted(src.by_name())
        raise WeightError(
            f"the rollout engine wants {len(missing)} weights the train engine does not have, first "
            f"{missing[:3]}; the train engine has {len(listed)} weights, first {listed[:3]}"
        )
    have = src.by_name()
    for p in dst:
        s = have[source_names[p.name]]
        if tuple(s.shape) != tuple(p.shape):
            raise WeightError(f"weight {p.name!r}: train shape {s.shape}, rollout shape {p.shape}")
    senders, receivers = src.global_ranks, dst.global_ranks
    transfers: dict[str, tuple[Transfer, ...]] = {}
    tag = 0
    for p in dst:
        s = have[source_names[p.name]]
        holders: dict[Box, list[int]] = {}
        for i, r in enumerate(senders):
            box = s.placement.local_box(s.shape, i)
            if all(hi > lo for lo, hi in box):
                holders.setdefault(box, []).append(r)
        out: list[Transfer] = []
        for j, d in enumerate(receivers):
            want = p.placement.local_box(p.shape, j)
            for box, ranks in holders.items():
                piece = intersect(box, want)
                if piece is None:
                    continue
                source = d if d in ranks else ranks[j % len(ranks)]
                out.append(Transfer(p.name, source, d, piece, tag))
                tag += 1
        transfers[p.name] = tuple(out)
    buckets: list[BucketPlan] = []
    names: list[str] = []
    size = 0
    for p in dst:
        if names and size + p.nbytes > bucket_bytes:
            buckets.append(BucketPlan(len(buckets), tuple(names), size))
            names, size = [], 0
        names.append(p.name)
        size += p.nbytes
    if names:
        buckets.append(BucketPlan(len(buckets), tuple(names), size))
    used = set(source_names.values())
    unused = tuple(p.name for p in src if p.name not in used)
    return ReshardPlan(src, dst, tuple(buckets), transfers, source_names, unused)


def share_refusal(plan: ReshardPlan) -> str | None:
    """Why the rollout engine cannot serve from the trainer's own tensors under this plan (None: it can).

    Sharing needs every rank to hold every weight whole in its rollout layout and dtype already,
    so that the stream passes the trainer's tensors on untouched and no rank talks to another.
    """
    if set(plan.src.global_ranks) != set(plan.dst.global_ranks):
        return (f"training runs on ranks {list(plan.src.global_ranks)} and rollout on ranks "
                f"{list(plan.dst.global_ranks)}: separate pools cannot share tensors")
    for name, transfers in plan.transfers.items():
        s, d = plan.source(name), plan.target(name)
        if s.dtype != d.dtype:
            return f"{name!r} is {s.dtype} in training but the rollout engine wants {d.dtype}"
        for r in plan.ranks:
            if not plan.rank_view(r, name).whole:
                t = next((t for t in transfers if t.src != t.dst), None)
                if t is not None:
                    return f"{name!r} travels from rank {t.src} to rank {t.dst} (the layouts differ)"
                return f"rank {r} holds another slice of {name!r} in training than the rollout engine wants"
    return None
