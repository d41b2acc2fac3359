"""flash_attn_with_kvcache on the GPU: GPU time (CUDA-graph replay, median) and K/V bandwidth for the
inference issue's decode cases, SDPA flash and cuDNN as peers where they can run the same problem,
a sweep of chunk counts and tiles, and host time per call.

    PYTHONPATH=src python benchmarks/kvcache.py [out.json] [--no-host]
        [--small-sweep [--tiles 128x8x3,...] [--shapes 8:2048,... --splits 1,2,...]]
    (--no-host: skip host time per call; --small-sweep: only the small cases, over more tiles and chunks;
    --tiles: the sweep's tiles as block_n x warps x stages, "p" after one for pointer loads only (no bulk
    copies), "t" for bulk copies wherever the cache allows them; --shapes: dense batch:length cases instead)

Cases (bf16, Hq/Hkv = 32/8, D = 128, one query per sequence):
* dense: B32, Sk 8192 (copy floor ~358 us at 3.0 TB/s);
* ragged: B32, cache_seqlens 1k-8k (mean 5.3k), a contiguous cache and paged caches of 256 and 16;
* small: B1 Sk4096 and B8 Sk2048, rotating over copies of the inputs so that the 50 MB L2 does
  not serve them (peers alike);
* decode step: dense B32 with a new key appended (and rotary) in the same call.
GB/s counts the K/V bytes each call must read once. The small cases also give the issue's bound,
"copy floor + one launch": K/V bytes at the device's copy rate plus the GPU time of one tiny
kernel replayed the same way (``launch_us``), and sweep tiles and chunk counts.
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

import fmha
from fmha import kvcache_ops
from fmha.backends.triton.config import KVCacheConfig, kvcache_config
from fmha.reference import dense_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_overhead import host_us_per_call  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
L2_BYTES = 50 * 2**20
RAGGED_SEED = 109  # torch.randint(1024, 8193, (32,)) with this seed: mean 5303, 1090..7973


def gpu_us(fn, rep=40) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def copy_tbps() -> float:
    """Device copy bandwidth, bytes read plus written (the ceiling of a streaming kernel)."""
    source = torch.empty(2**29, device="cuda", dtype=torch.uint8)
    target = torch.empty_like(source)
    ms = triton.testing.do_bench(lambda: target.copy_(source), rep=200, return_mode="median")
    return 2 * source.numel() / ms / 1e9


def launch_us() -> float:
    """GPU time of one launch of a one-element kernel, replayed as the cases are (CUDA graph, median)."""
    x = torch.zeros(1, device="cuda")
    return gpu_us(lambda: x.add_(1.0))


def paged(k_cache, v_cache, lengths, page_size, generator):
    """The same sequences in shuffled pages of ``page_size``: caches and block table."""
    batch, capacity = k_cache.shape[:2]
    blocks = -(-capacity // page_size)
    used = [-(-int(length) // page_size) for length in lengths]
    order = torch.randperm(sum(used), generator=generator).tolist()
    table = torch.zeros(batch, blocks, dtype=torch.int32)
    k_pages = torch.empty(sum(used), page_size, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_pages = torch.empty_like(k_pages)
    for b, count in enumerate(used):
        pages, order = order[:count], order[count:]
        table[b, :count] = torch.tensor(pages, dtype=torch.int32)
        span = count * page_size
        rows = torch.zeros(span, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        rows[:min(span, capacity)] = k_cache[b, :span]
        k_pages[pages] = rows.view(count, page_size, KV_HEADS, HEAD_DIM)
        rows[:min(span, capacity)] = v_cache[b, :span]
        v_pages[pages] = rows.view(count, page_size, KV_HEADS, HEAD_DIM)
    return k_pages, v_pages, table.cuda()


def max_error(out, q, k_cache, v_cache, lengths) -> float:
    """Max |fmha - float64| over the first two sequences (read from the contiguous cache)."""
    errors = []
    for b in range(min(2, len(lengths))):
        length = int(lengths[b])
        ref, _ = dense_attention(q[b:b + 1].transpose(1, 2), k_cache[b:b + 1, :length].transpose(1, 2),
                                 v_cache[b:b + 1, :length].transpose(1, 2))
        errors.append((out[b:b + 1].transpose(1, 2).double() - ref).abs().max().item())
    return max(errors)


def rotating(calls):
    """One call per invocation, cycling: a captured graph of n calls touches n different inputs."""
    state = {"next": 0}

    def run():
        call = calls[state["next"] % len(calls)]
        state["next"] += 1
        return call()
    return run


def sdpa_peers(q_sets, k_sets, v_sets) -> dict:
    """SDPA flash and cuDNN on the same (dense, BHSD) problem, rotating over the same copies."""
    results = {}
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        fn = rotating([lambda q=q, k=k, v=v: scaled_dot_product_attention(q, k, v, enable_gqa=True)
                       for q, k, v in zip(q_sets, k_sets, v_sets)])

        def run(fn=fn, backend=backend):
            with sdpa_kernel(backend):
                return fn()
        try:
            results[name] = gpu_us(run)
        except Exception as error:  # a peer that cannot take the shape
            results[name] = f"{type(error).__name__}: {str(error)[:100]}"
    return results


def config_text(args) -> str:
    forward = kvcache_ops.prepared("bench", args["q"], args["k_cache"], args["v_cache"], None, None, None, None,
                                   args["cache_seqlens"], None, None, args.get("block_table"), None, False, (-1, -1),
                                   0.0, True, None, 0)
    return forward.config.text()


def measure_case(label, batch, capacity, lengths, layout, copies, copy_rate, sweep, peers, launch=None):
    generator = torch.Generator().manual_seed(0)
    kv_bytes = 2 * int(sum(lengths)) * KV_HEADS * HEAD_DIM * 2
    sets = []
    for _ in range(copies):
        q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        k_cache, v_cache = (torch.randn(batch, capacity, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
                            for _ in range(2))
        args = dict(q=q, k_cache=k_cache, v_cache=v_cache,
                    cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device="cuda"))
        if layout != "contiguous":
            page_size = int(layout.removeprefix("page"))
            args["k_cache"], args["v_cache"], args["block_table"] = paged(k_cache, v_cache, lengths, page_size,
                                                                          generator)
        sets.append((args, k_cache, v_cache))
    first, k_contiguous, v_contiguous = sets[0]
    out = fmha.flash_attn_with_kvcache(**first)
    row = {"case": label, "batch": batch, "capacity": capacity, "layout": layout, "mean_length": sum(lengths) / batch,
           "kv_bytes": kv_bytes, "copies": copies,
           "max_error": max_error(out, first["q"], k_contiguous, v_contiguous, lengths),
           "config": config_text(first)}
    calls = [lambda args=args: fmha.flash_attn_with_kvcache(**args) for args, _, _ in sets]
    row["fmha_us"] = gpu_us(rotating(calls))
    row["fmha_GBps"] = kv_bytes / row["fmha_us"] / 1e3
    row["fraction_of_copy"] = row["fmha_GBps"] / (copy_rate * 1e3)
    if launch is not None:  # the bound for small batches
        # The same grid with every length 0: what a call costs besides streaming K/V (launch,
        # prologue, partial writes, the arrival count and the merge).
        empty = [{**args, "cache_seqlens": torch.zeros_like(args["cache_seqlens"])} for args, _, _ in sets]
        row["empty_lengths_us"] = gpu_us(rotating([lambda args=args: fmha.flash_attn_with_kvcache(**args)
                                                   for args in empty]))
        row["launch_us"] = launch
        row["floor_plus_launch_us"] = kv_bytes / (copy_rate * 1e6) + launch
        row["over_floor_plus_launch"] = row["fmha_us"] / row["floor_plus_launch_us"]
    if peers:
        q_sets = [args["q"].transpose(1, 2).contiguous() for args, _, _ in sets]
        k_sets = [k[:, :max(lengths)].transpose(1, 2).contiguous() for _, k, _ in sets]
        v_sets = [v[:, :max(lengths)].transpose(1, 2).contiguous() for _, _, v in sets]
        row.update(sdpa_peers(q_sets, k_sets, v_sets))
    if sweep:
        row["sweep"] = sweep_configs(sets, kv_bytes, sweep)
    return row


def sweep_configs(sets, kv_bytes, sweep) -> list:
    """GPU time per (tiles, chunk count), the heuristic's choice replaced for the measurement;
    ``sweep["repeats"]`` interleaved passes over all of them."""
    results = []
    for repeat in range(sweep.get("repeats", 1)):
        for block_n, num_warps, num_stages, *loads in sweep["tiles"]:
            for splits in sweep["splits"]:
                # "pointer": no bulk copies, where the heuristic's rule would take them for these chunks;
                # "bulk": bulk copies wherever the cache allows them (one loop, contiguous, 16-bit)
                entry = {"block_n": block_n, "num_warps": num_warps, "num_stages": num_stages, "splits": splits,
                         "repeat": repeat, "loads": loads[0] if loads else "heuristic"}

                def forced(params, multiprocessors, tiles=(block_n, num_warps, num_stages), splits=splits,
                           loads=entry["loads"]):
                    chosen = kvcache_config(dataclasses.replace(params, num_splits=splits), multiprocessors)
                    tma = {"pointer": False, "heuristic": chosen.tma}.get(loads, chosen.one_range and params.page_size == 0
                                                                         and params.dtype != torch.float32)
                    return KVCacheConfig(chosen.block_m, tiles[0], tiles[1], tiles[2], splits, chosen.one_range, tma)
                kvcache_ops.kvcache_config, original = forced, kvcache_ops.kvcache_config
                kvcache_ops.forget()
                try:
                    calls = [lambda args=args: fmha.flash_attn_with_kvcache(**args) for args, _, _ in sets]
                    if entry["loads"] == "bulk":  # a plan the heuristic never takes: check it first
                        args, k_cache, v_cache = sets[0]
                        entry["max_error"] = max_error(calls[0](), args["q"], k_cache, v_cache,
                                                       args["cache_seqlens"].tolist())
                    us = gpu_us(rotating(calls))
                    entry.update(us=us, GBps=kv_bytes / us / 1e3)
                except Exception as error:
                    entry["error"] = f"{type(error).__name__}: {str(error)[:100]}"
                finally:
                    kvcache_ops.kvcache_config = original
                    kvcache_ops.forget()
                results.append(entry)
    return results


def decode_step_us(copy_rate) -> dict:
    """Dense B32 Sk8192 with one new key appended in the same call: plain, causal, with rotary
    (causal or not), and rotary on a paged cache (page 16)."""
    batch, capacity = 32, 8192
    k_cache, v_cache = (torch.randn(batch, capacity, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k, v = (torch.randn(batch, 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
    angle = torch.rand(capacity, HEAD_DIM // 2, device="cuda") * 6.28
    cos, sin = angle.cos().to(DTYPE), angle.sin().to(DTYPE)
    seqlens = torch.full((batch,), capacity - 1, dtype=torch.int32, device="cuda")
    results = {}
    for name, rotary, causal in (("append", (), False), ("append_causal", (), True),
                                 ("append_rotary", (cos, sin), False), ("append_rotary_causal", (cos, sin), True)):
        results[f"{name}_us"] = gpu_us(lambda: fmha.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, *rotary,
                                                                           cache_seqlens=seqlens, causal=causal))
    results["attention_only_us"] = gpu_us(lambda: fmha.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                                             cache_seqlens=seqlens))
    k_pages, v_pages, table = paged(k_cache, v_cache, [capacity] * batch, 16, torch.Generator().manual_seed(1))
    del k_cache, v_cache
    results["append_rotary_causal_page16_us"] = gpu_us(lambda: fmha.flash_attn_with_kvcache(
        q, k_pages, v_pages, k, v, cos, sin, cache_seqlens=seqlens, block_table=table, causal=True))
    kv_bytes = 2 * batch * capacity * KV_HEADS * HEAD_DIM * 2
    results.update({name.replace("_us", "_GBps"): kv_bytes / us / 1e3 for name, us in list(results.items())})
    return results


def host_times() -> dict:
    """Host time per call (benchmarks/host_overhead.py's method) at the two small decode shapes."""
    results = {}
    for label, batch, length in (("decode B1 H32/8 Sk4096 D128", 1, 4096), ("decode B8 H32/8 Sk2048 D128", 8, 2048)):
        q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        k_cache, v_cache = (torch.randn(batch, length, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
                            for _ in range(2))
        k, v = (torch.randn(batch, 1, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(2))
        seqlens = torch.full((batch,), length - 1, dtype=torch.int32, device="cuda")
        q_bhsd, k_bhsd, v_bhsd = q.transpose(1, 2).contiguous(), k_cache.transpose(1, 2).contiguous(), \
            v_cache.transpose(1, 2).contiguous()

        def sdpa(backend):
            def run():
                with sdpa_kernel(backend):
                    return scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, enable_gqa=True)
            return run

        fns = {"fmha.flash_attn_with_kvcache": lambda: fmha.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                                                     cache_seqlens=seqlens),
               "fmha.flash_attn_with_kvcache + append": lambda: fmha.flash_attn_with_kvcache(
                   q, k_cache, v_cache, k, v, cache_seqlens=seqlens),
               "fmha.attention": lambda: fmha.attention(q_bhsd, k_bhsd, v_bhsd),
               "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
        for name, result in host_us_per_call(fns, rounds=5).items():
            results[f"{label} | {name}"] = result
    return results


def main():
    torch.manual_seed(0)
    copy_rate = copy_tbps()
    launch = launch_us()
    print(f"device copy: {copy_rate:.2f} TB/s (read + write); one launch {launch:.2f} us", flush=True)
    ragged = torch.randint(1024, 8193, (32,), generator=torch.Generator().manual_seed(RAGGED_SEED)).tolist()
    # The chunk count the heuristic gives up for ragged lengths (1: best on the dense case) beside its own.
    chunk_sweep = {"tiles": [(64, 4, 2)], "splits": [1, 6]}
    # Small batches: tiles and chunk counts around the heuristic's (block_n, warps, stages).
    small_tiles = [(64, 4, 3), (64, 4, 4), (128, 4, 3), (64, 8, 3)]
    cases = [
        ("dense B32 Sk8192", 32, 8192, [8192] * 32, "contiguous", 1, chunk_sweep, True),
        ("ragged B32 contiguous", 32, 8192, ragged, "contiguous", 1, chunk_sweep, False),
        ("ragged B32 page256", 32, 8192, ragged, "page256", 1, chunk_sweep, False),
        ("ragged B32 page16", 32, 8192, ragged, "page16", 1, chunk_sweep, False),
        ("small B1 Sk4096", 1, 4096, [4096], "contiguous", 16, {"tiles": small_tiles, "splits": [8, 12, 16]},
         True),
        ("small B8 Sk2048", 8, 2048, [2048] * 8, "contiguous", 4, {"tiles": small_tiles, "splits": [2, 4]},
         True),
    ]
    if "--small-sweep" in sys.argv:  # only the small cases, over more tiles and chunk counts
        wide = [(64, 4, 3), (64, 4, 4), (64, 4, 2), (32, 4, 3), (32, 4, 4), (32, 4, 2), (128, 4, 3)]
        if "--tiles" in sys.argv:  # e.g. --tiles 128x8x3,64x4x3 (block_n x warps x stages)
            # a trailing "p": pointer loads only (no bulk copies)
            # a trailing "t": bulk copies wherever the cache allows them, chunked tiles included
            wide = [tuple(int(x) for x in tile.rstrip("pt").split("x"))
                    + ({"p": ("pointer",), "t": ("bulk",)}.get(tile[-1], ()))
                    for tile in sys.argv[sys.argv.index("--tiles") + 1].split(",")]
        cases = [("small B1 Sk4096", 1, 4096, [4096], "contiguous", 16, {"tiles": wide, "splits": [8, 12, 16, 24, 32]},
                  False),
                 ("small B8 Sk2048", 8, 2048, [2048] * 8, "contiguous", 4, {"tiles": wide, "splits": [1, 2, 3, 4, 8]},
                  False)]
        if "--shapes" in sys.argv:  # e.g. --shapes 4:4096,16:2048 (batch:length) --splits 1,2,4
            splits = [int(x) for x in sys.argv[sys.argv.index("--splits") + 1].split(",")]
            cases = []
            for spec in sys.argv[sys.argv.index("--shapes") + 1].split(","):  # a trailing r: ragged 1k-capacity
                batch, length = (int(x) for x in spec.rstrip("r").split(":"))
                lengths = [length] * batch
                if spec.endswith("r"):
                    lengths = torch.randint(1024, length + 1, (batch,),
                                            generator=torch.Generator().manual_seed(RAGGED_SEED)).tolist()
                copies = max(2, -(-3 * 50 * 2**20 // (2 * batch * length * 8 * 128 * 2)))
                cases.append((f"small B{batch} Sk{length}{' ragged' if spec.endswith('r') else ''}", batch, length,
                              lengths, "contiguous", copies, {"tiles": wide, "splits": splits}, False))
    rows = []
    for label, batch, capacity, lengths, layout, copies, sweep, peers in cases:
        try:
            row = measure_case(label, batch, capacity, lengths, layout, copies, copy_rate, sweep, peers,
                               launch if label.startswith("small") else None)
        except Exception as error:  # keep the other cases' numbers
            print(f"{label}: {type(error).__name__}: {error}", flush=True)
            rows.append({"case": label, "error": f"{type(error).__name__}: {error}"})
            continue
        rows.append(row)
        best = min((entry for entry in row.get("sweep", []) if "us" in entry), key=lambda entry: entry["us"],
                   default=None)
        peer_text = "  ".join(f"{name} {row[name]:.1f}" for name in ("sdpa_flash", "sdpa_cudnn")
                              if isinstance(row.get(name), float))
        print(f"{label:<24} fmha {row['fmha_us']:7.1f} us {row['fmha_GBps']:6.0f} GB/s "
              f"({row['fraction_of_copy']:.0%} of copy) [{row['config']}] err {row['max_error']:.1e}  {peer_text}"
              + (f"  best sweep {best['us']:.1f} us (n{best['block_n']} w{best['num_warps']} s{best['num_stages']} "
                 f"x{best['splits']})" if best else "")
              + (f"  floor+launch {row['floor_plus_launch_us']:.1f} us ({row['over_floor_plus_launch']:.2f}x), "
                 f"empty lengths {row['empty_lengths_us']:.1f} us" if "floor_plus_launch_us" in row else ""), flush=True)
    for row in rows:  # the small cases' sweeps, fastest first
        if row.get("case", "").startswith("small") and row.get("sweep"):
            ranked = sorted((e for e in row["sweep"] if "us" in e), key=lambda e: e["us"])
            print(f"{row['case']} sweep: " + ", ".join(
                f"n{e['block_n']}w{e['num_warps']}s{e['num_stages']}x{e['splits']}"
                f"{ {'pointer': 'p', 'bulk': 't'}.get(e['loads'], '')} {e['us']:.1f}"
                f"{' err %.1e' % e['max_error'] if 'max_error' in e else ''}" for e in ranked[:16]),
                flush=True)
    small_only = "--small-sweep" in sys.argv
    step = {} if small_only else decode_step_us(copy_rate)
    print(f"decode step with append: {step}", flush=True)
    hosts = {} if "--no-host" in sys.argv or small_only else host_times()
    for name, result in hosts.items():
        print(f"host {name:<70} min {result['min_us']:6.1f} median {result['median_us']:6.1f} us", flush=True)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "fmha": fmha.__version__, "copy_TBps": copy_rate, "launch_us": launch, "ragged_lengths": ragged, "rows": rows,
            "decode_step": step, "host_us": hosts, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    values = {sys.argv.index(option) + 1 for option in ("--tiles", "--shapes", "--splits") if option in sys.argv}
    paths = [arg for index, arg in enumerate(sys.argv) if index and not arg.startswith("--") and index not in values]
    if paths:
        with open(paths[0], "w") as handle:
            json.dump(info, handle, indent=1)


if __name__ == "__main__":
    main()
