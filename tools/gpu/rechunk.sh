#!/usr/bin/env bash
# Re-splits a carry's chunks (DIR/cNN/part.*, as ../shared/tools/vllm-on-h200/make_chunks.sh and
# tools/gpu/sglang_h200/make_chunks.sh leave them) into parts of SIZE (default 48m) and rewrites DIR/dev/parts.sha256,
# so that one chunk and the working tree together stay under a device call's 64 MiB as the tree grows.
#   bash tools/gpu/rechunk.sh .carry 48m; bash tools/gpu/rechunk.sh .carry-sglang 48m
# The install scripts take any number of chunks (they read DIR/c*/part.* and check every part's sum).
set -euo pipefail
cd "$(dirname "$0")/../.."
C=${1:?a carry folder: .carry or .carry-sglang}; size=${2:-48m}
ls "$C"/c*/part.* > /dev/null
rm -rf "$C/stage" && mkdir -p "$C/stage"
cat "$C"/c[0-9]*/part.* | (cd "$C/stage" && split -b "$size" -d -a 2 - part.)
(cd "$C/stage" && sha256sum part.*) > "$C/dev/parts.sha256"
rm -rf "$C"/c[0-9]*
i=1; for p in "$C"/stage/part.*; do d=$(printf '%s/c%02d' "$C" $i); mkdir -p "$d"; mv "$p" "$d/"; i=$((i+1)); done
rmdir "$C/stage"
du -sh "$C"/c[0-9]*
