#!/usr/bin/env bash
# GPU correctness run (device): the `gpu`-marked tests, summary written to $1 (default: stdout only).
set -o pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
out=${1:-/dev/null}
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_forward.py -rfE 2>&1 | tee "$out"
