"""Two bench.json files side by side: fmha's default path (fmha_tuned) and SDPA cuDNN per case.

    python benchmarks/compare_bench.py old/bench.json new/bench.json
"""

import json
import sys


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
    o, n = old.get(label, {}).get("fmha_tuned"), new[label].get("fmha_tuned")
    ratio = f"{n / o:8.3f}" if o and n else "       —"
    print(f"{label:<36} {o or 0:7.1f} {n or 0:7.1f} {ratio} {old.get(label, {}).get('sdpa_cudnn', 0):10.1f} "
          f"{new[label].get('sdpa_cudnn', 0):10.1f}")
