#!/usr/bin/env bash
# compute-sanitizer's four tools over every kernel family at small shapes (GPU). Run it again
# whenever a kernel changes.
#   PYTHONPATH=src bash benchmarks/sanitize.sh OUT_DIR
# Writes OUT_DIR/sanitize_<tool>_<family>.log and OUT_DIR/sanitize_summary.txt.
set -uo pipefail
out=${1:?usage: sanitize.sh OUT_DIR}
mkdir -p "$out"
here=$(dirname "$0")
families=${FAMILIES:-"hopper portable varlen split_kv naive ws_minimal tma_store_minimal"}

python3 "$here/sanitize.py" > "$out/sanitize_plain.log" 2>&1 || { tail -5 "$out/sanitize_plain.log"; exit 1; }  # compiles, outside the tools
summary="$out/sanitize_summary.txt"
{
    echo "# compute-sanitizer over fmha's kernels, $(date -u +%F)"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    compute-sanitizer --version | tail -1
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo
    printf '%-10s %-18s %s\n' tool family result
} > "$summary"
for tool in ${TOOLS:-memcheck synccheck initcheck racecheck}; do
    for family in $families; do
        log="$out/sanitize_${tool}_${family}.log"
        timeout 150 compute-sanitizer --tool "$tool" --print-limit 20 \
            python3 "$here/sanitize.py" --family "$family" > "$log" 2>&1
        rc=$?
        result=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1 | sed 's/^=* *//')
        wrong=$(grep -c "WRONG" "$log")
        printf '%-10s %-18s %s%s\n' "$tool" "$family" "${result:-no summary (exit code $rc)}" \
            "$([ "$wrong" -gt 0 ] && echo " ($wrong wrong results)")" >> "$summary"
    done
done
cat "$summary"
