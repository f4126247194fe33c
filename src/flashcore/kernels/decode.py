"""Split-KV decoding (flash-decoding) over a contiguous or paged KV cache, forward only.

Algorithm. Decoding has few queries (Sq = 1, or a few for speculative decoding) against a long
cache, so the forward kernel's grid (one program per query block) would leave the GPU idle and
read K/V once per query head. Here one program owns one (batch, kv head), one split of its keys
and one tile of BLOCK_M rows, where the rows pack the ``G = H // Hkv`` query heads of the kv head
query by query: row ``r`` is query ``i = r // G`` of head ``kv_head * G + r % G``. Decoding fits
all ``G * Sq`` rows in one tile (BLOCK_M padded to a power of two >= 16 for ``tl.dot``, at most
128), so each K/V tile is read once per kv head per split, whatever the GQA ratio; a longer chunk
of queries (prefill against the cache) takes several row tiles, each a run of consecutive
queries, so causal tiles skip the keys their queries cannot see. Within a split the key loop is
the forward's: ``S = Q @ K^T`` in fp32, an online softmax in base 2 (``scale * log2(e)`` folded
into one multiply), ``P`` cast to the value dtype for ``P @ V``.

``attn_decode_kernel`` writes, per row and split, the normalised partial output and its LSE.
``attn_decode_combine_kernel`` merges the splits of a row with the LSE trick:
``lse = log(sum_s exp(lse_s))``, ``out = sum_s exp(lse_s - lse) * out_s``. With one split the
launcher points the first kernel at the final ``out``/``lse`` (split stride 0) and skips the
combine.

Grid. ``attn_decode_kernel``: ``(B * Hkv, num_splits, cdiv(G * Sq, BLOCK_M))``. The key range
``[lo, hi)`` a row tile's queries see is cut into ``num_splits`` runs of whole BLOCK_N tiles (sized
from that sequence's own length L, so a short sequence's later splits are empty).
``attn_decode_combine_kernel``: ``(B * H * Sq,)``, one program per output row.

Positions. Sequence b holds ``L = cache_seqlens[b]`` valid keys (clamped to ``[0, capacity]`` so
that no load leaves the cache); its queries are the LAST Sq positions: query i sits at
``pos_i = i + L - Sq``: the bottom-right alignment of the dense kernels for an (Sq, L) problem, so
visibility is theirs, ``common.mask_by_index`` with ``seqlen_q = Sq`` and ``seqlen_k = L``: row i
sees key j iff ``j < L`` and (IS_CAUSAL) ``j <= pos_i`` and (HAS_WINDOW) ``pos_i - left <= j``
and, unless causal, ``j <= pos_i + right``.

Key loop. The tiles the queries see come from the dense kernels' ``common.kv_tile_range`` for
rows ``[0, Sq)``; a split's keys are visited in up to three runs: a masked head (keys below what
the window lets every row see), an unmasked middle (every real row sees every key: no mask work),
a masked tail (the causal/window diagonal and the ragged end at L). Padded rows (r >= G * Sq) are
never stored; they may compute anything finite or not without touching real rows.

Flags (``tl.constexpr``, compiled away when off):
- PAGED (0 is off): K/V are ``(num_blocks, Hkv, block_size, D)``; logical key j of sequence b is
  row ``j % block_size`` of block ``BLOCK_TABLE[b, j // block_size]`` (``common.paged_rows``):
  1 looks each key row's block up (any block_size), 2 one block per tile (block_size a multiple
  of BLOCK_N), 3 as 1 with a shift and a mask where 1 divides (block_size a power of two;
  ``ops/fwd.paged_mode``). Otherwise K/V are ``(B, Hkv, S_max, D)``.
- IS_CAUSAL / HAS_WINDOW: the bounds above, passed as by the dense kernels
  (``ops/problem.window_bounds`` with the cache capacity as Sk: an unbounded side is Sq + capacity).
- SOFTCAP: ``s = c * tanh(scale * q.k / c)``; the host folds the units as for every kernel
  (``ops/problem.py``): ``qk_scale = scale / c`` and ``softcap = c`` (times log2(e) unless EXP_E).
- HAS_ALIBI: adds ``-slope[b, h] * |pos_i - j|`` after the softcap (ALIBI is ``(B, H)`` fp32 with
  unit head stride, batch stride 0 for per-head slopes). Softcap and ALiBi are the main kernels'
  ``common.transform_scores`` and ``common.alibi_slope``.
- HAS_SINKS: a sink logit per query head joins each row's softmax as a key with no value
  (``common.softmax_start``), in the first split only; the combine's LSE merge then counts it
  once. A row that sees no key gives ``out = 0`` and ``lse = sink``.
- EVEN_M: ``G * Sq`` is a multiple of BLOCK_M (no padded rows: loads skip the row mask).
- HEAD_DIM < BLOCK_D, HEAD_DIM_V < BLOCK_DV: padded head dims (the value one may differ), as in
  the forward.
- UPCAST, DOT_PRECISION, EXP_E: as in the forward kernel (interpreter bf16 upcast; IEEE fp32
  dots, with the score product in fp64 as in ``common.dot_nt``; fp32 in natural units with an
  exact exp).

LSE base. Partial and final LSE are natural-log, fp32. A row (or a split of it) that sees no key
has ``l = 0``: its output is written as 0 and its LSE as -inf; the combine weights such splits by
exactly 0 and gives a row with no key at all ``out = 0``, ``lse = -inf`` (never NaN).

Invariants. Unit-stride head dim (the launcher copies otherwise). Batch/head/block offsets are
int64. Masked scores are -inf, never a large finite number.
"""

