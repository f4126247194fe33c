"""Isolation probes: one stage of the forward kernel at a time, built from the same helpers.

Each probe runs one stage of ``attn_fwd_kernel`` with the very helpers of ``common.py``
(``load_tile``, ``kv_tile_range``, ``mask_scores``, ``online_softmax_step``, ``store_tile``) and
writes out what that stage computed, so a wrong result points at one stage instead of "attention
is wrong". Launchers and documentation: ``flashcore.debug``.

- ``probe_scores_kernel``: ``S = scale * Q @ K^T`` in fp32, -inf where a key is hidden. Key tiles
  are classified by ``kv_tile_range`` exactly as the forward kernel does: tiles before ``full_hi``
  are computed WITHOUT ``mask_scores``, tiles in ``[full_hi, hi)`` with it, and tiles past ``hi``
  are never computed but written as -inf. A finite score where the reference has -inf therefore
  means ``kv_tile_range`` called a tile full that is not (or ``mask_scores`` let a key through); a
  -inf where the reference is finite means the range cut off visible keys.
- ``probe_probs_kernel``: the normalised softmax ``P`` and the LSE. Pass 1 streams the key tiles
  through ``online_softmax_step`` (full tiles without the empty-row guard, masked tiles with it,
  as in the forward kernel) to get the row max ``m`` and sum ``l``; pass 2 recomputes the scores
  and writes ``exp2(s - m) / l``. Works in log2 units (``scale * log2(e)`` folded), like the
  forward kernel; the LSE is stored in natural-log units.
- ``probe_uniform_pv_kernel``: ``P @ V`` for uniform scores (every visible score 0), i.e. the mean
  of the V rows a query sees. It is the forward kernel's accumulate path (``online_softmax_step``'s
  rescale and the second ``tl.dot``) with ``Q @ K^T`` taken out.

Grid: ``(cdiv(Sq, BLOCK_M), B * H)`` for all three, as in the forward kernel; query head h reads
kv head ``h // (H // Hkv)``. Flags as in ``fwd.py``: IS_CAUSAL (bottom-right aligned), EVEN_M /
EVEN_N (no row masks on loads and stores), UPCAST (fp32 copies of the tiles; only for bf16 under
Triton 3.6's interpreter), DOT_PRECISION ("ieee" for fp32 inputs). Rows that see no key: P = 0,
LSE = -inf, uniform P @ V = 0.
"""

import triton
import triton.language as tl

from flashcore.kernels.common import (
    dot_nt,
    kv_tile_range,
    load_tile,
    mask_scores,
    online_softmax_step,
    row_lse,
    store_tile,
)


@triton.jit
def _score_tile(
    q,
    k_ptrs,
    cols,
    offs_m,
    offs_d,
    seqlen_q,
    seqlen_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """A (BLOCK_M, BLOCK_N) tile of scaled scores, as the forward kernel's key loop computes it."""
    # Full tiles lie inside Sk by construction; only the masked tail can run past it.
    k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N or not MASKED, EVEN_D)
    if UPCAST:
        k = k.to(tl.float32)
    s = dot_nt(q, k, DOT_PRECISION) * qk_scale
    if MASKED:
        s = mask_scores(s, offs_m, cols, seqlen_q, seqlen_k, 0, 0, IS_CAUSAL, False, not EVEN_N)
    return s


@triton.jit
def _store_scores(
    ptrs, s, offs_m, cols, seqlen_q, seqlen_k, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr
):
    """Store an fp32 (BLOCK_M, BLOCK_N) tile of an (Sq, Sk) matrix, skipping rows/cols outside."""
    if EVEN_M and EVEN_N:
        tl.store(ptrs, s)
    else:
        tl.store(ptrs, s, mask=(offs_m[:, None] < seqlen_q) & (cols[None, :] < seqlen_k))


@triton.jit
def _visited_end(full_hi, hi, BLOCK_N: tl.constexpr):
    """End of the last key tile the forward kernel visits: tiles from here on are never loaded."""
    return full_hi + (hi - full_hi + BLOCK_N - 1) // BLOCK_N * BLOCK_N


