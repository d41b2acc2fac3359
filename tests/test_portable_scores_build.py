"""The portable forward's score features without a GPU: what they compile to for sm_90.

The softcap's ``tanh.approx.f32`` runs only on NVIDIA GPUs (the interpreter takes the exact formula),
so this is where the CPU sees it build. Each variant is built for sm_90 in a child process without
TRITON_INTERPRET (bf16, causal, head dim 128, the H100's 128 x 64 tiles) and its SASS is read back.
"""

from .helpers import build_report

_BUILD_SCRIPT = r"""
import json, re, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from triton.tools.disasm import path_to_cuobjdump
from fmha.backends.triton.config import ForwardConfig
from fmha.backends.triton.forward import attention_forward_kernel
from fmha.backends.triton.scores import FAST_TANH
from fmha.params import attention_params
from fmha.backends.triton.launch import PortableForward

POINTERS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Lse": "*fp32"}
FLOATS = ("qk_scale", "softcap_scale", "dropout_scale")

report = {}
for name, options in json.loads(sys.argv[1]):
    q = torch.empty(4, 16, 4096, 128, dtype=torch.bfloat16, device="meta")
    forward = PortableForward(attention_params("build", q, q, q, causal=True, **options), ForwardConfig(128, 64, 8, 4))
    constants = dict(forward.constants)
    if constants["SOFTCAP"] and name != "softcap_exact":
        constants["SOFTCAP"] = FAST_TANH  # what the launcher picks for 16-bit inputs on an NVIDIA GPU
    pointers = dict(POINTERS, RngState="*i64") if constants["DROPOUT"] else POINTERS
    # Specialised as the JIT specialises a contiguous call: ints of 1 are constants, other
    # integers (strides, lengths, 0 for the features that are off) and the pointers 16-divisible.
    signature, values, attrs = {}, dict(constants), {}
    for index, arg in enumerate(attention_forward_kernel.arg_names):
        integer = arg.startswith(("stride_", "num_", "seqlen_")) or arg in ("lo", "hi", "dropout_threshold")
        if arg in constants or not (arg in pointers or integer or arg in FLOATS or arg == "group_size"):
            signature[arg] = "constexpr"
            values.setdefault(arg, None)  # descriptors and the tensors of features that are off
        elif arg == "group_size" or arg.startswith("stride_") and arg.endswith("d"):
            signature[arg], values[arg] = "constexpr", 1
        else:
            signature[arg] = pointers.get(arg, "fp32" if arg in FLOATS else "i32")
            if arg in pointers or integer and arg != "dropout_threshold":
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(attention_forward_kernel, signature, values, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=8, num_stages=4, enable_fp_fusion=True))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(compiled.asm["cubin"])
        handle.flush()
        sass = subprocess.check_output([path_to_cuobjdump(), "-sass", handle.name], text=True)
    report[name] = {"mufu": {op: sass.count(f"MUFU.{op}") for op in ("TANH", "EX2", "RCP")},
                    "shared": compiled.metadata.shared}
print(json.dumps(report))
"""

VARIANTS = [("plain", {}), ("softcap", {"softcap": 30.0}), ("softcap_exact", {"softcap": 30.0}),
            ("dropout", {"dropout_p": 0.1})]


def test_score_features_compile_to_their_cheap_forms_for_sm90():
    builds = build_report(_BUILD_SCRIPT, VARIANTS)
    plain, softcap, dropout = builds["plain"], builds["softcap"], builds["dropout"]
    # One MUFU.TANH per score, and no division: the softmax's exponentials are the plain forward's.
    assert softcap["mufu"]["TANH"] > 0 and plain["mufu"]["TANH"] == 0
    assert softcap["mufu"]["EX2"] == plain["mufu"]["EX2"] and softcap["mufu"]["RCP"] == plain["mufu"]["RCP"]
    # The exact tanh (float32 inputs, other GPUs) builds too: an exponential and a reciprocal per
    # score beside its polynomial, no MUFU.TANH.
    exact = builds["softcap_exact"]["mufu"]
    assert exact["TANH"] == 0 and exact["EX2"] > plain["mufu"]["EX2"] and exact["RCP"] > plain["mufu"]["RCP"]
    # The keep pattern is made in the probabilities' registers: no shared-memory exchange.
    assert dropout["shared"] == plain["shared"]
