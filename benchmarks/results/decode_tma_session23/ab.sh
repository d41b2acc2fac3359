set -e
for i in 1 2 3 4; do
  if [ $i = 1 ] || [ $i = 4 ]; then P=src; T=new; else P=.baseline/src; T=old; fi
  PYTHONPATH=$P python3 benchmarks/kvcache.py $OUT/kv_ab_${i}_$T.json --no-host > $OUT/kv_ab_${i}.log 2>&1
done
python3 - <<'PY'
import json, os, glob
out = os.environ["OUT"]
for f in sorted(glob.glob(out + "/kv_ab_*.json")):
    d = json.load(open(f))
    print(os.path.basename(f), " | ".join(f"{r['case']}: {r['fmha_us']:.2f}" for r in d["rows"]))
PY
