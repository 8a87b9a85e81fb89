"""Checkpoints through DeepSpeed's own `save_checkpoint` / `load_checkpoint`, resumable at another dp size.

A DeepSpeed checkpoint holds each rank's ZeRO partitions, so it loads only at
the dp size that wrote it ("Automatic adjustment of ZeRO's optimizer state
partitioning with a new world size is not currently supported"). DeepSpeed's
answer is the universal checkpoint: `ds_to_universal` rewrites the partitions
as one file per weight and state, which an engine of any dp size loads. Every
checkpoint written here carries the marker that conversion asks for; `load`
at another dp size converts once (rank 0, into `<path>/universal`) and loads that.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os

from gearshift import dist as gdist

TAG = "gearshift"
META = "gearshift-deepspeed.json"
UNIVERSAL = "universal"


def save_checkpoint(engine, path: str, trainable_only: bool = False) -> None:
    """Every rank writes its partitions of model and optimizer under `path`; rank 0 the layout beside them.

    `trainable_only` (LoRA: the frozen base is the model the engine was built from) leaves the frozen
    parameters out."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    marker = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
    engine.save_checkpoint(path, tag=TAG, client_state=marker, exclude_frozen_parameters=trainable_only)
    if gdist.rank() == 0:
        with open(os.path.join(path, META), "w") as f:
            json.dump({"dp": gdist.world_size(), "zero_stage": engine.zero_optimization_stage(),
                       "trainable_only": trainable_only}, f)
    gdist.barrier()


def load_checkpoint(engine, path: str) -> None:
    """Load what `save_checkpoint` wrote, at the dp size that wrote it or (through a universal checkpoint) any."""
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path} is not a checkpoint of the deepspeed train backend (no {META})")
    with open(meta_path) as f:
        meta = json.load(f)
    saved, stage = meta.get("zero_stage"), engine.zero_optimization_stage()
    if saved is not None and saved != stage:  # DeepSpeed's own load stops at a bare AssertionError
        raise ValueError(f"{path} was saved at ZeRO stage {saved} and this engine runs stage {stage}: resume it "
                         f"with zero_stage={saved} (train.options.zero_stage={saved})")
    # a checkpoint without the frozen parameters leaves them as the engine was built
    strict = not meta.get("trainable_only", False)
    if meta["dp"] == gdist.world_size():
        loaded, _ = engine.load_checkpoint(path, tag=TAG, load_module_strict=strict)
    else:
        folder = os.path.join(path, UNIVERSAL)
        error = None
        if gdist.rank() == 0 and not os.path.isdir(os.path.join(folder, TAG)):
            try:
                to_universal(os.path.join(path, TAG), os.path.join(folder, TAG))
            except RuntimeError as err:
                error = str(err)
        error = gdist.broadcast_object(error)  # every rank fails together, none waits for a load that never comes
        if error:
            raise RuntimeError(error)
        engine._config.load_universal_checkpoint = True  # a load-time switch: only load paths read it
        try:
            loaded, _ = engine.load_checkpoint(folder, tag=TAG, load_module_strict=strict)
        finally:
            engine._config.load_universal_checkpoint = False
    if loaded is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint {TAG!r} under {path}")


def to_universal(source: str, target: str) -> None:
    """DeepSpeed's `ds_to_universal` in this process (no worker pool), its progress output kept quiet."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=source, output_folder=target, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            ds_to_universal.main(args)
    except Exception as err:
        raise RuntimeError(f"converting {source} to a universal checkpoint failed: {err}\n{log.getvalue()[-2000:]}") \
            from err
