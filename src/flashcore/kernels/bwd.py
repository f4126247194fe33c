"""FlashAttention-2 backward: dQ, dK, dV without atomics, in two kernels.

Algorithm. With ``P = softmax(scale * Q K^T)`` recomputed tile by tile from the forward's LSE
(``P = exp2(S - lse2)``, nothing of size Sq x Sk is stored) and ``dO`` the output gradient:

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = scale * dS K,   dK = scale * dS^T Q

where ``delta_i = rowsum(dO * O)_i - dlse_i``; ``dlse`` is the gradient reaching the LSE output
(0 when the LSE is not used), since ``d lse_i / d s_ij = P_ij`` adds ``dlse_i * P_ij`` to dS.

1. ``attn_bwd_dq_kernel`` keeps one (BLOCK_M, BLOCK_D) tile of Q, dO and LSE on chip, computes
   the tile's ``delta`` from dO and one tile of O (``kernels/bwd_delta.py``) and writes it (fp32,
   laid out like the LSE) for the next kernel, then streams the key tiles it can see, like the
   forward, accumulating dQ in fp32 (fp64 for fp32 inputs).
   Grid: ``cdiv(Sq, BLOCK_M) * B * H`` programs, causal heaviest first.
2. ``attn_bwd_dkdv_kernel`` keeps one (BLOCK_N, BLOCK_D) tile of K and V on chip, streams the query
   tiles that can see it and accumulates dK and dV in registers (fp32; fp64 for fp32 inputs).
   GQA/MQA: the program of kv head hk loops over the ``H // Hkv`` query heads of its group and sums
   their contributions in registers, so repeated K/V are never materialised and no two programs
   write the same dK/dV rows. Every head of the group adds into one accumulator (fp32 inputs: an
   fp64 one, inside FlashAttention's rule through ``H / Hkv`` heads of rows on the GPU, where an
   fp32 chain that long put dK and dV at 1.5-5.6x PyTorch's fp32 error against float64 at 16
   query heads on 2 kv heads: test_backward_gpu_fp32_gqa_long_group). It reads the delta the dQ
   kernel wrote (same stream, launched after it).
   Grid: ``cdiv(Sk, BLOCK_N) * B * Hkv`` programs.
Every gradient element is written by exactly one program with a fixed summation order: the result
is deterministic by construction (no atomics). ``P`` and ``dS`` are cast to the input dtype for
their products, with fp32 accumulation, as in FlashAttention-2 (fp32 inputs: fp64, LSE base).

Tile ranges. The dQ kernel visits key tiles with the forward's ``kv_tile_range`` (the masked band
across a window's left edge, unmasked tiles, then the masked diagonal band and ragged end of Sk).
The dK/dV kernel uses its mirror, ``q_tile_range``: query tiles before the diagonal (or the
window's right edge) see none of the key block and are skipped, tiles crossing it are masked,
later tiles see every key and need no mask work, until the window's left edge: tiles crossing it
are masked again and later ones skipped.

Flags (``tl.constexpr``, compiled away when off):
- IS_CAUSAL: bottom-right aligned causal mask (row i sees key j iff ``j <= i + Sk - Sq``).
- HAS_WINDOW, SOFTCAP, HAS_ALIBI: as in the forward (kernels/fwd.py), recomputed identically.
  With SOFTCAP, ``dS`` (with respect to the capped scores) is multiplied by ``1 - tanh^2`` of the
  recomputed uncapped scores, giving the gradient with respect to ``scale * Q K^T``. The ALiBi
  slopes get no gradient.
- EVEN_M / EVEN_N: Sq / Sk are multiples of the kernel's BLOCK_M / BLOCK_N: loads and stores skip
  row masks.
- HEAD_DIM < BLOCK_D: head dims that are not powers of two are padded with masked loads.
  HEAD_DIM_V / BLOCK_DV: the value head dim (V, O, dO, dV), which may differ from Q/K's.
- BLOCK_D2 > 0: Q, K, dQ and dK in two column panels, ``[0, BLOCK_D)`` and ``[BLOCK_D, BLOCK_D +
  BLOCK_D2)`` (HEAD_DIM > BLOCK_D), instead of one tile padded to the next power of two: at
  HEAD_DIM = 192, 128 + 64 columns where one tile would be 256. The score products accumulate
  both panels (``S = Q_1 K_1^T + Q_2 K_2^T``), and dQ and dK keep an accumulator per panel. The
  launcher takes it for 16-bit inputs only (``ops/bwd.py: d_panels``): with fp32 inputs the
  score product is one fp64 product rounded once (``dot_nt``).
- HAS_DLSE (dQ kernel): subtract the LSE gradient from delta.
- UPCAST: compute in fp32 from fp32 copies of the tiles (so P and dS are not rounded to bf16
  either). Needed only by Triton 3.6's interpreter, which does bf16 arithmetic on the raw bit
  patterns; always off on the GPU.
- DOT_PRECISION: "ieee" for fp32 inputs (matches PyTorch's default fp32 matmul), ignored for
  fp16/bf16.
- IS_VARLEN: packed variable-length batches, as in the forward (see its docstring): the prologue
  reads the sequence's rows from CU_Q/CU_K, moves every base pointer there (batch strides are 0)
  and replaces seqlen_q/seqlen_k, which size the grid as the longest sequences, by the sequence's
  own lengths; blocks past its end return at once. Row stats are ``(H, total_q)``. EVEN_M/EVEN_N
  are False. A sequence without queries leaves its dK/dV programs with no query tile: they store
  zeros.
Varlen changes only how base pointers and sequence lengths are found.

LSE base. The forward stores the natural-log LSE (fp32, ``(B, H, Sq)``, unit stride along Sq).
``load_row_stats`` converts it to base 2 and the scores are scaled by ``scale * log2(e)``, so the
probabilities are one ``exp2``. Recomputing the base-2 scores exactly as the forward did matters:
the rounding of the row maximum then cancels against the LSE. Forming the exponent in natural units
instead (``(S * scale - lse) * log2(e)``) was tried and doubled the fp32 dK error with scores near
-470 (interpreter, exactly rounded dots). EXP_E (fp32, as in the forward): scores, LSE and
exponential all stay in natural units (``common.softmax_exp``), the forward's own, so the LSE needs
no conversion. In base 2 against the forward's natural scores (the GPU) or with the LSE through
``log2(e)`` (the interpreter), a row with one visible key had ``P`` off 1 by the rounding of scores
as large as ALiBi makes them: dV of one key seen by 1803 rows (most hundreds of positions away)
1.95e-3 from float64 against FlashAttention's bound of 1.0e-4 on the H200, 6.5x the bound in the
interpreter; natural units: 2.2e-4 on the H200, inside the bound in the interpreter. The rest was
dV's own sum, one chain of fp32 FMAs through every row of a head (Triton folds ``acc + dot`` into
``dot(a, b, acc)``): a one-hot dO gave dV's row counts exactly (every P exactly 1), and summing each
tile's product apart brought it inside the bound (5.5e-5), but at 16384 rows that still reached 0.9
of it. fp32 inputs therefore sum dQ, dK and dV in fp64 (``common.sum_dot``, the fp64 tensor cores
as the score product's ``dot_nt``), rounded once when stored: 2.8e-5 against the bound's 6.1e-4
there (tests/test_backward.py, ``test_backward_gpu_fp32_lone_key_alibi``). ``dS`` is the gradient
with respect to the natural-unit scores; the ``scale`` factor of ``S = scale * Q K^T`` is applied
once to the dQ and dK accumulators (``grad_scale``). The score scalars (``qk_scale``, ``softcap``)
arrive folded into the scores' units by the host exactly as the forward's (``ops/problem.py``), so
that the two kernels form the same scores.

Invariants. A row that sees no key (LSE -inf) and a padding row past Sq get ``lse2 = +inf``: their
P is exactly 0, so they contribute nothing and their dQ is 0, never NaN. Masked scores are -inf
(P = 0, dS = 0). In the dK/dV kernel, rows of the K/V block past Sk load as 0 and compute values
that only reach their own dK/dV rows, which are never stored, so keys need no mask outside the
causal band. Delta shares the LSE's strides. Batch/head offsets and the first row offset of each
tile walk are int64; in-tile offsets are int32.
"""

