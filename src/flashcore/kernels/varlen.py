"""Packed variable-length batches (FlashAttention-2's varlen): where a sequence's rows are.

A packed batch stores its sequences back to back along the row dim of a ``(total, heads, D)``
tensor; ``CU`` holds the int32 prefix sums ``[0, len_0, len_0 + len_1, ..., total]`` of their
lengths. The kernels take the batch index from the grid, call ``seq_bounds`` in their prologue,
move their base pointers to the sequence's first row and run the sequence as one ordinary
problem of its own lengths.
"""

import triton
import triton.language as tl

from flashcore.kernels.common import kv_tile_range


@triton.jit
def seq_bounds(CU, b, total):
    """``(first row, length)`` of sequence b: ``CU[b]`` as int64 (it scales row strides into
    offsets that may pass 2**31) and ``CU[b + 1] - CU[b]`` as int32, like the kernels' lengths.

    Both offsets are clamped to ``[0, total]`` (the packed rows, or a paged sequence's capacity)
    and the end to at least the start: offsets that are not as documented give wrong numbers for
    their own sequence, never an access outside the tensors."""
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), total)
    end = tl.minimum(tl.maximum(tl.load(CU + b + 1), start), total)
    return start.to(tl.int64), end - start


@triton.jit
def _sequences(CU_Q, CU_K, b0, batch, total_q, total_k, max_tiles, BLOCK_M, CHUNK_B: tl.constexpr):
    """Lengths and query-tile counts of sequences ``b0 .. b0 + CHUNK_B - 1`` (0 past the batch);
    a sequence's tiles stop at ``max_tiles`` (the grid's, from the stated longest length)."""
    offs_b = b0 + tl.arange(0, CHUNK_B)
    in_batch = offs_b < batch
    b = tl.minimum(offs_b, batch - 1)
    _, len_q = seq_bounds(CU_Q, b, total_q)
    _, len_k = seq_bounds(CU_K, b, total_k)
    len_q = tl.where(in_batch, len_q, 0)
    n_tiles = tl.minimum(tl.cdiv(len_q, BLOCK_M), max_tiles)
    return offs_b, len_q, tl.where(in_batch, len_k, 0), n_tiles


@triton.jit
def _items(
    offs_b,
    len_q,
    len_k,
    n_tiles,
    t0,
    window_left,
    window_right,
    BLOCK_M,
    BLOCK_N: tl.constexpr,
    N_COSTS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    """``(valid, cost, code)`` of query tiles ``t0 .. t0 + CHUNK_T - 1`` of each sequence: the
    key tiles the tile's rows see plus one for its fixed work (``ops/fwd_sm90.py: tile_costs``,
    capped at ``N_COSTS - 1``; 0 where ``valid`` is not), and its code ``b * 2**16 + t``."""
    t = tl.expand_dims(t0 + tl.arange(0, CHUNK_T), 0)
    valid = t < tl.expand_dims(n_tiles, 1)
    lq = tl.expand_dims(len_q, 1)
    lk = tl.expand_dims(len_k, 1)
    lo, _, _, hi = kv_tile_range(
        t * BLOCK_M, lq, lk, window_left, window_right, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_WINDOW
    )
    cost = tl.minimum(tl.maximum(tl.cdiv(hi - lo, BLOCK_N), 0) + 1, N_COSTS - 1)
    # Cost 0 for the lanes that are no tile (every tile costs at least 1).
    cost = tl.where(valid, cost, 0)
    code = tl.expand_dims(offs_b, 1) * 65536 + t
    return valid, cost, code


@triton.jit
def work_list_kernel(
    CU_Q,
    CU_K,
    WORK,
    batch,
    total_q,
    total_k,
    max_tiles,
    size,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_COSTS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CHUNK_B: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    """The work list of a packed batch, one program: every query tile of ``BLOCK_M`` rows of
    every sequence (the first ``max_tiles`` of each) as ``b * 2**16 + t``, costliest first, in
    ``WORK[0 .. n)``, and -1 in ``WORK[n .. size)``. A tile's cost is the number of key tiles
    of ``BLOCK_N`` its rows see (``kernels/common.py: kv_tile_range``, bottom-right causal,
    window) plus one. ``WORK[size .. size + N_COSTS)`` is scratch (one counter per cost).

    A counting sort: a histogram of the costs, each cost's first place (the costlier tiles
    before it), then each tile's place by an atomic increment of its cost's counter. The order
    among tiles of equal cost is whatever the atomics give; the forward computes each tile the
    same way wherever it stands in the list, so its results do not depend on it. The Hopper
    forward's flat grid takes item ``w // heads`` for head ``w % heads``: every head of the
    costliest tiles first, which the hardware hands to the SMs in order (longest first)."""
    costs = tl.arange(0, N_COSTS)
    hist = tl.zeros([N_COSTS], dtype=tl.int32)
    for b0 in range(0, batch, CHUNK_B):
        offs_b, len_q, len_k, n_tiles = _sequences(
            CU_Q, CU_K, b0, batch, total_q, total_k, max_tiles, BLOCK_M, CHUNK_B
        )
        for t0 in range(0, tl.max(n_tiles, 0), CHUNK_T):
            valid, cost, _ = _items(
                offs_b, len_q, len_k, n_tiles, t0, window_left, window_right, BLOCK_M, BLOCK_N,
                N_COSTS, IS_CAUSAL, HAS_WINDOW, CHUNK_T,
            )  # fmt: skip
            hist += tl.histogram(tl.reshape(cost, [CHUNK_B * CHUNK_T]), N_COSTS)
    hist = tl.where(costs > 0, hist, 0)
    n_items = tl.sum(hist, 0)
    # Exchanged rather than stored: the counters are then only ever touched by atomics, at the
    # L2, in program order behind the barrier.
    tl.atomic_xchg(WORK + size + costs, tl.cumsum(hist, 0, reverse=True) - hist)
    tl.debug_barrier()
    for b0 in range(0, batch, CHUNK_B):
        offs_b, len_q, len_k, n_tiles = _sequences(
            CU_Q, CU_K, b0, batch, total_q, total_k, max_tiles, BLOCK_M, CHUNK_B
        )
        for t0 in range(0, tl.max(n_tiles, 0), CHUNK_T):
            valid, cost, code = _items(
                offs_b, len_q, len_k, n_tiles, t0, window_left, window_right, BLOCK_M, BLOCK_N,
                N_COSTS, IS_CAUSAL, HAS_WINDOW, CHUNK_T,
            )  # fmt: skip
            place = tl.atomic_add(WORK + size + cost, 1, mask=valid)
            tl.store(WORK + place, code, mask=valid)
    for i0 in range(0, size, CHUNK_B * CHUNK_T):
        i = i0 + tl.arange(0, CHUNK_B * CHUNK_T)
        tl.store(WORK + i, -1, mask=(i >= n_items) & (i < size))
