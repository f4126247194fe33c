"""Packed variable-length batches (FlashAttention-2's varlen): where a sequence's rows are.

A packed batch stores its sequences back to back along the row dim of a ``(total, heads, D)``
tensor; ``CU`` holds the int32 prefix sums ``[0, len_0, len_0 + len_1, ..., total]`` of their
lengths. The kernels take the batch index from the grid, call ``seq_bounds`` in their prologue,
move their base pointers to the sequence's first row and run the sequence as one ordinary
problem of its own lengths. ``work_list_kernel`` builds, on the device, the list of programs the
Hopper forward's flat grid runs for a packed batch whose lengths vary (``ops/work_list.py``).
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
def _sequences(
    CU_Q,
    CU_K,
    b0,
    batch,
    total_q,
    total_k,
    max_tiles,
    num_heads,
    window_left,
    window_right,
    BLOCK_M,
    BLOCK_N: tl.constexpr,
    N_COSTS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CHUNK_B: tl.constexpr,
):
    """``(b, items, cost)`` of sequences ``b0 .. b0 + CHUNK_B - 1``: ``items`` is its number of
    programs, ``num_heads`` per query tile of BLOCK_M rows (0 past the batch; at most
    ``max_tiles`` tiles, the grid's, from the stated longest length), and ``cost`` the key tiles
    of BLOCK_N its last query tile sees plus one (``kernels/common.py: kv_tile_range``, capped at
    ``N_COSTS - 1``): the heaviest causal tile, every tile without a mask."""
    offs_b = b0 + tl.arange(0, CHUNK_B)
    in_batch = offs_b < batch
    b = tl.minimum(offs_b, batch - 1)
    _, len_q = seq_bounds(CU_Q, b, total_q)
    _, len_k = seq_bounds(CU_K, b, total_k)
    n_tiles = tl.where(in_batch, tl.minimum(tl.cdiv(len_q, BLOCK_M), max_tiles), 0)
    lo, _, _, hi = kv_tile_range(
        (n_tiles - 1) * BLOCK_M, len_q, len_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW,
    )  # fmt: skip
    cost = tl.minimum(tl.maximum(tl.cdiv(hi - lo, BLOCK_N), 0) + 1, N_COSTS - 1)
    return offs_b, n_tiles * num_heads, cost


@triton.jit
def work_list_kernel(
    CU_Q,
    CU_K,
    WORK,
    batch,
    total_q,
    total_k,
    max_tiles,
    num_heads,
    size,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    N_COSTS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    CHUNK_B: tl.constexpr,
    CHUNK_R: tl.constexpr,
):
    """The work list of a packed batch, one program: for each sequence b with ``n`` programs
    (``num_heads`` per query tile), the pairs ``(b, r)``, ``r = 0 .. n - 1``, one after another
    in ``WORK[2 + 2 i], WORK[3 + 2 i]``; the sequences costliest first (by their last query
    tile's key tiles, ``_sequences``); then ``(-1, 0)`` up to ``size`` pairs. ``WORK[0]`` is the
    number of pairs before those; ``WORK[2 + 2 size ..]`` is scratch (a count and a counter per
    cost, ``2 N_COSTS``).

    The Hopper forward's work item ``w`` is pair ``w``, program ``r`` of a grid over sequence b
    alone, in the order the dense grid has (``kernels/hopper/common.py:
    work_item``): a sequence's heads and tiles stay together as there, so that the programs in
    flight share their K and V in the L2, and no program falls past a sequence's end. The
    sequences' order is a counting sort (each sequence's place by an atomic add of its programs
    to its cost's counter), so sequences of equal cost come in whatever order the atomics give;
    the forward computes each program the same way wherever it stands, so its results do not
    depend on it."""
    costs = tl.arange(0, N_COSTS)
    PAIRS = WORK + 2
    COUNT = PAIRS + 2 * size
    NEXT = COUNT + N_COSTS
    # The scratch is only ever touched by atomics (at the L2), ordered by the barriers.
    tl.atomic_xchg(COUNT + costs, 0)
    tl.debug_barrier()
    for b0 in range(0, batch, CHUNK_B):
        offs_b, items, cost = _sequences(
            CU_Q, CU_K, b0, batch, total_q, total_k, max_tiles, num_heads, window_left,
            window_right, BLOCK_M, BLOCK_N, N_COSTS, IS_CAUSAL, HAS_WINDOW, CHUNK_B,
        )  # fmt: skip
        tl.atomic_add(COUNT + cost, items, mask=items > 0)
    tl.debug_barrier()
    count = tl.atomic_add(COUNT + costs, 0)
    n_items = tl.sum(count, 0)
    tl.store(WORK, n_items)
    # Descending cost: a cost's first place is after every costlier program.
    tl.atomic_xchg(NEXT + costs, tl.cumsum(count, 0, reverse=True) - count)
    tl.debug_barrier()
    r = tl.expand_dims(tl.arange(0, CHUNK_R), 0)
    for b0 in range(0, batch, CHUNK_B):
        offs_b, items, cost = _sequences(
            CU_Q, CU_K, b0, batch, total_q, total_k, max_tiles, num_heads, window_left,
            window_right, BLOCK_M, BLOCK_N, N_COSTS, IS_CAUSAL, HAS_WINDOW, CHUNK_B,
        )  # fmt: skip
        first = tl.expand_dims(tl.atomic_add(NEXT + cost, items, mask=items > 0), 1)
        b = tl.expand_dims(offs_b, 1)
        n = tl.expand_dims(items, 1)
        for r0 in range(0, tl.max(items, 0), CHUNK_R):
            keep = r0 + r < n
            tl.store(PAIRS + 2 * (first + r0 + r), b, mask=keep)
            tl.store(PAIRS + 2 * (first + r0 + r) + 1, r0 + r, mask=keep)
    for i0 in range(0, size, CHUNK_B * CHUNK_R):
        i = i0 + tl.arange(0, CHUNK_B * CHUNK_R)
        rest = (i >= n_items) & (i < size)
        tl.store(PAIRS + 2 * i, -1, mask=rest)
        tl.store(PAIRS + 2 * i + 1, 0, mask=rest)
