#!/usr/bin/env bash
# Dropout's draws, old tree against new, in one device run: the dropout GPU tests on this tree, then
# benchmarks/dropout_ab.py in alternating processes (new, old, old, new). The old tree is an export
# of the commit before the change in .baseline/src (carried, git-ignored):
#     rm -rf .baseline && mkdir .baseline && git archive 37f96dd~1 src | tar -x -C .baseline
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
SHARDS=8 FILTER='drop|turns_change|features' timeout ${TEST_SECONDS:-300} bash benchmarks/gpu_tests.sh \
  "$out/gpu_tests_dropout.txt" "tests/test_gpu_scores.py tests/test_gpu_forward.py tests/test_gpu_torch_registry.py" \
  > /dev/null 2>&1
tail -n 12 "$out/gpu_tests_dropout.txt"
round=0
for tree in new old old new; do
  round=$((round + 1))
  if [ "$tree" = new ]; then path=src; else path=.baseline/src; fi
  PYTHONPATH=$path timeout 150 python3 benchmarks/dropout_ab.py "$out/dropout_ab_${round}_$tree.json" "$tree"
done
