import json, subprocess, sys, os
base = json.load(open("old_tree/case_new.json"))
variants = {
    "as is": {},
    "aligned q,v": {"views": [None, "permuted", None]},
    "k not permuted": {"views": ["unaligned", None, "unaligned"]},
    "no softcap": {"softcap": None},
    "no dropout": {"dropout_p": 0.0},
    "no window": {"left": None},
    "no backward": {"backward": False},
    "only q unaligned": {"views": ["unaligned", None, None]},
    "only v unaligned": {"views": [None, None, "unaligned"]},
    "D32": {"head_dim": 32},
}
for name, change in variants.items():
    case = {**base, **change}
    env = {**os.environ, "PYTHONPATH": "src", "CUDA_LAUNCH_BLOCKING": "1"}
    r = subprocess.run([sys.executable, "benchmarks/random_calls.py", "--replay", json.dumps(case)], env=env,
                       capture_output=True, text=True, timeout=60)
    text = r.stdout + r.stderr
    print(f"{name:20s} {'ILLEGAL' if 'illegal memory' in text else 'FAIL' if 'Error' in text else 'ok'}", flush=True)
