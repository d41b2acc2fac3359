"""Summarise Nsight Compute's per-instruction source page (SASS) by code region (no GPU needed).

    ncu --import report.ncu-rep --page source --csv --print-source sass > sass.csv
    python benchmarks/ncu_sass_regions.py sass.csv [top]

Runs of consecutive instructions with the same execution count are one region (a loop body, a
tile's prologue, a peeled block). Prints the warp-stall samples by execution count (what runs once
per tile, per block, per CTA), then each large region of the busiest counts with its instruction mix,
its stall reasons and its most-sampled instructions.
"""

import collections
import csv
import sys


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    rows = list(csv.reader(open(sys.argv[1])))
    header = rows[1]
    column = {name: i for i, name in enumerate(header)}
    stalls = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    instructions = [dict(address=r[column["Address"]], source=r[column["Source"]],
                         samples=number(r[column["Warp Stall Sampling (All Samples)"]]),
                         executed=number(r[column["Instructions Executed"]]),
                         stalls={name: number(r[column[name]]) for name in stalls})
                    for r in rows[2:] if len(r) >= len(header)]
    total = sum(i["samples"] for i in instructions)
    regions = []
    for i in instructions:
        if regions and regions[-1][-1]["executed"] == i["executed"]:
            regions[-1].append(i)
        else:
            regions.append([i])

    def reasons(group, count=4):
        sums = collections.Counter()
        for i in group:
            sums.update(i["stalls"])
        samples = max(sum(i["samples"] for i in group), 1)
        return ", ".join(f"{name[6:]} {value / samples:.0%}" for name, value in sums.most_common(count))

    by_count = collections.defaultdict(list)
    for region in regions:
        by_count[region[0]["executed"]].extend(region)
    print(f"{len(instructions)} instructions, {total:.0f} samples")
    busiest = sorted(by_count.items(), key=lambda kv: -sum(i["samples"] for i in kv[1]))[:12]
    for executed, group in busiest:
        samples = sum(i["samples"] for i in group)
        print(f"executed {executed:>9.0f}: {len(group):5d} instructions, {samples:7.0f} samples ({samples / total:5.1%}); "
              + reasons(group))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    counts = {executed for executed, _ in busiest[:6]}
    for region in regions:
        if region[0]["executed"] in counts and len(region) > 20:
            mix = collections.Counter(i["source"].split()[1 if i["source"].startswith("@") else 0] for i in region)
            print(f"\n{region[0]['address']}..{region[-1]['address']} executed {region[0]['executed']:.0f}, "
                  f"{len(region)} instructions, {sum(i['samples'] for i in region):.0f} samples: {reasons(region)}")
            print("  mix: " + ", ".join(f"{op} {n}" for op, n in mix.most_common(10)))
            for i in sorted(region, key=lambda i: -i["samples"])[:top]:
                print(f"  {i['address'][-6:]} {i['samples']:6.0f}  {i['source'][:80]}")


if __name__ == "__main__":
    main()
