"""Compile the kernels for an sm_90a target offline and print ptxas's resource report.

No GPU is needed: Triton lowers to PTX and runs the ptxas it ships. This catches what the
interpreter accepts but the compiler rejects (tests/test_compile.py runs it), and the registers,
spill bytes and shared memory per config are the evidence behind the first backward configs in
``flashcore.tuning`` until a device run times them (compile-time facts, not timings).

    python scripts/ptxas_report.py                      # the configs fwd_config/bwd_config pick
    python scripts/ptxas_report.py --dtype fp16 --head-dim 128 --blocks 16,64,128,32 --warps 8

Each line is one kernel compiled for the worst case (causal, Sq and Sk not block multiples), or
with ``--full-even`` for the other end (no mask, lengths multiples of the blocks).
Run it with TRITON_INTERPRET unset: interpreted kernels cannot be compiled.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from flashcore.kernels import bwd, fwd
from flashcore.tuning import BwdConfig, bwd_config, fwd_config, head_block

POINTERS = {"LSE": "*fp32", "DELTA": "*fp32", "DLSE": "*fp32"}
SCALARS = {"sm_scale": "fp32", "qk_scale": "fp32"}


def compile_report(fn, dtype: str, head_dim: int, constexprs: dict, warps: int, stages: int):
    """Compile ``fn`` for sm_90a and return (registers, spill-store bytes, shared bytes)."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = POINTERS[name]
        elif name.isupper():
            signature[name] = f"*{dtype}"
        else:
            signature[name] = SCALARS.get(name, "i32")
    src = ASTSource(fn, signature, constexprs=constexprs)
    kernel = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        log = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return regs, spill, kernel.metadata.shared


def report(
    dtype: str, head_dim: int, cfg: BwdConfig, *, forward: bool = True, full_even: bool = False
) -> None:
    flags = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": head_block(head_dim),
        "IS_CAUSAL": not full_even,
        "EVEN_M": full_even,
        "EVEN_N": full_even,
        "UPCAST": False,
        "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
    }
    kernels = [
        ("delta", bwd.attn_bwd_preprocess_kernel, cfg.block_m2, 0, cfg.num_warps, cfg.num_stages),
        ("dkdv", bwd.attn_bwd_dkdv_kernel, cfg.block_m1, cfg.block_n1, cfg.num_warps,
         cfg.num_stages),
        ("dq", bwd.attn_bwd_dq_kernel, cfg.block_m2, cfg.block_n2, cfg.num_warps, cfg.num_stages),
    ]  # fmt: skip
    if forward:
        f = fwd_config(head_dim, 4 if dtype == "fp32" else 2, interpreted=False)
        kernels.insert(0, ("fwd", fwd.attn_fwd_kernel, f.block_m, f.block_n, f.num_warps,
                           f.num_stages))  # fmt: skip
    for name, fn, bm, bn, warps, stages in kernels:
        constexprs = {**flags, "HAS_DLSE": True, "BLOCK_M": bm, "BLOCK_N": bn}
        constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
        regs, spill, smem = compile_report(fn, dtype, head_dim, constexprs, warps, stages)
        tile = f"{bm:>3}x{bn:<3}" if bn else f"{bm:>3}    "
        print(
            f"{dtype:5} D={head_dim:<4} {name:5} {tile} warps={warps} stages={stages}  "
            f"regs={regs:<4} spill_bytes={spill:<6} smem={smem}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], action="append")
    parser.add_argument("--head-dim", type=int, action="append")
    parser.add_argument("--blocks", help="block_m1,block_n1,block_m2,block_n2 (default: tuning)")
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument(
        "--full-even", action="store_true", help="compile the non-causal, block-multiple variant"
    )
    args = parser.parse_args(argv)
    for dtype in args.dtype or ["fp16", "fp32"]:
        for head_dim in args.head_dim or [64, 128, 256]:
            if args.blocks:
                blocks = [int(b) for b in args.blocks.split(",")]
                cfg = BwdConfig(*blocks, num_warps=args.warps, num_stages=args.stages)
            else:
                elem_size = 4 if dtype == "fp32" else 2
                cfg = bwd_config(head_dim, elem_size, interpreted=False)
            report(dtype, head_dim, cfg, forward=not args.blocks, full_even=args.full_even)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
