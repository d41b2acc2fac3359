"""The KV-cache kernel without a GPU: what its decode builds compile to for sm_90.

Tensor descriptors take the interpreter's path on the CPU, so this is where the CPU sees the bulk
copies build. Each decode plan of an H100 (bf16, Hq/Hkv 32/8, D 128, 132 multiprocessors) is built
for sm_90 in a child process without TRITON_INTERPRET, specialised as the JIT specialises a
contiguous call, and its SASS is read back.
"""

from .helpers import build_report

_BUILD_SCRIPT = r"""
import json, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.disasm import path_to_cuobjdump
from triton.tools.tensor_descriptor import TensorDescriptor
from fmha.backends.triton.config import kvcache_config
from fmha.backends.triton.kvcache import kvcache_attention_kernel
from fmha.backends.triton.kvcache_launch import KVCacheForward, _rows_view
from fmha.kvcache_params import kvcache_params, paged_varlen_params

report = {}
for name, spec in json.loads(sys.argv[1]):
    # spec: [batch, capacity] of a bf16 Hq/Hkv 32/8 D128 decode, or a dict: a paged varlen call
    # (flash_attn_varlen_func with block_table) of max_seqlen_q queries over pages of page_size.
    if isinstance(spec, list):
        batch, capacity = spec
        q = torch.empty(batch, 1, 32, 128, dtype=torch.bfloat16, device="meta")
        cache = torch.empty(batch, capacity, 8, 128, dtype=torch.bfloat16, device="meta")
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device="meta")
        params = kvcache_params("build", q, cache, cache, None, None, None, None, seqlens, None, None, None, None,
                                False, (-1, -1), 0.0, False, None, 0)
        table = None
    else:
        dtype, batch, head_dim = getattr(torch, spec["dtype"]), spec["batch"], spec["head_dim"]
        q = torch.empty(batch * spec["max_seqlen_q"], spec["q_heads"], head_dim, dtype=dtype, device="meta")
        pages = batch * spec["blocks"]
        cache = torch.empty(pages, spec["page_size"], spec["kv_heads"], head_dim, dtype=dtype, device="meta")
        table = torch.empty(batch, spec["blocks"], dtype=torch.int32, device="meta")
        cu_seqlens = torch.empty(batch + 1, dtype=torch.int32, device="meta")
        params = paged_varlen_params("build", q, cache, cache, cu_seqlens, cu_seqlens, spec["max_seqlen_q"], table,
                                     None, spec["causal"], (-1, -1), 0.0, None)
    config = kvcache_config(params, 132)
    forward = KVCacheForward(params, config)
    forward._prepare(q, cache, cache, None, None, None, None, table, None, None)
    launch = forward.attend_launch
    split = forward.splits > 1
    present = {"Q", "KCache", "VCache", "Out", "Lse", "CacheSeqlens"} | (
        {"PartialOut", "PartialLse", "Arrivals"} if split else set()) | (
        {"BlockTable", "CuSeqlensQ"} if table is not None else set())
    element = {torch.bfloat16: "*bf16", torch.float16: "*fp16"}[q.dtype]
    pointer_types = {"CacheSeqlens": "*i32", "Arrivals": "*i32", "Lse": "*fp32", "PartialOut": "*fp32",
                     "PartialLse": "*fp32", "BlockTable": "*i32", "CuSeqlensQ": "*i32"}
    names = kvcache_attention_kernel.arg_names
    per_call = len(names) - len(launch.fixed) - len(launch.constants)
    values = dict(zip(names[per_call:], (*launch.fixed, *launch.constants.values())))
    signature, constants, attrs = {}, {}, {}
    for index, arg in enumerate(names):
        if arg in launch.constants:
            signature[arg], constants[arg] = "constexpr", launch.constants[arg]
        elif arg in ("KDescriptor", "VDescriptor"):
            if launch.constants["TMA"]:
                signature[arg] = mangle_type(TensorDescriptor(cache, *_rows_view(cache), [config.block_n, 128]))
            else:
                signature[arg], constants[arg] = "constexpr", None
        elif index < per_call and arg != "cache_seqlen":
            if arg in present:
                signature[arg] = pointer_types.get(arg, element)
                attrs[(index,)] = [["tt.divisibility", 16]]
            else:
                signature[arg], constants[arg] = "constexpr", None
        elif arg == "cache_seqlen":
            signature[arg] = "i32"
        elif isinstance(values[arg], float):
            signature[arg] = "fp32"
        elif values[arg] == 1:
            signature[arg], constants[arg] = "constexpr", 1
        else:
            signature[arg] = "i32"
            if values[arg] % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(kvcache_attention_kernel, signature, constants, attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        sass = subprocess.check_output([path_to_cuobjdump(), "-sass", handle.name], text=True)
    report[name] = {"tma": launch.constants["TMA"], "splits": forward.splits, "block_m": config.block_m,
                    "block_n": config.block_n, "stages": config.num_stages,
                    "bulk_loads": sass.count("UTMALDG"), "global_loads": sass.count("LDG")}
print(json.dumps(report))
"""

DECODE_PLANS = [("B8 Sk2048", (8, 2048)), ("B1 Sk4096", (1, 4096)), ("B32 Sk8192", (32, 8192))]


def test_small_decode_builds_read_the_cache_with_bulk_copies_for_sm90():
    """B8 Sk2048 (one chunk per KV head) reads K and V with bulk copies, and keeps pointer loads for
    sequences shorter than a block; chunked tiles (B1) and full grids (B32) read with pointer loads."""
    builds = build_report(_BUILD_SCRIPT, DECODE_PLANS)
    small, chunked, full = builds["B8 Sk2048"], builds["B1 Sk4096"], builds["B32 Sk8192"]
    assert small["tma"] and small["splits"] == 1 and small["block_n"] == 128
    assert small["bulk_loads"] >= 2 and small["global_loads"] > 0
    for build in (chunked, full):
        assert not build["tma"] and build["splits"] > 1 and build["bulk_loads"] == 0


def _paged_prefill(page_size, causal):
    return dict(dtype="float16", batch=2, max_seqlen_q=300, q_heads=8, kv_heads=2, head_dim=32,
                page_size=page_size, blocks=-(-700 // page_size), causal=causal)


def test_paged_prefill_tiles_at_head_dim_32_build_for_sm90():
    """128-row tiles of fp16 queries over paged caches at D = 32: with three stages, the ptxas of
    Triton 3.6 crashed building them (a random call on the H100); the plan takes two."""
    plans = [(f"page {page_size}{' causal' if causal else ''}", _paged_prefill(page_size, causal))
             for page_size, causal in ((16, False), (16, True), (1, False))]
    for build in build_report(_BUILD_SCRIPT, plans).values():
        assert build["block_m"] == 128 and build["stages"] == 2 and build["global_loads"] > 0
