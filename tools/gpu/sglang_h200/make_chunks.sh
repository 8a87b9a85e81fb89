#!/usr/bin/env bash
# Builds .carry-sglang/c01..cNN in this checkout (each part 48 MiB at most, so that one and the
# working tree stay under a device call's 64 MiB), for a machine with no network:
# sglang 0.5.17 (it pins torch 2.11.0, the torch of the H200 image) and what its offline Engine imports for a
# dense model on CUDA that the image lacks (deps.txt beside this file). The kernel wheel (sglang-kernel 0.4.5,
# 383 MB, 1.2 GB unpacked) goes as it is: its FlashAttention-3 library is one fat binary for every GPU
# architecture, and the tools that would cut it to sm_90 (nvprune, cuobjdump) are not here.
# Run here, from the project root: tools/gpu/sglang_h200/make_chunks.sh   (about 2 minutes; see README.md)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$(git rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.carry-sglang/' "$exclude" 2>/dev/null || echo '/.carry-sglang/' >> "$exclude"
C=.carry-sglang; mkdir -p $C/wheels
SGLANG=sglang==0.5.17
PLAT="--platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
specs=("$SGLANG" $(grep -v '^#' "$here/deps.txt"))
own=($(grep -v '^#' "$here/own.txt"))  # installed into a folder of their own: see own.txt
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
    -d "$1" "$2" 2>&1 | grep -v "^WARNING: Location" || true
}
for spec in "${specs[@]}"; do fetch $C/wheels "$spec"; done
for spec in "${own[@]}"; do fetch $C/wheels/own "$spec"; done
n=$(ls $C/wheels/*.whl | wc -l); echo "$n wheels, $(du -cb $C/wheels/*.whl | tail -1)"
[ "$n" = "${#specs[@]}" ] || { echo "expected ${#specs[@]} wheels (one version of each); clear $C/wheels and rerun"; exit 1; }
[ "$(ls $C/wheels/own/*.whl | wc -l)" = "${#own[@]}" ] || { echo "expected ${#own[@]} wheels in $C/wheels/own"; exit 1; }
rm -rf $C/c[0-9]* $C/stage $C/dev
(cd $C/wheels && tar cf - *.whl own/*.whl) | bash "$here/../rechunk.sh" "$PWD/$C" 48m -
cp "$here/install.sh" $C/dev/
du -sh $C/dev; du -cb $C/c[0-9]*/part.* | tail -1
