"""Two bench.json files side by side: fmha's default path and SDPA cuDNN per case.

The default path's row is "fmha" (older trees called it "fmha_tuned", and their "fmha" row was the
portable kernel with heuristic tiles).

    python benchmarks/compare_bench.py old/bench.json new/bench.json
"""

import json
import sys


def default_path(rows: dict):
    return rows.get("fmha_tuned") or rows.get("fmha")


def rows(path):
    payload = json.load(open(path))
    table = {}
    for row in payload["rows"]:
        if row["status"] == "ok":
            table.setdefault(row["label"], {})[row["provider"]] = row["tflops"]
    return table


old, new = rows(sys.argv[1]), rows(sys.argv[2])
print(f"{'case':<36} {'old':>7} {'new':>7} {'new/old':>8} {'cuDNN old':>10} {'cuDNN new':>10}")
for label in new:
    o, n = default_path(old.get(label, {})), default_path(new[label])
    ratio = f"{n / o:8.3f}" if o and n else "       —"
    print(f"{label:<36} {o or 0:7.1f} {n or 0:7.1f} {ratio} {old.get(label, {}).get('sdpa_cudnn', 0):10.1f} "
          f"{new[label].get('sdpa_cudnn', 0):10.1f}")
