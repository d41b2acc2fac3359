#!/usr/bin/env bash
# GPU correctness run (device): the `gpu`-marked tests in parallel shards (kernel compilation is
# CPU-bound, so shards sharing one GPU finish several times sooner). Summary written to $1;
# $2 (optional) limits the run to some test files, e.g. tests/test_gpu_backward.py; PART=i/n (optional)
# to the i-th of n slices of them; FILTER (optional) to the test IDs that match an extended regex;
# LIMIT (optional) stops each shard after that many seconds; WORK (optional) keeps the logs there.
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
out=${1:-/dev/stdout}
shards=${SHARDS:-6}
# WORK (optional): where the test ids and shard logs go, so that a run cut off by a time limit leaves them
work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
rm -f "$work"/shard.*  # a reused WORK: the last run's shards and logs would be taken for this run's
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
  # LIMIT (optional, seconds): each shard stops there, so that the summary is written within a time limit
  timeout "${LIMIT:-0}" python3 -m pytest -q -m gpu -p no:cacheprovider --tb=line -rfE $(cat "$ids") > "$ids.log" 2>&1 &
done
wait
{
  echo "$(wc -l < "$work/ids") gpu tests${PART:+ (part $PART of $(wc -l < "$work/all"))} in $shards shards, $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  for log in "$work"/shard.*.log; do
    if grep -qE '(passed|failed|error|errors|skipped|deselected|warnings?|no tests ran) in [0-9.]+s' "$log"; then
      grep -E '^(FAILED|ERROR|E )|^/.*:[0-9]+: |passed|failed|error|skipped' "$log"
    else  # cut off by LIMIT, or the process died: count the outcomes in pytest's progress lines
      progress=$(grep -E '^[.sxXFE]+ *(\[ *[0-9]+%\])?$' "$log" | tr -cd '.sxXFE')
      echo "$(basename "$log" .log) ended without pytest's summary (LIMIT=${LIMIT:-none}, or a crash: see $log)" \
           "after ${#progress} of $(wc -l < "${log%.log}") tests:" \
           "$(tr -cd '.' <<< "$progress" | wc -c) passed, $(tr -cd 'sxX' <<< "$progress" | wc -c) skipped or xfail," \
           "$(tr -cd 'FE' <<< "$progress" | wc -c) failed or errors"
    fi
  done
} | tee "$out"
