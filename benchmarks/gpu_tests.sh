#!/usr/bin/env bash
# GPU correctness run (device): the `gpu`-marked tests in parallel shards (kernel compilation is
# CPU-bound, so shards sharing one GPU finish several times sooner). Summary written to $1;
# $2 (optional) limits the run to some test files, e.g. tests/test_gpu_backward.py; PART=i/n (optional)
# to the i-th of n slices of them; FILTER (optional) to the test IDs that match an extended regex.
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
out=${1:-/dev/stdout}
shards=${SHARDS:-6}
# WORK (optional): where the test ids and shard logs go, so that a run cut off by a time limit leaves them
work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
python3 -m pytest -q -m gpu -p no:cacheprovider --collect-only ${2:-tests/} | grep '::' | grep -E "${FILTER:-.}" > "$work/all"
# PART=i/n runs the i-th of n equal slices of the tests (i from 1): long grids in calls that fit a time limit.
if [ -n "$PART" ]; then
  split -n l/"${PART#*/}" -d -a 3 "$work/all" "$work/part."
  cp "$work/part.$(printf %03d $(( ${PART%/*} - 1 )))" "$work/ids"
else
  cp "$work/all" "$work/ids"
fi
split -n l/"$shards" -d "$work/ids" "$work/shard."
for ids in "$work"/shard.*; do
  # split cuts by bytes: with few tests a shard can be empty, and pytest given no ids would run every test
  [ -s "$ids" ] || continue
  python3 -m pytest -q -m gpu -p no:cacheprovider --tb=line -rfE $(cat "$ids") > "$ids.log" 2>&1 &
done
wait
{
  echo "$(wc -l < "$work/ids") gpu tests${PART:+ (part $PART of $(wc -l < "$work/all"))} in $shards shards, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  for log in "$work"/shard.*.log; do grep -E '^(FAILED|ERROR|E )|^/.*:[0-9]+: |passed|failed|error|skipped' "$log"; done
} | tee "$out"
