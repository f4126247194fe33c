"""FlashAttention-2 forward: one program per (query block, batch x head).

Algorithm. A program keeps its (BLOCK_M, BLOCK_D) query tile on chip and streams the key/value
tiles of its (batch, kv head) through it: ``S = Q @ K^T`` on the tensor cores with fp32
accumulation, scaled by ``scale * log2(e)`` so the softmax runs on ``exp2``; an online softmax keeps
the running row max ``m`` and row sum ``l`` in fp32 and rescales the output accumulator when the max
grows; ``P`` is cast to the value dtype for the second product ``acc += P @ V``. Nothing of size
Sq x Sk ever reaches memory. At the end ``out = acc / l`` and ``lse = (m + log2(l)) * ln(2)``.

Grid. ``(cdiv(Sq, BLOCK_M), B * H)``; query head h reads kv head ``h // (H // Hkv)`` (GQA/MQA
without repeating K/V in memory).

Key loop. ``kv_tile_range`` splits the keys a block may see into full tiles (every row sees every
key: no mask work at all) and a tail that needs masking (the causal diagonal band, the ragged end
of Sk). Tiles past the diagonal are never visited, so causal costs about half.

Flags (``tl.constexpr``, compiled away when off):
- IS_CAUSAL: bottom-right aligned causal mask (row i sees key j iff ``j <= i + Sk - Sq``).
- EVEN_M / EVEN_N: Sq / Sk are multiples of the block sizes, so loads skip row masks.
- HEAD_DIM < BLOCK_D: head dims that are not powers of two (80, 96, 192) are padded to BLOCK_D
  with masked loads; the padding reads 0 and contributes nothing.
- UPCAST: compute in fp32 from fp32 copies of the tiles. Needed only by Triton 3.6's interpreter,
  which does bf16 arithmetic on the raw bit patterns; always off on the GPU.
- DOT_PRECISION: "ieee" for fp32 inputs (full fp32 products, matching PyTorch's default matmul),
  ignored for fp16/bf16.
Later features are meant to join as more flags on the same kernel: a sliding window adds a masked
head part to ``kv_tile_range``; softcap, ALiBi transform ``S`` next to ``mask_scores``; varlen and
paged KV change only how the base pointers and sequence lengths are found.

Invariants. Masked scores are -inf. A row that sees no key finishes with ``l = 0``: its output is
written as 0 and its LSE as -inf (never NaN). LSE is stored in natural-log units, fp32,
``(B, H, Sq)`` with unit stride along Sq. Batch/head offsets are int64; in-tile offsets are int32.
"""

import triton
import triton.language as tl

from flashcore.kernels.common import (
    kv_tile_range,
    load_tile,
    mask_scores,
    online_softmax_step,
    store_tile,
)

# A tl.constexpr instance, not an annotated float: Triton 3.6's compiler only reads module globals
# that are constexpr objects (the annotation form raises NameError on the GPU; the interpreter
# accepts both).
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _fwd_kv_loop(
    acc,
    m_i,
    l_i,
    q,
    k_ptrs,
    v_ptrs,
    offs_m,
    offs_n,
    offs_d,
    start_n,
    end_n,
    stride_kn,
    stride_vn,
    seqlen_q,
    seqlen_k,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Visit key tiles ``[start_n, end_n)`` with k/v pointers already at ``start_n``.

    MASKED selects the masked-tail variant. Returns the state and the pointers advanced past the
    last tile, so consecutive ranges chain without recomputing 64-bit offsets.
    """
    for tile_n in range(start_n, end_n, BLOCK_N):
        cols = tile_n + offs_n
        # Full tiles lie inside Sk by construction; only the masked tail can run past it.
        k = load_tile(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N or not MASKED, EVEN_D)
        v = load_tile(v_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, EVEN_N or not MASKED, EVEN_D)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            s = mask_scores(s, offs_m, cols, seqlen_q, seqlen_k, IS_CAUSAL, not EVEN_N)
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i, MASKED)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, m_i, l_i, k_ptrs, v_ptrs


@triton.jit
def attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
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
    offs_tm = tl.arange(0, BLOCK_M)

    q_ptrs = (
        Q
        + off_b * stride_qb
        + off_h * stride_qh
        + start_m.to(tl.int64) * stride_qm
        + (offs_tm[:, None] * stride_qm + offs_d[None, :] * stride_qd)
    )
    k_ptrs = (
        K
        + off_b * stride_kb
        + off_hk * stride_kh
        + (offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd)
    )
    v_ptrs = (
        V
        + off_b * stride_vb
        + off_hk * stride_vh
        + (offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd)
    )

    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    full_hi, hi = kv_tile_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL)
    acc, m_i, l_i, k_ptrs, v_ptrs = _fwd_kv_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, 0, full_hi,
        stride_kn, stride_vn, seqlen_q, seqlen_k, qk_scale,
        HEAD_DIM, BLOCK_N, EVEN_D, IS_CAUSAL, False, EVEN_N, UPCAST, DOT_PRECISION,
    )  # fmt: skip
    acc, m_i, l_i, k_ptrs, v_ptrs = _fwd_kv_loop(
        acc, m_i, l_i, q, k_ptrs, v_ptrs, offs_m, offs_n, offs_d, full_hi, hi,
        stride_kn, stride_vn, seqlen_q, seqlen_k, qk_scale,
        HEAD_DIM, BLOCK_N, EVEN_D, IS_CAUSAL, True, EVEN_N, UPCAST, DOT_PRECISION,
    )  # fmt: skip

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    acc = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)

    o_ptrs = (
        O
        + off_b * stride_ob
        + off_h * stride_oh
        + start_m.to(tl.int64) * stride_om
        + (offs_tm[:, None] * stride_om + offs_d[None, :] * stride_od)
    )
    store_tile(
        o_ptrs, acc.to(O.dtype.element_ty), offs_m, seqlen_q, offs_d, HEAD_DIM, EVEN_M, EVEN_D
    )
    lse_ptrs = LSE + off_b * stride_lb + off_h * stride_lh + offs_m
    if EVEN_M:
        tl.store(lse_ptrs, lse)
    else:
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)