@triton.jit
def probe_scores_kernel(
    Q,
    K,
    S,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_sb,
    stride_sh,
    stride_sm,
    stride_sn,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    off_hk = off_h // kv_group
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = (
        Q
        + off_b * stride_qb
        + off_h * stride_qh
        + (offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    )
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    s_base = S + off_b * stride_sb + off_h * stride_sh + offs_m[:, None] * stride_sm

    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)

    _lo, _full_lo, full_hi, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, 0, 0, BLOCK_M, BLOCK_N, IS_CAUSAL, False
    )
    for start_n in range(0, full_hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + (cols[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        s = _score_tile(
            q, k_ptrs, cols, offs_m, offs_d, seqlen_q, seqlen_k, scale,
            HEAD_DIM, EVEN_D, IS_CAUSAL, False, EVEN_N, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        _store_scores(
            s_base + cols[None, :] * stride_sn, s, offs_m, cols, seqlen_q, seqlen_k, EVEN_M, True
        )
    for start_n in range(full_hi, hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + (cols[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        s = _score_tile(
            q, k_ptrs, cols, offs_m, offs_d, seqlen_q, seqlen_k, scale,
            HEAD_DIM, EVEN_D, IS_CAUSAL, True, EVEN_N, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        _store_scores(
            s_base + cols[None, :] * stride_sn, s, offs_m, cols, seqlen_q, seqlen_k, EVEN_M, EVEN_N
        )
    hidden = tl.full([BLOCK_M, BLOCK_N], float("-inf"), dtype=tl.float32)
    for start_n in range(_visited_end(full_hi, hi, BLOCK_N), seqlen_k, BLOCK_N):
        cols = start_n + offs_n
        _store_scores(
            s_base + cols[None, :] * stride_sn,
            hidden,
            offs_m,
            cols,
            seqlen_q,
            seqlen_k,
            EVEN_M,
            EVEN_N,
        )


@triton.jit
def probe_probs_kernel(
    Q,
    K,
    P,
    LSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_pb,
    stride_ph,
    stride_pm,
    stride_pn,
    stride_lb,
    stride_lh,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    off_hk = off_h // kv_group
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    q_ptrs = (
        Q
        + off_b * stride_qb
        + off_h * stride_qh
        + (offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    )
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    p_base = P + off_b * stride_pb + off_h * stride_ph + offs_m[:, None] * stride_pm

    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)

    # Pass 1: row max and row sum, with the forward kernel's split and calls.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    _lo, _full_lo, full_hi, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, 0, 0, BLOCK_M, BLOCK_N, IS_CAUSAL, False
    )
    for start_n in range(0, full_hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + (cols[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        s = _score_tile(
            q, k_ptrs, cols, offs_m, offs_d, seqlen_q, seqlen_k, qk_scale,
            HEAD_DIM, EVEN_D, IS_CAUSAL, False, EVEN_N, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        _, _, m_i, l_i = online_softmax_step(s, m_i, l_i, False, False)
    for start_n in range(full_hi, hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + (cols[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        s = _score_tile(
            q, k_ptrs, cols, offs_m, offs_d, seqlen_q, seqlen_k, qk_scale,
            HEAD_DIM, EVEN_D, IS_CAUSAL, True, EVEN_N, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        _, _, m_i, l_i = online_softmax_step(s, m_i, l_i, True, False)

    empty = l_i == 0.0
    m_ref = tl.where(empty, 0.0, m_i)
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    lse = row_lse(m_i, l_i, False)

    # Pass 2: normalised probabilities from the final m and l.
    for start_n in range(0, full_hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + (cols[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        s = _score_tile(
            q, k_ptrs, cols, offs_m, offs_d, seqlen_q, seqlen_k, qk_scale,
            HEAD_DIM, EVEN_D, IS_CAUSAL, False, EVEN_N, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        p = tl.math.exp2(s - m_ref[:, None]) * inv_l[:, None]
        _store_scores(
            p_base + cols[None, :] * stride_pn, p, offs_m, cols, seqlen_q, seqlen_k, EVEN_M, True
        )
    for start_n in range(full_hi, hi, BLOCK_N):
        cols = start_n + offs_n
        k_ptrs = k_base + (cols[:, None] * stride_kn + offs_d[None, :] * stride_kd)
        s = _score_tile(
            q, k_ptrs, cols, offs_m, offs_d, seqlen_q, seqlen_k, qk_scale,
            HEAD_DIM, EVEN_D, IS_CAUSAL, True, EVEN_N, UPCAST, DOT_PRECISION,
        )  # fmt: skip
        p = tl.math.exp2(s - m_ref[:, None]) * inv_l[:, None]
        _store_scores(
            p_base + cols[None, :] * stride_pn, p, offs_m, cols, seqlen_q, seqlen_k, EVEN_M, EVEN_N
        )
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start_n in range(_visited_end(full_hi, hi, BLOCK_N), seqlen_k, BLOCK_N):
        cols = start_n + offs_n
        _store_scores(
            p_base + cols[None, :] * stride_pn,
            zeros,
            offs_m,
            cols,
            seqlen_q,
            seqlen_k,
            EVEN_M,
            EVEN_N,
        )

    lse_ptrs = LSE + off_b * stride_lb + off_h * stride_lh + offs_m
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)


@triton.jit
def probe_uniform_pv_kernel(
    V,
    O,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    off_hk = off_h // kv_group
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    v_base = V + off_b * stride_vb + off_hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    _lo, _full_lo, full_hi, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, 0, 0, BLOCK_M, BLOCK_N, IS_CAUSAL, False
    )
    for start_n in range(0, full_hi, BLOCK_N):
        cols = start_n + offs_n
        v_ptrs = v_base + (cols[:, None] * stride_vn + offs_d[None, :] * stride_vd)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, EVEN_D)
        if UPCAST:
            v = v.to(tl.float32)
        p, alpha, m_i, l_i = online_softmax_step(zeros, m_i, l_i, False, False)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    for start_n in range(full_hi, hi, BLOCK_N):
        cols = start_n + offs_n
        v_ptrs = v_base + (cols[:, None] * stride_vn + offs_d[None, :] * stride_vd)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N, EVEN_D)
        if UPCAST:
            v = v.to(tl.float32)
        s = mask_scores(zeros, offs_m, cols, seqlen_q, seqlen_k, 0, 0, IS_CAUSAL, False, not EVEN_N)
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i, True, False)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = (
        O
        + off_b * stride_ob
        + off_h * stride_oh
        + (offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    )
    store_tile(
        o_ptrs, acc.to(O.dtype.element_ty), offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D
    )
