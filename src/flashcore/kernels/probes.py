"""The score stage of the forward kernel on its own, for ``flashcore.debug``.

``probe_scores_kernel`` writes ``S`` (fp32, ``(B, H, Sq, Sk)``) as ``attn_fwd_kernel``'s key loop
forms it, from the same helpers and flags: ``dot_nt`` and the launcher's score units,
``transform_scores`` (softcap, ALiBi), ``alibi_slope``, and ``kv_tile_range``'s split of the key
tiles. Tiles the forward computes without a mask (``[full_lo, full_hi)``) are written without
``mask_scores`` here too, the masked bands (``[lo, full_lo)`` and ``[full_hi, hi)``) through it, and
tiles the forward never visits as -inf. A finite score where the reference has -inf therefore
means the tile split called a tile full that is not (or the mask let a key through); a -inf where
the reference is finite means the range cut off visible keys. The other stages are probed with the
real kernel itself (``flashcore.debug``).

Grid: ``cdiv(Sq, BLOCK_M) * B * H`` programs (``common.program_tile``), query head h reading kv
head ``h // (H // Hkv)``. Flags as in ``kernels/fwd.py`` (IS_CAUSAL, HAS_WINDOW, SOFTCAP,
HAS_ALIBI, EVEN_M, UPCAST, DOT_PRECISION, EXP_E). The launcher passes natural units (EXP_E), so
``S`` is ``flashcore.reference.scores``' quantity.
"""

import triton
import triton.language as tl

from flashcore.kernels.common import (
    alibi_slope,
    dot_nt,
    kv_tile_range,
    load_tile,
    mask_scores,
    program_tile,
    transform_scores,
)


@triton.jit
def probe_scores_kernel(
    Q,
    K,
    S,
    ALIBI,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_sb,
    stride_sh,
    stride_sm,
    stride_ab,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    EVEN_M: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXP_E: tl.constexpr,
):
    tile_m, off_bh = program_tile(tl.cdiv(seqlen_q, BLOCK_M), False)
    start_m = tile_m * BLOCK_M
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    off_hk = off_h // kv_group
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm + offs_d
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    s_base = S + off_b * stride_sb + off_h * stride_sh + offs_m[:, None] * stride_sm
    slope = alibi_slope(ALIBI, off_b, off_h, stride_ab, HAS_ALIBI, EXP_E)
    lo, full_lo, full_hi, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW,
    )  # fmt: skip
    for start_n in range(0, seqlen_k, BLOCK_N):
        cols = start_n + offs_n
        k = load_tile(
            k_base + cols[:, None] * stride_kn + offs_d, cols, seqlen_k, offs_d, HEAD_DIM, False,
            EVEN_D,
        )  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
        s = dot_nt(q, k, DOT_PRECISION) * qk_scale
        s, _t = transform_scores(
            s, offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, softcap, slope, SOFTCAP,
            HAS_ALIBI, k.dtype != tl.float32,
        )  # fmt: skip
        if (start_n < full_lo) | (start_n >= full_hi):
            s = mask_scores(
                s, offs_m, cols, seqlen_q, seqlen_k, window_left, window_right, IS_CAUSAL,
                HAS_WINDOW, True,
            )  # fmt: skip
        if (start_n < lo) | (start_n >= hi):
            s = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
        inside = (offs_m[:, None] < seqlen_q) & (cols[None, :] < seqlen_k)
        tl.store(s_base + cols[None, :], s, mask=inside)
