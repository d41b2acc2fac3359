#!/usr/bin/env bash
# The foundation refactor, old tree against new, in one device run: host overhead per call (interleaved
# within each tree's run) and the seeds/std forward bench (default path vs SDPA flash and cuDNN).
# The old tree is an export of the commit before the refactor in .baseline/src (carried, git-ignored).
set -o pipefail
export PYTHONUNBUFFERED=1 COLUMNS=200
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/foundation_env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/foundation_env.txt"
for round in 1 2; do
  PYTHONPATH=.baseline/src python3 benchmarks/host_overhead.py "$out/host_old_$round.json" | tee "$out/host_old_$round.txt"
  PYTHONPATH=src python3 benchmarks/host_overhead.py "$out/host_new_$round.json" | tee "$out/host_new_$round.txt"
done
PYTHONPATH=.baseline/src python3 -m fmha.cli bench --suite seeds std --providers fmha_tuned sdpa_flash sdpa_cudnn \
  --out "$out/bench_old" > "$out/bench_old.log" 2>&1
PYTHONPATH=src python3 -m fmha.tools.cli bench --suite seeds std --providers fmha sdpa_flash sdpa_cudnn \
  --out "$out/bench_new" > "$out/bench_new.log" 2>&1
PYTHONPATH=src python3 benchmarks/compare_bench.py "$out/bench_old/bench.json" "$out/bench_new/bench.json" | tee "$out/bench_compare.txt"
mkdir -p "$out/pack" && cp "$out"/host_*.txt "$out/bench_compare.txt" "$out/foundation_env.txt" "$out/pack/" \
  && cp "$out/bench_old/bench.json" "$out/pack/bench_old.json" && cp "$out/bench_new/bench.json" "$out/pack/bench_new.json" \
  && cp "$out/bench_old.log" "$out/bench_new.log" "$out/pack/" && tar czf "$out/foundation_ab.tgz" -C "$out/pack" .