import triton
import triton.language as tl

from flashcore.kernels.bwd_delta import tile_delta
from flashcore.kernels.common import (
    alibi_slope,
    aligned,
    dot_nt,
    kv_tile_range,
    load_lse2,
    load_row_stats,
    load_tile,
    mask_scores,
    mask_scores_t,
    program_tile,
    q_tile_range,
    softmax_exp,
    store_tile,
    sum_dot,
    sum_zeros,
    transform_scores,
)
from flashcore.kernels.varlen import seq_bounds


@triton.jit
def _second_panel(
    rows,
    offs_r,
    n_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    EVEN_R: tl.constexpr,
    EVEN_D2: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The second column panel (module docstring, BLOCK_D2) of the program's own tile, K's in the
    dK/dV kernel and Q's in the dQ kernel, whose row pointers are ``rows``: ``(column offsets,
    tile, zero fp32 accumulator)``; placeholders without a second panel."""
    offs_d2 = 0
    tile = 0.0
    acc = 0.0
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D + tl.arange(0, BLOCK_D2)
        tile = load_tile(
            rows + offs_d2[None, :], offs_r, n_rows, offs_d2, HEAD_DIM, EVEN_R, EVEN_D2
        )
        if UPCAST:
            tile = tile.to(tl.float32)
        acc = tl.zeros([offs_r.shape[0], BLOCK_D2], dtype=tl.float32)
    return offs_d2, tile, acc


@triton.jit
def _bwd_dkdv_q_loop(
    dk,
    dv,
    k,
    v,
    dk2,
    k2,
    offs_d2,
    q_base,
    do_base,
    lse_ptrs,
    delta_ptrs,
    offs_tm,
    offs_n,
    offs_d,
    offs_dv,
    start_m,
    end_m,
    stride_qm,
    stride_dom,
    seqlen_q,
    seqlen_k,
    qk_scale,
    window_left,
    window_right,
    cap,
    slope,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_M: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    EVEN_D2: tl.constexpr,
    EXP_E: tl.constexpr,
):
    """Visit query tiles ``[start_m, end_m)`` of one head, bases already at row ``start_m``.

    MASKED selects the causal-diagonal variant. ``q_base``/``do_base`` are scalar pointers; tile
    pointers are rebuilt from them each step (carrying (BLOCK_M, D) pointer tensors through the loop
    made the kernel spill, as it did the forward's). Returns the accumulators and the bases and
    row-stat pointers advanced past the last tile, so consecutive ranges chain. With BLOCK_D2,
    ``k2``, ``dk2`` and ``offs_d2`` are the second column panel's (module docstring).
    """
    tile_q = offs_tm[:, None] * stride_qm + offs_d[None, :]
    tile_do = offs_tm[:, None] * stride_dom + offs_dv[None, :]
    if BLOCK_D2 > 0:
        tile_q2 = offs_tm[:, None] * stride_qm + offs_d2[None, :]
    for tile_m in range(start_m, end_m, BLOCK_M):
        rows = tile_m + offs_tm
        q = load_tile(q_base + tile_q, rows, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
        do = load_tile(do_base + tile_do, rows, seqlen_q, offs_dv, HEAD_DIM_V, EVEN_M, EVEN_DV)
        lse2, delta = load_row_stats(lse_ptrs, delta_ptrs, rows, seqlen_q, EVEN_M, EXP_E)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        # Transposed products (S^T = K Q^T): K, V and P^T, dS^T are the register operands, Q and
        # dO the freshly loaded ones, so no register tile needs a transpose.
        st = dot_nt(k, q, DOT_PRECISION)
        if BLOCK_D2 > 0:
            q2 = load_tile(q_base + tile_q2, rows, seqlen_q, offs_d2, HEAD_DIM, EVEN_M, EVEN_D2)
            if UPCAST:
                q2 = q2.to(tl.float32)
            st = tl.dot(k2, tl.trans(q2), st, input_precision=DOT_PRECISION)
        st = st * qk_scale
        st, tt = transform_scores(
            st, rows[None, :], offs_n[:, None], seqlen_q, seqlen_k, cap, slope, SOFTCAP, HAS_ALIBI,
            q.dtype != tl.float32,
        )  # fmt: skip
        if MASKED:
            st = mask_scores_t(
                st, offs_n, rows, seqlen_q, seqlen_k, window_left, window_right,
                IS_CAUSAL, HAS_WINDOW, False,
            )  # fmt: skip
        pt = softmax_exp(st - lse2[None, :], EXP_E)
        dv = sum_dot(pt.to(do.dtype), do, dv, DOT_PRECISION)
        dpt = dot_nt(v, do, DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        if SOFTCAP:
            # d(c * tanh(x / c)) / dx = 1 - tanh^2: dS with respect to the uncapped scores.
            dst = dst * (1.0 - tt * tt)
        dk = sum_dot(dst.to(q.dtype), q, dk, DOT_PRECISION)
        if BLOCK_D2 > 0:
            dk2 = sum_dot(dst.to(q2.dtype), q2, dk2, DOT_PRECISION)
        q_base += BLOCK_M * stride_qm
        do_base += BLOCK_M * stride_dom
        lse_ptrs += BLOCK_M
        delta_ptrs += BLOCK_M
    return dk, dv, dk2, q_base, do_base, lse_ptrs, delta_ptrs


@triton.jit
def attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    CU_Q,
    CU_K,
    ALIBI,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_lb,
    stride_lh,
    stride_ab,
    kv_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    total_q,
    total_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
    grad_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    ALIGN: tl.constexpr = 1,
    EXP_E: tl.constexpr = False,
):
    stride_qb, stride_qh, stride_qm = aligned(stride_qb, stride_qh, stride_qm, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_dob, stride_doh, stride_dom = aligned(stride_dob, stride_doh, stride_dom, ALIGN)
    stride_dkb, stride_dkh, stride_dkn = aligned(stride_dkb, stride_dkh, stride_dkn, ALIGN)
    stride_dvb, stride_dvh, stride_dvn = aligned(stride_dvb, stride_dvh, stride_dvn, ALIGN)
    # Causal key tiles are seen by fewer query rows the later they start: in order, heaviest first.
    tile_n, off_bh = program_tile(tl.cdiv(seqlen_k, BLOCK_N), False)
    start_n = tile_n * BLOCK_N
    off_b = (off_bh // kv_heads).to(tl.int64)
    off_hk = (off_bh % kv_heads).to(tl.int64)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D or BLOCK_D2 > 0
    EVEN_D2: tl.constexpr = HEAD_DIM == BLOCK_D + BLOCK_D2
    EVEN_DV: tl.constexpr = HEAD_DIM_V == BLOCK_DV
    if IS_VARLEN:
        # Packed sequences (see the forward): move the bases to this sequence's first rows.
        row_q, seqlen_q = seq_bounds(CU_Q, off_b, total_q)
        row_k, seqlen_k = seq_bounds(CU_K, off_b, total_k)
        if start_n >= seqlen_k:
            return
        Q += row_q * stride_qm
        DO += row_q * stride_dom
        LSE += row_q
        DELTA += row_q
        K += row_k * stride_kn
        V += row_k * stride_vn
        DK += row_k * stride_dkn
        DV += row_k * stride_dvn

    offs_tn = tl.arange(0, BLOCK_N)
    offs_n = start_n + offs_tn
    offs_tm = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col0 = start_n.to(tl.int64)
    # Row bases of the K and dK tiles (each column panel adds its own columns).
    k_rows = K + off_b * stride_kb + off_hk * stride_kh + col0 * stride_kn
    k_rows += offs_tn[:, None] * stride_kn
    dk_rows = DK + off_b * stride_dkb + off_hk * stride_dkh + col0 * stride_dkn
    dk_rows += offs_tn[:, None] * stride_dkn
    k_ptrs = k_rows + offs_d[None, :]
    v_ptrs = (
        V
        + off_b * stride_vb
        + off_hk * stride_vh
        + col0 * stride_vn
        + (offs_tn[:, None] * stride_vn + offs_dv[None, :])
    )
    k = load_tile(k_ptrs, offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, EVEN_D)
    v = load_tile(v_ptrs, offs_n, seqlen_k, offs_dv, HEAD_DIM_V, EVEN_N, EVEN_DV)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    dk = sum_zeros(BLOCK_N, BLOCK_D, DOT_PRECISION)
    dv = sum_zeros(BLOCK_N, BLOCK_DV, DOT_PRECISION)
    offs_d2, k2, dk2 = _second_panel(
        k_rows, offs_n, seqlen_k, HEAD_DIM, BLOCK_D, BLOCK_D2, EVEN_N, EVEN_D2, UPCAST
    )

    lo, mid, full_hi, hi = q_tile_range(
        start_n, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW,
    )  # fmt: skip
    row0 = tl.cast(lo, tl.int64)
    # GQA/MQA: the query heads sharing this kv head, summed in registers (no atomics, no repeat).
    for g in range(kv_group):
        off_h = off_hk * kv_group + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh + row0 * stride_qm
        do_base = DO + off_b * stride_dob + off_h * stride_doh + row0 * stride_dom
        stats_off = off_b * stride_lb + off_h * stride_lh + row0
        lse_ptrs = LSE + stats_off + offs_tm
        delta_ptrs = DELTA + stats_off + offs_tm
        slope = alibi_slope(ALIBI, off_b, off_h, stride_ab, HAS_ALIBI, EXP_E)
        dk, dv, dk2, q_base, do_base, lse_ptrs, delta_ptrs = _bwd_dkdv_q_loop(
            dk, dv, k, v, dk2, k2, offs_d2, q_base, do_base, lse_ptrs, delta_ptrs, offs_tm,
            offs_n, offs_d, offs_dv, lo, mid,
            stride_qm, stride_dom, seqlen_q, seqlen_k, qk_scale, window_left, window_right,
            softcap, slope,
            HEAD_DIM, HEAD_DIM_V, BLOCK_M, EVEN_D, EVEN_DV, IS_CAUSAL, HAS_WINDOW, SOFTCAP,
            HAS_ALIBI, True,
            EVEN_M, UPCAST, DOT_PRECISION, BLOCK_D2, EVEN_D2, EXP_E,
        )  # fmt: skip
        dk, dv, dk2, q_base, do_base, lse_ptrs, delta_ptrs = _bwd_dkdv_q_loop(
            dk, dv, k, v, dk2, k2, offs_d2, q_base, do_base, lse_ptrs, delta_ptrs, offs_tm,
            offs_n, offs_d, offs_dv, mid, full_hi, stride_qm, stride_dom, seqlen_q, seqlen_k,
            qk_scale, window_left, window_right, softcap, slope,
            HEAD_DIM, HEAD_DIM_V, BLOCK_M, EVEN_D, EVEN_DV, IS_CAUSAL, HAS_WINDOW, SOFTCAP,
            HAS_ALIBI, False,
            EVEN_M, UPCAST, DOT_PRECISION, BLOCK_D2, EVEN_D2, EXP_E,
        )  # fmt: skip
        if HAS_WINDOW:
            # Query rows past the window's left edge of the block's first key: masked again.
            dk, dv, dk2, q_base, do_base, lse_ptrs, delta_ptrs = _bwd_dkdv_q_loop(
                dk, dv, k, v, dk2, k2, offs_d2, q_base, do_base, lse_ptrs, delta_ptrs, offs_tm,
                offs_n, offs_d,
                offs_dv, full_hi, hi, stride_qm, stride_dom, seqlen_q, seqlen_k, qk_scale,
                window_left,
                window_right, softcap, slope,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, EVEN_D, EVEN_DV, IS_CAUSAL, HAS_WINDOW, SOFTCAP,
                HAS_ALIBI, True,
                EVEN_M, UPCAST, DOT_PRECISION, BLOCK_D2, EVEN_D2, EXP_E,
            )  # fmt: skip

    dk *= grad_scale
    dk_ptrs = dk_rows + offs_d[None, :]
    dv_ptrs = (
        DV
        + off_b * stride_dvb
        + off_hk * stride_dvh
        + col0 * stride_dvn
        + (offs_tn[:, None] * stride_dvn + offs_dv[None, :])
    )
    store_tile(
        dk_ptrs, dk.to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d, HEAD_DIM, EVEN_N, EVEN_D
    )
    if BLOCK_D2 > 0:
        dk2 *= grad_scale
        store_tile(
            dk_rows + offs_d2[None, :], dk2.to(DK.dtype.element_ty), offs_n, seqlen_k, offs_d2,
            HEAD_DIM, EVEN_N, EVEN_D2,
        )  # fmt: skip
    store_tile(
        dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, seqlen_k, offs_dv, HEAD_DIM_V, EVEN_N, EVEN_DV
    )


@triton.jit
def _bwd_dq_kv_loop(
    dq,
    q,
    dq2,
    q2,
    offs_d2,
    do,
    lse2,
    delta,
    k_base,
    v_base,
    offs_m,
    offs_n,
    offs_d,
    offs_dv,
    start_n,
    end_n,
    stride_kn,
    stride_vn,
    seqlen_q,
    seqlen_k,
    qk_scale,
    window_left,
    window_right,
    cap,
    slope,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    EVEN_D2: tl.constexpr,
    EXP_E: tl.constexpr,
):
    """Visit key tiles ``[start_n, end_n)`` with k/v pointers already at ``start_n``.

    MASKED selects the masked-tail variant (causal band, ragged end of Sk). ``k_base``/``v_base``
    are scalar pointers; tile pointers are rebuilt from them each step (no loop-carried pointer
    tensors, see the forward's ``_fwd_kv_loop``). With BLOCK_D2, ``q2``, ``dq2`` and ``offs_d2``
    are the second column panel's (module docstring).
    """
    tile_k = offs_n[:, None] * stride_kn + offs_d[None, :]
    tile_v = offs_n[:, None] * stride_vn + offs_dv[None, :]
    if BLOCK_D2 > 0:
        tile_k2 = offs_n[:, None] * stride_kn + offs_d2[None, :]
    for tile_n in range(start_n, end_n, BLOCK_N):
        cols = tile_n + offs_n
        # Full tiles lie inside Sk by construction; only the masked tail can run past it.
        rows_even = EVEN_N or not MASKED
        k = load_tile(k_base + tile_k, cols, seqlen_k, offs_d, HEAD_DIM, rows_even, EVEN_D)
        v = load_tile(v_base + tile_v, cols, seqlen_k, offs_dv, HEAD_DIM_V, rows_even, EVEN_DV)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = dot_nt(q, k, DOT_PRECISION)
        if BLOCK_D2 > 0:
            k2 = load_tile(k_base + tile_k2, cols, seqlen_k, offs_d2, HEAD_DIM, rows_even, EVEN_D2)
            if UPCAST:
                k2 = k2.to(tl.float32)
            s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PRECISION)
        s = s * qk_scale
        s, t = transform_scores(
            s, offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, cap, slope, SOFTCAP, HAS_ALIBI,
            k.dtype != tl.float32,
        )  # fmt: skip
        if MASKED:
            s = mask_scores(
                s, offs_m, cols, seqlen_q, seqlen_k, window_left, window_right,
                IS_CAUSAL, HAS_WINDOW, not EVEN_N,
            )  # fmt: skip
        p = softmax_exp(s - lse2[:, None], EXP_E)
        dp = dot_nt(do, v, DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = sum_dot(ds.to(k.dtype), k, dq, DOT_PRECISION)
        if BLOCK_D2 > 0:
            dq2 = sum_dot(ds.to(k2.dtype), k2, dq2, DOT_PRECISION)
        k_base += BLOCK_N * stride_kn
        v_base += BLOCK_N * stride_vn
    return dq, dq2, k_base, v_base


@triton.jit
def attn_bwd_dq_kernel(
    Q,
    K,
    V,
    O,
    DO,
    DLSE,
    LSE,
    DELTA,
    DQ,
    CU_Q,
    CU_K,
    ALIBI,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dlb,
    stride_dlh,
    stride_dlm,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_lb,
    stride_lh,
    stride_ab,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    total_q,
    total_k,
    qk_scale,
    window_left,
    window_right,
    softcap,
    grad_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    ALIGN: tl.constexpr = 1,
    EXP_E: tl.constexpr = False,
):
    stride_qb, stride_qh, stride_qm = aligned(stride_qb, stride_qh, stride_qm, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_ob, stride_oh, stride_om = aligned(stride_ob, stride_oh, stride_om, ALIGN)
    stride_dob, stride_doh, stride_dom = aligned(stride_dob, stride_doh, stride_dom, ALIGN)
    stride_dqb, stride_dqh, stride_dqm = aligned(stride_dqb, stride_dqh, stride_dqm, ALIGN)
    tile_m, off_bh = program_tile(tl.cdiv(seqlen_q, BLOCK_M), IS_CAUSAL)
    start_m = tile_m * BLOCK_M
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    off_hk = off_h // kv_group
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D or BLOCK_D2 > 0
    EVEN_D2: tl.constexpr = HEAD_DIM == BLOCK_D + BLOCK_D2
    EVEN_DV: tl.constexpr = HEAD_DIM_V == BLOCK_DV
    if IS_VARLEN:
        # Packed sequences (see the forward): move the bases to this sequence's first rows.
        row_q, seqlen_q = seq_bounds(CU_Q, off_b, total_q)
        row_k, seqlen_k = seq_bounds(CU_K, off_b, total_k)
        if start_m >= seqlen_q:
            return
        Q += row_q * stride_qm
        O += row_q * stride_om
        DO += row_q * stride_dom
        DLSE += row_q * stride_dlm
        DQ += row_q * stride_dqm
        LSE += row_q
        DELTA += row_q
        K += row_k * stride_kn
        V += row_k * stride_vn

    offs_tm = tl.arange(0, BLOCK_M)
    offs_m = start_m + offs_tm
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row0 = start_m.to(tl.int64)
    # Row bases of the Q and dQ tiles (each column panel adds its own columns).
    q_rows = Q + off_b * stride_qb + off_h * stride_qh + row0 * stride_qm
    q_rows += offs_tm[:, None] * stride_qm
    dq_rows = DQ + off_b * stride_dqb + off_h * stride_dqh + row0 * stride_dqm
    dq_rows += offs_tm[:, None] * stride_dqm
    q_ptrs = q_rows + offs_d[None, :]
    do_ptrs = (
        DO
        + off_b * stride_dob
        + off_h * stride_doh
        + row0 * stride_dom
        + (offs_tm[:, None] * stride_dom + offs_dv[None, :])
    )
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    o_ptrs = (
        O
        + off_b * stride_ob
        + off_h * stride_oh
        + row0 * stride_om
        + (offs_tm[:, None] * stride_om + offs_dv[None, :])
    )
    stats_off = off_b * stride_lb + off_h * stride_lh
    lse2 = load_lse2(LSE + stats_off + offs_m, offs_m, seqlen_q, EVEN_M, EXP_E)
    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    do = load_tile(do_ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, EVEN_M, EVEN_DV)
    dlse_ptrs = DLSE + off_b * stride_dlb + off_h * stride_dlh + (row0 + offs_tm) * stride_dlm
    delta = tile_delta(
        o_ptrs, do, dlse_ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, EVEN_M, EVEN_DV, HAS_DLSE
    )
    # For the dK/dV kernel, launched next.
    if EVEN_M:
        tl.store(DELTA + stats_off + offs_m, delta)
    else:
        tl.store(DELTA + stats_off + offs_m, delta, mask=offs_m < seqlen_q)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)

    dq = sum_zeros(BLOCK_M, BLOCK_D, DOT_PRECISION)
    offs_d2, q2, dq2 = _second_panel(
        q_rows, offs_m, seqlen_q, HEAD_DIM, BLOCK_D, BLOCK_D2, EVEN_M, EVEN_D2, UPCAST
    )
    slope = alibi_slope(ALIBI, off_b, off_h, stride_ab, HAS_ALIBI, EXP_E)
    lo, full_lo, full_hi, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW,
    )  # fmt: skip
    if HAS_WINDOW:
        k_base += lo.to(tl.int64) * stride_kn
        v_base += lo.to(tl.int64) * stride_vn
        dq, dq2, k_base, v_base = _bwd_dq_kv_loop(
            dq, q, dq2, q2, offs_d2, do, lse2, delta, k_base, v_base, offs_m, offs_n, offs_d,
            offs_dv, lo, full_lo,
            stride_kn, stride_vn, seqlen_q, seqlen_k, qk_scale, window_left, window_right,
            softcap, slope,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, EVEN_DV, IS_CAUSAL, HAS_WINDOW, SOFTCAP,
            HAS_ALIBI, True, EVEN_N,
            UPCAST, DOT_PRECISION, BLOCK_D2, EVEN_D2, EXP_E,
        )  # fmt: skip
    dq, dq2, k_base, v_base = _bwd_dq_kv_loop(
        dq, q, dq2, q2, offs_d2, do, lse2, delta, k_base, v_base, offs_m, offs_n, offs_d, offs_dv,
        full_lo, full_hi,
        stride_kn, stride_vn, seqlen_q, seqlen_k, qk_scale, window_left, window_right,
        softcap, slope,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, EVEN_DV, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
        False, EVEN_N,
        UPCAST, DOT_PRECISION, BLOCK_D2, EVEN_D2, EXP_E,
    )  # fmt: skip
    dq, dq2, k_base, v_base = _bwd_dq_kv_loop(
        dq, q, dq2, q2, offs_d2, do, lse2, delta, k_base, v_base, offs_m, offs_n, offs_d, offs_dv,
        full_hi, hi,
        stride_kn, stride_vn, seqlen_q, seqlen_k, qk_scale, window_left, window_right,
        softcap, slope,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, EVEN_DV, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
        True, EVEN_N,
        UPCAST, DOT_PRECISION, BLOCK_D2, EVEN_D2, EXP_E,
    )  # fmt: skip

    dq *= grad_scale
    dq_ptrs = dq_rows + offs_d[None, :]
    store_tile(
        dq_ptrs, dq.to(DQ.dtype.element_ty), offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D
    )
    if BLOCK_D2 > 0:
        dq2 *= grad_scale
        store_tile(
            dq_rows + offs_d2[None, :], dq2.to(DQ.dtype.element_ty), offs_m, seqlen_q, offs_d2,
            HEAD_DIM, EVEN_M, EVEN_D2,
        )  # fmt: skip
