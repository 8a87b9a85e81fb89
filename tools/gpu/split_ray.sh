#!/usr/bin/env bash
# run.placement=split on a machine with two GPUs: the train pool (fsdp) on GPU 0, the rollout pool (hf, bf16)
# on GPU 1, Ray starting both on this machine, weights crossing over NCCL; beside it the colocated run of the
# same job on both GPUs (torchrun), and split with one-step-off-policy rollout. Prints the step times of the
# three, and each switch's transfer time and rate beside the link's measured rate and NVLink's.
#
#   tools/gpu/split_ray.sh wheels                 # here, with network: Ray for the GPU image into .whl-ray/
#   tools/gpu/split_ray.sh colocated|split|async|report [OUT]   # there (carry .whl and .whl-ray)
#   tools/gpu/split_ray.sh all [OUT]              # the three runs, then the report
#
# .whl/ comes from tools/gpu/make_wheels.sh. Ray's wheel is 76 MiB, over what travels to the machine, most of
# it Java jars that Python never loads: `wheels` writes it without them (about 45 MiB), with what Ray imports
# that the image may lack. Knobs: STEPS (12), MODEL (qwen2-0.5b), MAX_TOKENS (64), PROMPTS (16).
set -uo pipefail
what=${1:?wheels, colocated, split, async, report or all}; out=${2:-${OUT:-/tmp/out}}
cd "$(dirname "$0")/../.."

if [ "$what" = wheels ]; then
  set -e
  py=${PYTHON:-$PWD/.venv/bin/python}
  grep -qx '/.whl-ray/' .git/info/exclude 2>/dev/null || echo '/.whl-ray/' >> .git/info/exclude
  rm -rf .whl-ray && mkdir -p .whl-ray/full
  dl() { "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
           --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$@"; }
  dl .whl-ray/full ray==2.60.0
  dl .whl-ray msgpack protobuf jsonschema jsonschema-specifications referencing rpds-py attrs click filelock
  "$py" - <<'EOF'
import glob, os, zipfile
src = glob.glob(".whl-ray/full/ray-*.whl")[0]
dst = os.path.join(".whl-ray", os.path.basename(src))
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        if item.filename.startswith("ray/jars/"):
            continue
        data = zin.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"\n".join(l for l in data.split(b"\n") if not l.startswith(b"ray/jars/"))
        zout.writestr(item, data)
print(f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MiB")
EOF
  rm -rf .whl-ray/full
  du -sh .whl-ray
  exit 0
fi

mkdir -p "$out"
if [ ! -d /tmp/site/gearshift ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl .whl-ray/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export GEARSHIFT_CACHE=/tmp/gscache RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
steps=${STEPS:-12}
job=(model.path="${MODEL:-qwen2-0.5b}" train.backend=fsdp rollout.backend=hf rollout.dtype=bfloat16
     rollout.max_tokens="${MAX_TOKENS:-64}" run.steps="$steps" run.prompts_per_step="${PROMPTS:-16}" rollout.n=8
     algorithm.entropy_coef=0.01 run.checkpoint_every=0 run.progress=false run.tensorboard=false run.plot=false
     run.resume=never)
split=(run.placement=split run.pools.train=1 run.pools.rollout=1)

run_one() {
  local name=$1; shift
  echo "== $name"
  timeout 540 "$@" run.output_dir="$out/$name" 2>&1 | grep -v "Loading\|Writing" | tee "$out/$name.log" | tail -6
}

case "$what" in
  colocated) run_one colocated torchrun --nproc_per_node 2 -m gearshift train "${job[@]}" ;;
  split) run_one split python3 -m gearshift train "${job[@]}" "${split[@]}" ;;
  async) run_one async python3 -m gearshift train "${job[@]}" "${split[@]}" algorithm.off_policy_steps=1 \
           algorithm.rollout_correction=tis ;;
  all) for w in colocated split async; do bash "$0" "$w" "$out"; done; bash "$0" report "$out" ;;
  report)
    python3 - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path

NVLINK_GBPS = 450.0  # H200, NVLink 4: 18 links x 25 GB/s in each direction
out = Path(sys.argv[1])


def med(rows, key):
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


print(f"{'run':10} {'steps':>5} {'step s':>7} {'rollout s':>9} {'train s':>8} {'switch s':>8} {'MB':>8} "
      f"{'GB/s':>6} {'link GB/s':>9} {'of NVLink':>9} {'reward':>6}")
for name in ("colocated", "split", "async"):
    path = out / name / "metrics.jsonl"
    if not path.exists():
        print(f"{name:10} (not run)")
        continue
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()][2:]  # after two warm-up steps
    if name == "colocated":
        for r in rows:  # the sync inside the switch to rollout: export and load (or share)
            r["switch/sync"] = sum(r.get(f"switch/{p}", 0.0) for p in ("export", "load", "share"))
        switch, mb, gbps, link = med(rows, "switch/sync"), float("nan"), float("nan"), float("nan")
        train = med(rows, "time/train")
    else:
        switch, mb = med(rows, "switch/transfer_s"), med(rows, "switch/transfer_mb")
        gbps, link, train = med(rows, "switch/transfer_gbps"), med(rows, "switch/link_gbps"), med(rows, "time/learn")
    print(f"{name:10} {len(rows):5d} {med(rows, 'time/step'):7.3f} {med(rows, 'time/rollout'):9.3f} {train:8.3f} "
          f"{switch:8.4f} {mb:8.1f} {gbps:6.1f} {link:9.1f} {link / NVLINK_GBPS:9.1%} {med(rows, 'reward/mean'):6.3f}")
print("step s: median wall time of a step; switch s: colocated, the sync inside the switch to rollout; split, "
      "the transfer between the pools (send, receive and load, slowest rank); link GB/s: one 64 MiB message "
      "GPU 0 -> GPU 1 measured at start; NVLink: 450 GB/s each way")
EOF
    ;;
  *) echo "unknown: $what" >&2; exit 2 ;;
esac