import triton
import triton.language as tl

from flashcore.kernels.common import (
    LOG2E,
    alibi_slope,
    dot_nt,
    kv_tile_range,
    load_tile,
    mask_by_index,
    online_softmax_step,
    paged_rows,
    pv_finish,
    pv_start,
    softmax_start,
    store_tile,
    sum_dot,
    transform_scores,
)


@triton.jit
def _decode_kv_loop(
    acc,
    m_i,
    l_i,
    q,
    k_head,
    v_head,
    bt_row,
    qi,
    slope,
    offs_n,
    offs_d,
    offs_dv,
    start_n,
    end_n,
    stride_kb,
    stride_kn,
    stride_vb,
    stride_vn,
    seqlen_q,
    seqlen,
    block_size,
    num_blocks,
    qk_scale,
    softcap,
    window_left,
    window_right,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_DV: tl.constexpr,
    MASKED: tl.constexpr,
    PAGED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXP_E: tl.constexpr,
):
    """Visit key tiles ``[start_n, end_n)``; MASKED selects the masked variant.

    ``k_head``/``v_head`` point at this kv head: of sequence b (contiguous) or of block 0 (PAGED,
    rows found through ``bt_row``, the sequence's block-table row). Unmasked tiles lie inside L
    by construction, so only masked tiles mask their loads (and their block-table reads).
    """
    for tile_n in range(start_n, end_n, BLOCK_N):
        cols = tile_n + offs_n
        if PAGED:
            page, row = paged_rows(
                bt_row, tile_n, cols, seqlen, block_size, num_blocks, MASKED, PAGED
            )
            k_ptrs = k_head + (page * stride_kb + row * stride_kn)[:, None] + offs_d[None, :]
            v_ptrs = v_head + (page * stride_vb + row * stride_vn)[:, None] + offs_dv[None, :]
        else:
            k_ptrs = k_head + (cols * stride_kn)[:, None] + offs_d[None, :]
            v_ptrs = v_head + (cols * stride_vn)[:, None] + offs_dv[None, :]
        k = load_tile(k_ptrs, cols, seqlen, offs_d, HEAD_DIM, not MASKED, EVEN_D)
        v = load_tile(v_ptrs, cols, seqlen, offs_dv, HEAD_DIM_V, not MASKED, EVEN_DV)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = dot_nt(q, k, DOT_PRECISION) * qk_scale
        # Query qi of Sq against a sequence of L keys sits at position qi + L - Sq: the dense
        # kernels' bottom-right alignment, so their transform and mask apply as they are.
        s, _t = transform_scores(
            s, qi[:, None], cols[None, :], seqlen_q, seqlen, softcap, slope, SOFTCAP, HAS_ALIBI,
            k.dtype != tl.float32,
        )  # fmt: skip
        if MASKED:
            s = mask_by_index(
                s, qi[:, None], cols[None, :], seqlen_q, seqlen, window_left, window_right,
                IS_CAUSAL, HAS_WINDOW, True,
            )  # fmt: skip
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i, MASKED, EXP_E)
        acc = sum_dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def attn_decode_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    SEQLENS,
    BLOCK_TABLE,
    ALIBI,
    SINKS,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_os,
    stride_ob,
    stride_oh,
    stride_om,
    stride_ls,
    stride_lb,
    stride_lh,
    stride_lm,
    stride_btb,
    stride_ab,
    kv_heads,
    kv_group,
    seqlen_q,
    seqlen_cap,
    block_size,
    num_blocks,
    num_splits,
    qk_scale,
    window_left,
    window_right,
    softcap,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_M: tl.constexpr,
    PAGED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    EXP_E: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    row_tile = tl.program_id(2)
    off_b = (pid_bh // kv_heads).to(tl.int64)
    off_hk = (pid_bh % kv_heads).to(tl.int64)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    EVEN_DV: tl.constexpr = HEAD_DIM_V == BLOCK_DV

    seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + off_b), 0), seqlen_cap)
    n_rows = kv_group * seqlen_q
    row0 = row_tile * BLOCK_M
    offs_r = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    # Row r packs query i = r // G and query head g = r % G of this kv head's group: a tile of
    # consecutive rows holds consecutive queries, [first_q, first_q + tile_q).
    g = offs_r % kv_group
    qi = offs_r // kv_group
    first_q = row0 // kv_group
    tile_q = (tl.minimum(row0 + BLOCK_M, n_rows) - 1) // kv_group - first_q + 1
    head0 = off_hk * kv_group

    q_ptrs = (
        Q
        + off_b * stride_qb
        + head0 * stride_qh
        + (g * stride_qh + qi * stride_qm)[:, None]
        + offs_d[None, :]
    )
    q = load_tile(q_ptrs, offs_r, n_rows, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)
    heads = head0 + g
    if HAS_ALIBI:
        slope = alibi_slope(ALIBI, off_b, heads, stride_ab, HAS_ALIBI, EXP_E)[:, None]
    else:
        slope = 0.0

    # The tiles this tile's queries see, as a query block of the forward kernel would (rows
    # first_q.. of a (Sq, L) problem): keys some row sees [lo, hi), every row sees [full_lo,
    # full_hi).
    lo, full_lo, full_hi, hi = kv_tile_range(
        first_q, seqlen_q, seqlen, window_left, window_right, tile_q, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW,
    )  # fmt: skip
    # This split's whole tiles.
    per_split = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), num_splits) * BLOCK_N
    start = tl.minimum(lo + split * per_split, hi)
    end = tl.minimum(start + per_split, hi)
    mid_lo = tl.minimum(tl.maximum(full_lo, start), end)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), end)

    if PAGED:
        k_head = K + off_hk * stride_kh
        v_head = V + off_hk * stride_vh
        bt_row = BLOCK_TABLE + off_b * stride_btb
    else:
        k_head = K + off_b * stride_kb + off_hk * stride_kh
        v_head = V + off_b * stride_vb + off_hk * stride_vh
        bt_row = BLOCK_TABLE

    m_i, l_i = softmax_start(SINKS, heads, BLOCK_M, HAS_SINKS, EXP_E)
    if HAS_SINKS:
        # The sink joins the first split only; the combine adds the splits' sums.
        m_i = tl.where(split == 0, m_i, float("-inf"))
        l_i = tl.where(split == 0, l_i, 0.0)
    acc, l_i = pv_start(l_i, BLOCK_M, BLOCK_DV, DOT_PRECISION)
    acc, m_i, l_i = _decode_kv_loop(
        acc, m_i, l_i, q, k_head, v_head, bt_row, qi, slope, offs_n, offs_d, offs_dv,
        start, mid_lo,
        stride_kb, stride_kn, stride_vb, stride_vn, seqlen_q, seqlen, block_size,
        num_blocks, qk_scale,
        softcap, window_left, window_right,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, EVEN_DV, True, PAGED, IS_CAUSAL, HAS_WINDOW,
        SOFTCAP, HAS_ALIBI, UPCAST,
        DOT_PRECISION, EXP_E,
    )  # fmt: skip
    acc, m_i, l_i = _decode_kv_loop(
        acc, m_i, l_i, q, k_head, v_head, bt_row, qi, slope, offs_n, offs_d, offs_dv,
        mid_lo, mid_hi,
        stride_kb, stride_kn, stride_vb, stride_vn, seqlen_q, seqlen, block_size,
        num_blocks, qk_scale,
        softcap, window_left, window_right,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, EVEN_DV, False, PAGED, IS_CAUSAL, HAS_WINDOW,
        SOFTCAP, HAS_ALIBI, UPCAST,
        DOT_PRECISION, EXP_E,
    )  # fmt: skip
    acc, m_i, l_i = _decode_kv_loop(
        acc, m_i, l_i, q, k_head, v_head, bt_row, qi, slope, offs_n, offs_d, offs_dv,
        mid_hi, end,
        stride_kb, stride_kn, stride_vb, stride_vn, seqlen_q, seqlen, block_size,
        num_blocks, qk_scale,
        softcap, window_left, window_right,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, EVEN_D, EVEN_DV, True, PAGED, IS_CAUSAL, HAS_WINDOW,
        SOFTCAP, HAS_ALIBI, UPCAST,
        DOT_PRECISION, EXP_E,
    )  # fmt: skip

    acc, lse = pv_finish(acc, m_i, l_i, EXP_E)

    split_off = split.to(tl.int64)
    o_ptrs = (
        O
        + split_off * stride_os
        + off_b * stride_ob
        + head0 * stride_oh
        + (g * stride_oh + qi * stride_om)[:, None]
        + offs_dv[None, :]
    )
    o = acc.to(O.dtype.element_ty)
    store_tile(o_ptrs, o, offs_r, n_rows, offs_dv, HEAD_DIM_V, EVEN_M, EVEN_DV)
    lse_ptrs = (
        LSE + split_off * stride_ls + off_b * stride_lb + (head0 + g) * stride_lh + qi * stride_lm
    )
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_r < n_rows)


