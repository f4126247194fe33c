"""``delta = rowsum(dO * O) - dlse`` for one query tile, in fp32: the dQ kernel's prologue.

``kernels/bwd.py`` has the algorithm; ``delta`` feeds ``dS = P * (dP - delta)`` in both gradient
kernels. The dQ kernel, which holds the tile's dO anyway, computes it from one more tile (O),
uses it at once and writes it with the LSE's strides for the dK/dV kernel, launched after it. A
separate pass would read O and dO once more and cost a launch. fp32 inputs sum in fp64 and round
once, like the fp64 ``dP`` of ``common.dot_nt``.
"""

import triton
import triton.language as tl

from flashcore.kernels.common import load_tile


@triton.jit
def tile_delta(
    o_ptrs,
    do,
    dlse_ptrs,
    offs_m,
    seqlen_q,
    offs_d,
    HEAD_DIM: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    HAS_DLSE: tl.constexpr,
):
    """``rowsum(dO * O) [- dlse]`` of a (BLOCK_M, BLOCK_D) tile; ``do`` is loaded, ``o_ptrs`` and
    ``dlse_ptrs`` (read by strides: the LSE's gradient may be a broadcast) point at its rows. Rows
    past ``seqlen_q`` get 0."""
    o = load_tile(o_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    if o.dtype == tl.float32 and do.dtype == tl.float32:
        # fp32 inputs: dP comes from an fp64 product rounded once (common.dot_nt); delta must be
        # rounded the same way, or dP - delta keeps a rounding residue where the two are equal
        # (one visible key: dS must be exactly 0, and was ~1 ulp).
        delta = tl.sum(o.to(tl.float64) * do.to(tl.float64), 1).to(tl.float32)
    else:
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        if EVEN_M:
            dlse = tl.load(dlse_ptrs)
        else:
            dlse = tl.load(dlse_ptrs, mask=offs_m < seqlen_q, other=0.0)
        delta -= dlse.to(tl.float32)
    return delta
