#!/usr/bin/env bash
# Pack everything under $OUT into one $OUT/results.tgz, so a call's many logs and JSON files come back whole
# (the device tool brings back at most 8 files, 2 folders down). End a call with `bash tools/gpu/pack_out.sh`.
set -u
out=${OUT:?no OUT}
tar czf /tmp/results.tgz -C "$out" . && rm -rf "${out:?}"/* && mv /tmp/results.tgz "$out/results.tgz"
ls -la "$out"