@triton.jit
def attn_decode_combine_kernel(
    O_PART,
    LSE_PART,
    O,
    LSE,
    stride_ps,
    stride_pb,
    stride_ph,
    stride_pm,
    stride_qs,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_ob,
    stride_oh,
    stride_om,
    stride_lb,
    stride_lh,
    stride_lm,
    num_heads,
    seqlen_q,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merge the ``num_splits`` partial (out, lse) of one row; see the module docstring."""
    row = tl.program_id(0)
    off_b = (row // (num_heads * seqlen_q)).to(tl.int64)
    off_h = ((row // seqlen_q) % num_heads).to(tl.int64)
    off_m = (row % seqlen_q).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    in_split = offs_s < num_splits

    lse_part = tl.load(
        LSE_PART + off_b * stride_qb + off_h * stride_qh + off_m * stride_qm + offs_s * stride_qs,
        mask=in_split,
        other=float("-inf"),
    )
    m = tl.max(lse_part, 0)
    # Every split empty: weights 0 instead of exp(-inf - -inf) = NaN.
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2((lse_part - m_ref) * LOG2E)
    total = tl.sum(w, 0)
    o_ptrs = (
        O_PART
        + off_b * stride_pb
        + off_h * stride_ph
        + off_m * stride_pm
        + (offs_s.to(tl.int64) * stride_ps)[:, None]
        + offs_d[None, :]
    )
    part = tl.load(o_ptrs, mask=in_split[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    lse = tl.where(total == 0.0, float("-inf"), m_ref + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(
        O + off_b * stride_ob + off_h * stride_oh + off_m * stride_om + offs_d,
        out.to(O.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
    tl.store(LSE + off_b * stride_lb + off_h * stride_lh + off_m * stride_lm, lse)
