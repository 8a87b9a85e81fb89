#!/usr/bin/env bash
# Splits a carry into chunk folders DIR/c01, c02, ... of one part of SIZE (default 48m) each, and writes the parts'
# sums to DIR/dev/parts.sha256, so that one chunk and the working tree together stay under a device call's
# 64 MiB as the tree grows. The stream is DIR's own chunks (split again, as ../shared/tools/vllm-on-h200/
# make_chunks.sh leaves them at 60 MiB) or, with `-` last, standard input (tools/gpu/sglang_h200/make_chunks.sh).
#   bash tools/gpu/rechunk.sh .carry 48m; tar cf - *.whl | bash tools/gpu/rechunk.sh "$PWD/.carry-sglang" 48m -
# The install scripts take any number of chunks (they read DIR/c*/part.* and check every part's sum).
set -euo pipefail
cd "$(dirname "$0")/../.."
C=${1:?a carry folder: .carry or .carry-sglang}; size=${2:-48m}; from=${3:-chunks}
rm -rf "$C/stage" && mkdir -p "$C/stage" "$C/dev"
if [ "$from" = - ]; then
  (cd "$C/stage" && split -b "$size" -d -a 2 - part.)
else
  ls "$C"/c[0-9]*/part.* > /dev/null
  cat "$C"/c[0-9]*/part.* | (cd "$C/stage" && split -b "$size" -d -a 2 - part.)
fi
(cd "$C/stage" && sha256sum part.*) > "$C/dev/parts.sha256"
rm -rf "$C"/c[0-9]*
i=1; for p in "$C"/stage/part.*; do d=$(printf '%s/c%02d' "$C" $i); mkdir -p "$d"; mv "$p" "$d/"; i=$((i+1)); done
rmdir "$C/stage"
echo "$((i - 1)) chunks:"; du -sh "$C"/c[0-9]*
