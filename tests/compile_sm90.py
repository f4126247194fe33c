"""Compile flashcore's kernels for sm_90 (H100) on any machine, GPU or not.

Triton's interpreter, which runs the CPU tests, does not apply the compiler's rules (for example,
a global read inside a kernel must be a ``tl.constexpr(...)``), so a kernel can pass every CPU test
and still fail to compile on the GPU. This compiles each kernel through ``triton.compile`` for a
fixed target with the ptxas shipped in the triton wheel; no driver is needed. Run it in a process
without TRITON_INTERPRET (``tests/test_compile.py`` does). Prints one line per kernel.
"""

from __future__ import annotations

import os
import sys

assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashcore.kernels import fwd, probes  # noqa: E402
from flashcore.tuning import fwd_config, head_block  # noqa: E402

KERNELS = {
    "attn_fwd_kernel": fwd.attn_fwd_kernel,
    "probe_scores_kernel": probes.probe_scores_kernel,
    "probe_probs_kernel": probes.probe_probs_kernel,
    "probe_uniform_pv_kernel": probes.probe_uniform_pv_kernel,
}
FP32_OUTPUTS = {"LSE", "S", "P"}


def compile_sm90(fn, *, dtype: str, head_dim: int, causal: bool, even: bool):
    cfg = fwd_config(head_dim, 4 if dtype == "fp32" else 2, interpreted=False)
    constexprs = {
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
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.isupper():
            signature[name] = "*fp32" if name in FP32_OUTPUTS else f"*{dtype}"
        else:
            signature[name] = "fp32" if "scale" in name else "i32"
    missing = [n for n in fn.arg_names if n.isupper() and n not in signature]
    assert not missing, f"unknown constexprs {missing}"
    constants = {(fn.arg_names.index(k),): v for k, v in constexprs.items() if k in fn.arg_names}
    src = ASTSource(fn, signature, constants)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> int:
    names = sys.argv[1:] or list(KERNELS)
    for name in names:
        for dtype, head_dim, causal, even in [
            ("bf16", 64, True, False),
            ("fp16", 128, False, True),
        ]:
            kernel = compile_sm90(
                KERNELS[name], dtype=dtype, head_dim=head_dim, causal=causal, even=even
            )
            print(
                f"{name} {dtype} D={head_dim} causal={causal} even={even}: "
                f"shared {kernel.metadata.shared} B, warps {kernel.metadata.num_warps}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
