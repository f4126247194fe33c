"""Compile flashcore's kernels for Hopper (sm_90) on any machine; print one JSON line a variant.

Triton's wheel carries ptxas, so the whole pipeline (AST -> TTIR -> TTGIR -> LLVM -> PTX -> cubin)
runs without a GPU. Run without TRITON_INTERPRET (tests/test_compile_sm90.py starts it so).
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import sys

assert not os.environ.get("TRITON_INTERPRET"), "run without TRITON_INTERPRET"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from compile_shards import Shard, ptxas_sm90a  # noqa: E402
from flashcore.kernels import bwd, decode, fwd, probes  # noqa: E402
from flashcore.ops.bwd import d_panels  # noqa: E402
from flashcore.tuning import (  # noqa: E402
    bwd_config,
    decode_block_m,
    decode_combine_warps,
    decode_config,
    fwd_config,
    head_block,
)

HOPPER = GPUTarget("cuda", 90, 32)
ELEM_SIZE = {"fp16": 2, "bf16": 2, "fp32": 4}
FP32_POINTERS = {"LSE", "S", "P", "DELTA", "DLSE", "ALIBI", "SINKS", "O_PART", "LSE_PART"}
INT32_POINTERS = {"CU_Q", "CU_K", "SEQLENS", "BLOCK_TABLE"}
# Integer arguments that are sizes (or window sides, or the ALiBi slopes' batch stride, which is
# 0 or H), not strides: no divisibility is promised for them.
SIZES = {
    "num_heads", "kv_heads", "kv_group", "seqlen_q", "seqlen_k", "seqlen_cap", "block_size",
    "num_splits", "window_left", "window_right", "stride_ab", "total_q", "total_k", "num_blocks",
}  # fmt: skip
# Float scalar arguments.
FLOATS = {"softcap"}

# (head_dim, dtype, causal, even[, masks]); every forward variant is compiled with tensor
# descriptors and with plain pointers. ``masks`` turns on HAS_WINDOW, SOFTCAP, HAS_ALIBI and
# HAS_SINKS.
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
    (128, "bf16", True, False, True),
    (64, "fp16", False, True, True),
    (128, "fp32", False, False, True),
]
BWD_VARIANTS = [
    (64, "fp16", True, False),
    (80, "bf16", True, False),
    (128, "fp16", False, True),
    (128, "bf16", True, False),
    (256, "bf16", True, False),
    (128, "fp32", True, False),
    (128, "bf16", True, False, True),
    (64, "fp16", False, True, True),
]
# Short sequences (tuning picks other tiles up to 2048 queries): compiled with seqlen_q = 512, the
# forward both ways like FWD_VARIANTS.
SHORT_SEQLEN = 512
FWD_SHORT_VARIANTS = [
    (64, "fp16", True, True),
    (64, "bf16", False, False),
    (128, "bf16", True, False),
    (128, "fp16", False, True),
]
BWD_SHORT_VARIANTS = [(128, "bf16", True, False)]
# MLA head dims (Q/K 192 in 256-wide tiles, V 128): the backward's own tiles
# (tuning.bwd_config with head_dim_v), causal and ragged, and packed.
BWD_MLA_VARIANTS = [((192, "bf16", True, False), False), ((192, "fp16", False, True), True)]
MLA_HEAD_DIM_V = 128
# Packed variable-length batches (IS_VARLEN): plain pointers, never EVEN_M/EVEN_N.
FWD_VARLEN_VARIANTS = [(64, "bf16", False, False), (128, "fp16", True, False)]
BWD_VARLEN_VARIANTS = [(128, "bf16", True, False)]
# Packed queries against a paged cache (PAGED 1, 2, 3; kernels/fwd.py), causal, at the launcher's
# tiles for the paged-prefill shapes: 1024 queries (64x64 tiles) and 4096 (128x128), plus every
# score flag at 64x64. Compiled beside the dense varlen build of the same flags.
FWD_PAGED_VARIANTS = [
    ((128, "bf16", True, False), 1024),
    ((128, "bf16", True, False), 4096),
    ((128, "fp16", True, False, True), 1024),
]
PROBE_VARIANTS = [(64, "bf16", True, False), (128, "fp16", False, True)]
# Decode: (head_dim, dtype, kv_group * Sq, paged (False, True = PAGED 1, 2 or 3), split, score
# flags). Every variant is causal; with score flags it also compiles the sliding window, softcap,
# ALiBi and sinks.
DECODE_VARIANTS = [
    (128, "bf16", 4, False, True, False),
    (128, "bf16", 4, True, True, True),
    (128, "bf16", 4, 3, True, True),  # power-of-two pages smaller than the tile (PAGED 3)
    (128, "fp16", 8, True, False, True),
    (128, "bf16", 4, 2, True, False),  # pages of a multiple of the tile, no score flags
    (128, "fp16", 4, 3, True, False),
    (128, "bf16", 64, 3, True, True),  # a prefill chunk's 64-row tile over 16-key pages
    (64, "fp16", 1, False, False, False),
    (256, "bf16", 4, True, True, True),
    (128, "fp32", 4, True, True, True),
    (128, "bf16", 64, False, True, False),
]
PROBES = ("probe_scores_kernel",)


def compile_kernel(
    fn,
    consts: dict,
    dtype: str,
    options: dict,
    descriptors: dict | None = None,
    pointers: dict | None = None,
):
    """Compile ``fn`` with the specialisation a real launch of contiguous tensors gets.

    Triton 3.6 specialises integer and pointer arguments only on divisibility by 16 (no longer on
    ``== 1``): pointers are 16-byte aligned and strides of fp16 tensors with head dims that are
    multiples of 8 are divisible by 16. ``descriptors`` maps argument names to the tile shape of
    the tensor descriptor passed there instead of a pointer. ``pointers`` overrides the element
    type of pointer arguments (``{"O": "fp32"}``).
    """
    descriptors = descriptors or {}
    pointers = pointers or {}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            continue
        if name in descriptors:
            signature[name] = f"tensordesc<{dtype}{list(descriptors[name])}>"
            continue
        if name in pointers:
            signature[name] = f"*{pointers[name]}"
        elif name in INT32_POINTERS:
            signature[name] = "*i32"
        elif name.isupper():
            signature[name] = "*fp32" if name in FP32_POINTERS else f"*{dtype}"
        elif "scale" in name or name in FLOATS:
            signature[name] = "fp32"
            continue
        else:
            signature[name] = "i32"
        if name not in SIZES:
            attrs[(i,)] = [["tt.divisibility", 16]]
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, consts, attrs), target=HOPPER, options=options)


def fwd_consts(
    head_dim: int,
    dtype: str,
    causal: bool,
    even: bool,
    masks: bool = False,
    tma: bool = False,
    varlen: bool = False,
    seqlen_q: int = 1 << 30,
    head_dim_v: int | None = None,
):
    """Constexprs of a launch; without varlen the cu_seqlens pointers are None, as the launchers
    pass them (Triton specialises a None argument into a constexpr). ``seqlen_q`` picks the
    config as the launcher would for that query length (a short one as a small problem, whose
    tiles may differ; ``tma`` decides the loads either way)."""
    small = {"flops": 0} if seqlen_q <= SHORT_SEQLEN else {}
    cfg = fwd_config(
        head_dim, ELEM_SIZE[dtype], interpreted=False, seqlen_q=seqlen_q, causal=causal, **small
    )
    consts = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": head_block(head_dim),
        "HEAD_DIM_V": head_dim_v or head_dim,
        "BLOCK_DV": head_block(head_dim_v or head_dim),
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "IS_CAUSAL": causal,
        "HAS_WINDOW": masks,
        "SOFTCAP": masks,
        "HAS_ALIBI": masks,
        "EVEN_M": even,
        "EVEN_N": even,
        "UPCAST": False,
        "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
        "EXP_E": dtype == "fp32",
        "USE_TMA": tma,
        "IS_VARLEN": varlen,
        "HAS_SINKS": masks,
        "PAGED": False,
        "ALIGN": 1,
        **({} if varlen else {"CU_Q": None, "CU_K": None}),
        **({} if masks else {"SINKS": None}),
    }
    return consts, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def pipeline(ttgir: str, ptx: str) -> dict:
    """How the key loops move K/V: the depth of the (rows, D) shared buffers they copy into, the
    copy groups the deepest wait leaves in flight, and the integer divisions left in the PTX."""
    depths = re.findall(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x\d+x\d+x", ttgir)
    waits = re.findall(r"ttg\.async_wait[^{]*\{num = (\d+)", ttgir)
    return {
        "kv_buffers": max(map(int, depths), default=0),
        "copies_in_flight": max(map(int, waits), default=0),
        "divisions": len(re.findall(r"\b(?:div|rem)\.[su]32", ptx)),
    }


@functools.cache
def ptxas_resources(ptx: str) -> dict:
    """Registers per thread and spill bytes, as ptxas reports them for sm_90a (no driver needed).
    Cached by the PTX: the decode variants of one head dim and dtype share their combine kernels,
    assembled once (and kept: ``compile_shards.ptxas_sm90a``)."""
    log, _ = ptxas_sm90a(ptx, sass=False)
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_bytes": int(spills.group(1)) + int(spills.group(2)) if spills else None,
        "wgmma_serialized": "C7515" in log,
    }


def report(
    name: str,
    variant: tuple,
    compiled,
    tma: bool = False,
    varlen: bool = False,
    label: str | None = None,
    short: bool = False,
) -> dict:
    head_dim, dtype, causal, even, *masks = variant
    ptx = compiled.asm["ptx"]
    masked = "-masks" if any(masks) else ""
    masked += f"-sq{SHORT_SEQLEN}" if short else ""
    return {
        **ptxas_resources(ptx),
        "kernel": name,
        "variant": label
        or f"d{head_dim}-{dtype}-causal{int(causal)}-even{int(even)}-tma{int(tma)}{masked}"
        + ("-varlen" if varlen else ""),
        "masks": any(masks),
        "tma": tma,
        "varlen": varlen,
        "dtype": dtype,
        "shared": compiled.metadata.shared,
        "has_wgmma": "wgmma" in ptx,
        "has_mma": "wgmma" in ptx or "mma.sync" in ptx,
        "async_copies": "cp.async" in ptx,
        "bulk_tensor_copies": "cp.async.bulk.tensor" in ptx,
    }


def main() -> int:
    shard = Shard()
    fwd_variants = [(v, False) for v in FWD_VARIANTS] + [(v, True) for v in FWD_SHORT_VARIANTS]
    for (variant, short), tma in itertools.product(fwd_variants, (True, False)):
        if not shard.take():
            continue
        seqlen_q = SHORT_SEQLEN if short else 1 << 30
        consts, options = fwd_consts(*variant, tma=tma, seqlen_q=seqlen_q)
        rows, cols = (consts["BLOCK_M"], consts["BLOCK_N"]), consts["BLOCK_D"]
        descs = {"Q": rows[0], "K": rows[1], "V": rows[1], "O": rows[0]} if tma else {}
        descs = {name: (1, 1, r, cols) for name, r in descs.items()}
        compiled = compile_kernel(fwd.attn_fwd_kernel, consts, variant[1], options, descs)
        shard.emit(report("attn_fwd", variant, compiled, tma, short=short))
    for variant in FWD_VARLEN_VARIANTS:
        if not shard.take():
            continue
        consts, options = fwd_consts(*variant, varlen=True)
        compiled = compile_kernel(fwd.attn_fwd_kernel, consts, variant[1], options)
        shard.emit(report("attn_fwd", variant, compiled, varlen=True))
    for (variant, seqlen_q), paged in itertools.product(FWD_PAGED_VARIANTS, (0, 1, 2, 3)):
        if not shard.take():
            continue
        consts, options = fwd_consts(*variant, varlen=True, seqlen_q=seqlen_q)
        consts["PAGED"] = paged
        compiled = compile_kernel(fwd.attn_fwd_kernel, consts, variant[1], options)
        row = report("attn_fwd", variant, compiled, varlen=True)
        row["case"] = row["variant"] + f"-sq{seqlen_q}"
        row["variant"] = row["case"] + f"-paged{paged}"
        row["paged"] = paged
        row.update(pipeline(compiled.asm["ttgir"], compiled.asm["ptx"]))
        shard.emit(row)
    bwd_variants = (
        [(v, False, False) for v in BWD_VARIANTS]
        + [(v, True, False) for v in BWD_VARLEN_VARIANTS]
        + [(v, False, True) for v in BWD_SHORT_VARIANTS]
    )
    bwd_variants = [(v, varlen, short, None) for v, varlen, short in bwd_variants] + [
        (v, varlen, False, MLA_HEAD_DIM_V) for v, varlen in BWD_MLA_VARIANTS
    ]
    for variant, varlen, short, head_dim_v in bwd_variants:
        if not shard.take():
            continue
        head_dim, dtype, causal = variant[:3]
        seqlen_q = SHORT_SEQLEN if short else 1 << 30
        # The backward's column panels of Q/K (ops/bwd.py): 192 as 128 + 64 for 16-bit inputs.
        torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
        block_d, block_d2 = d_panels(head_dim, torch_dtype[dtype])
        cfg = bwd_config(
            max(head_dim, head_dim_v or 0), ELEM_SIZE[dtype], interpreted=False, causal=causal,
            seqlen_q=seqlen_q, head_dim_v=head_dim_v, panels=block_d2 > 0,
        )  # fmt: skip
        flags, _ = fwd_consts(*variant, varlen=varlen, head_dim_v=head_dim_v)
        flags["BLOCK_D"], flags["BLOCK_D2"] = block_d, block_d2
        dkdv_options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        dq_options = {"num_warps": cfg.dq_warps, "num_stages": cfg.dq_stages}
        blocks = {
            "attn_bwd_dkdv_kernel": (cfg.block_m1, cfg.block_n1, dkdv_options),
            "attn_bwd_dq_kernel": (cfg.block_m2, cfg.block_n2, dq_options),
        }
        for name, (bm, bn, options) in blocks.items():
            consts = {**flags, "HAS_DLSE": True, "BLOCK_M": bm, "BLOCK_N": bn, "ALIGN": 1}
            compiled = compile_kernel(getattr(bwd, name), consts, dtype, options)
            row = report(name, variant, compiled, varlen=varlen, short=short)
            if head_dim_v is not None:
                row["variant"] += f"-dv{head_dim_v}"
            row["head_dim_v"] = head_dim_v
            # Rows of the tile the kernel holds, the M of its products (wgmma takes 64 per
            # warpgroup; fewer go to mma.sync).
            row["tile_rows"] = bn if name == "attn_bwd_dkdv_kernel" else bm
            shard.emit(row)
    for name in PROBES:
        for variant in PROBE_VARIANTS:
            if not shard.take():
                continue
            consts, options = fwd_consts(*variant)
            # The probe forms its scores in natural units (flashcore.debug).
            consts["EXP_E"] = True
            compiled = compile_kernel(getattr(probes, name), consts, variant[1], options)
            shard.emit(report(name, variant, compiled))
    for variant in DECODE_VARIANTS:
        if not shard.take():
            continue
        head_dim, dtype, rows, paged, split, flags = variant
        block_m = decode_block_m(rows, 1)
        cfg = decode_config(
            head_dim, ELEM_SIZE[dtype], interpreted=False, paged=paged, rows=block_m,
            capacity=1 << 20,
        )  # fmt: skip
        consts = {
            "HEAD_DIM": head_dim,
            "BLOCK_D": head_block(head_dim),
            "HEAD_DIM_V": head_dim,
            "BLOCK_DV": head_block(head_dim),
            "BLOCK_M": block_m,
            "BLOCK_N": cfg.block_n,
            "EVEN_M": rows == block_m,
            "PAGED": paged,
            "IS_CAUSAL": True,
            "HAS_WINDOW": flags,
            "SOFTCAP": flags,
            "HAS_ALIBI": flags,
            "UPCAST": False,
            "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
            "EXP_E": dtype == "fp32",
            "HAS_SINKS": flags,
            **({} if flags else {"SINKS": None}),
        }
        options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        # The split path writes fp32 partials; one split writes the output dtype directly.
        pointers = {"O": "fp32"} if split else {}
        compiled = compile_kernel(decode.attn_decode_kernel, consts, dtype, options, None, pointers)
        label = f"d{head_dim}-{dtype}-rows{rows}-paged{int(paged)}-split{int(split)}" + (
            "" if flags else "-plain"
        )
        fields = (head_dim, dtype, True, rows == block_m)
        shard.emit(report("attn_decode", fields, compiled, label=label))
        if split:
            # The most splits (MAX_SPLITS) and 16, as decode's plans take them.
            for block_s in (64, 16):
                block_d = head_block(head_dim)
                consts = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "BLOCK_S": block_s}
                warps = decode_combine_warps(block_s, block_d)
                compiled = compile_kernel(
                    decode.attn_decode_combine_kernel, consts, dtype, {"num_warps": warps}
                )
                row = report(
                    "attn_decode_combine", fields, compiled, label=f"{label}-splits{block_s}"
                )
                shard.emit(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
