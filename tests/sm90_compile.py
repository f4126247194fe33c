"""Compile flashcore's kernels for Hopper (sm_90) on any machine; print one JSON line a variant.

Triton's wheel carries ptxas, so the whole pipeline (AST -> TTIR -> TTGIR -> LLVM -> PTX -> cubin)
runs without a GPU. Run without TRITON_INTERPRET (tests/test_compile_sm90.py starts it so).
"""

from __future__ import annotations

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashcore.ops.fwd import kernels
from flashcore.tuning import fwd_config, head_block

HOPPER = GPUTarget("cuda", 90, 32)
ELEM_SIZE = {"fp16": 2, "bf16": 2, "fp32": 4}

# (head_dim, dtype, causal, even)
FWD_VARIANTS = [
    (64, "fp16", False, True),
    (64, "fp16", True, False),
    (80, "bf16", True, False),
    (128, "fp16", False, True),
    (128, "bf16", True, True),
    (128, "fp16", True, False),
    (256, "bf16", True, False),
    (256, "fp16", False, True),
    (32, "fp32", True, False),
    (128, "fp32", False, True),
    (256, "fp32", True, False),
]


def aligned(kernel, consts: dict, sizes: tuple[str, ...] = ()) -> dict:
    """The specialisation a real launch gets: 16-byte aligned pointers, strides divisible by 16.

    Triton 3.6 specialises only divisibility by 16 (no longer ``== 1``), so this is what the GPU
    compiles for contiguous fp16 tensors with head dims that are multiples of 8.
    """
    names = [n for n in kernel.arg_names if n not in consts and n not in sizes]
    return {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def signature(kernel, consts: dict, pointers: dict, floats: tuple[str, ...]) -> dict:
    sig = {}
    for name in kernel.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_fwd(head_dim: int, dtype: str, causal: bool, even: bool) -> dict:
    kernel = kernels().attn_fwd_kernel
    cfg = fwd_config(head_dim, ELEM_SIZE[dtype], interpreted=False)
    consts = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": head_block(head_dim),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "IS_CAUSAL": causal,
        "EVEN_M": even,
        "EVEN_N": even,
        "UPCAST": False,
        "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }
    ptrs = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "O": f"*{dtype}", "LSE": "*fp32"}
    sizes = ("num_heads", "kv_group", "seqlen_q", "seqlen_k", "qk_scale")
    attrs = aligned(kernel, consts, sizes)
    src = ASTSource(kernel, signature(kernel, consts, ptrs, ("qk_scale",)), consts, attrs)
    compiled = triton.compile(
        src, target=HOPPER, options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    )
    return {
        "kernel": "attn_fwd",
        "variant": f"d{head_dim}-{dtype}-causal{int(causal)}-even{int(even)}",
        "shared": compiled.metadata.shared,
        "has_wgmma": "wgmma" in compiled.asm["ptx"],
        "async_copies": "cp.async" in compiled.asm["ptx"],
        "dtype": dtype,
    }


def main() -> int:
    for variant in FWD_VARIANTS:
        print(json.dumps(compile_fwd(*variant)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
