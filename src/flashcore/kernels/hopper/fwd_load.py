"""The producer warp of the Hopper forward (``kernels/hopper/fwd.py``, whose docstring states the
schedule): per work tile, each consumer's Q block and then the K and V tiles of the key loop into
the ring, by TMA, each load after the barrier that says its slot is free; with PERSISTENT, the
program's tiles in the order the consumers walk them, the ring and the Q buffers running on
across tiles.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from flashcore.kernels.hopper.common import (
    ROWS,
    dealt_item,
    item_post,
    kv_tile_range,
    opaque,
    programs,
    sequence,
    snake,
    tma_load,
    work_item,
    zero_rows,
)


@gluon.jit
def _load(desc, off_b, off_h, row, bar, smem, first, PANELS: gl.constexpr):
    """One tile of ``desc`` from ``row`` on, by TMA onto ``bar`` (armed with its bytes), in PANELS
    column panels of the descriptor's box width, into buffers ``first .. first + PANELS - 1``."""
    PANEL: gl.constexpr = desc.block_type.shape[3]
    mbarrier.expect(bar, PANELS * desc.block_type.nbytes)
    for i in gl.static_range(PANELS):
        tma_load(desc, [off_b, off_h, row, i * PANEL], bar, smem.index(first + i))


@gluon.jit
def _load_pages(desc, bt_row, off_h, start_n, seqlen_k, block_size, bar, smem, first,
                PANELS: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """The K or V tile of keys ``start_n .. start_n + BLOCK_N`` of a paged cache (PAGED), by TMA
    onto ``bar`` (armed with the tile's bytes), into buffers ``first .. first + PANELS - 1``.

    ``desc`` is over the cache ``(num_blocks, heads, block_size, D)`` with a box of PAGE_ROWS
    rows: the whole tile from one page where ``block_size`` is a multiple of BLOCK_N (the
    launcher's rule), else one page (``block_size == PAGE_ROWS``) for each PAGE_ROWS rows of
    the tile, each into its row slice of the slot (a multiple of the swizzle's 8-row atom). A
    page after the sequence's last (past ``seqlen_k``, where the block-table row may hold
    anything) is not looked up: that part of the tile comes from the sequence's last page
    again, rows the consumers mask (K) or the producer zeroes (V, ``_fix_v``). Page numbers are
    the table's as they are: one outside the cache puts the copy engine's zeros in the tile
    (its out-of-bounds fill), never a read outside it."""
    PAGE_ROWS: gl.constexpr = desc.block_type.shape[2]
    PANEL: gl.constexpr = desc.block_type.shape[3]
    SUBS: gl.constexpr = BLOCK_N // PAGE_ROWS
    mbarrier.expect(bar, SUBS * PANELS * desc.block_type.nbytes)
    if SUBS == 1:
        page = gl.load(bt_row + start_n // block_size)
        row = start_n % block_size
        for i in gl.static_range(PANELS):
            tma_load(desc, [page, off_h, row, i * PANEL], bar, smem.index(first + i))
    else:
        for s in gl.static_range(SUBS):
            page = gl.load(bt_row + gl.minimum(start_n + s * PAGE_ROWS, seqlen_k - 1) // PAGE_ROWS)
            for i in gl.static_range(PANELS):
                dest = smem.index(first + i).slice(s * PAGE_ROWS, PAGE_ROWS, dim=2)
                tma_load(desc, [page, off_h, 0, i * PANEL], bar, dest)


@gluon.jit
def _fix_v(fix_bar, n_fix, smem, slot, keep, bar):
    """Complete V tile ``slot``, loaded onto the producer's own ``fix_bar`` (phase ``n_fix & 1``),
    of which only the first ``keep`` rows are this sequence's (VARLEN or PAGED, the sequence's
    last key tile): the rows after them hold the next sequence's values or unset memory, and a
    NaN or inf there would turn ``P V``'s zero weights into NaN. The warp waits for the tile,
    zeroes the foreign rows, fences them for the tensor cores' (async) reads, and only then
    completes ``bar`` (``v_ready``, count 1) with a plain arrive."""
    mbarrier.wait(fix_bar, n_fix & 1)
    zero_rows(smem.index(slot).reshape([smem.shape[3], smem.shape[4]]), keep)
    fence_async_shared()
    mbarrier.arrive(bar, count=1)


@gluon.jit
def _producer_tile(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_smem,
    v_smem,
    q_ready,
    q_empty,
    k_ready,
    v_ready,
    kv_empty,
    fix_bar,
    items,
    CU_Q,
    CU_K,
    WORK,
    w,
    it,
    kv0,
    n_fix,
    num_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    divisors,
    window_left,
    window_right,
    total_q,
    total_k,
    BLOCK_TABLE,
    stride_btb,
    block_size,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    PERSISTENT: gl.constexpr,
    VARLEN: gl.constexpr,
    PAGED: gl.constexpr,
    Q_BUFS: gl.constexpr,
    DYNAMIC: gl.constexpr = False,
):
    """Loads of work item ``w``, this program's tile number ``it``, whose K/V tiles take ring
    entries ``kv0, kv0 + 1, ...``, after ``n_fix`` bounded V loads (``_fix_v``); returns how
    many ring entries it took and the bounded loads' new count."""
    # Q and K arrive in PANELS column panels of PANEL (head dim 192: three of 64, as a TMA box
    # must be a power of two wide); one panel otherwise.
    PANELS: gl.constexpr = k_smem.shape[0] // NUM_STAGES
    if VARLEN:
        seqlen_q = opaque(seqlen_q)  # as the consumers' (kernels/hopper/fwd.py: _consumer_tile)
    tile_m, off_b, off_h = work_item(
        WORK, CU_Q, w, seqlen_q, total_q, lpt_heads, num_heads, divisors, BLOCK_M, IS_CAUSAL,
        PERSISTENT, VARLEN,
    )  # fmt: skip
    start_m = tile_m * BLOCK_M
    off_hk = off_h // kv_group
    if PAGED:
        # Sequence off_b's pages, in order (FlashAttention-2's paged varlen).
        bt_row = BLOCK_TABLE + off_b * stride_btb
    q_start, k_start, seqlen_q, seqlen_k, off_b = sequence(
        CU_Q, CU_K, off_b, seqlen_q, seqlen_k, total_q, total_k, VARLEN, PAGED
    )
    lo, _, _, hi = kv_tile_range(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WINDOW, VARLEN,
    )  # fmt: skip
    n_fix = gl.to_tensor(n_fix)  # the flat grid passes 0
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)  # hi >= lo: 0 for a tile that sees no key
    if PERSISTENT:
        # Q buffer it % Q_BUFS, once its consumer has stored the O of tile it - Q_BUFS from it
        # (with one buffer: once its last Q K^T of the previous tile has completed). A tile
        # with no key completes q_ready without a load, so that every tile takes one phase.
        for c in gl.static_range(NUM_CONSUMERS):
            qi = (it % Q_BUFS) * NUM_CONSUMERS + c
            mbarrier.wait(q_empty.index(qi), ((it // Q_BUFS) & 1) ^ 1)
            if DYNAMIC:
                # The item, for consumer c to read once q_ready completes (its release).
                item_post(items, qi, w, 1)
            bar = q_ready.index(qi)
            if hi > lo:
                _load(
                    q_desc, off_b, off_h, q_start + start_m + c * ROWS, bar, q_smem,
                    qi * PANELS, PANELS,
                )  # fmt: skip
            else:
                mbarrier.arrive(bar, count=1)
    if hi > lo:
        if not PERSISTENT:
            for c in gl.static_range(NUM_CONSUMERS):
                _load(
                    q_desc, off_b, off_h, q_start + start_m + c * ROWS, q_ready.index(c), q_smem,
                    c * PANELS, PANELS,
                )  # fmt: skip
        for t in range(n_tiles):
            g = kv0 + t
            slot = g % NUM_STAGES
            phase = (g // NUM_STAGES) & 1
            start_n = lo + t * BLOCK_N
            mbarrier.wait(kv_empty.index(slot), phase ^ 1)  # K of entry g - NUM_STAGES read
            if PAGED:
                _load_pages(
                    k_desc, bt_row, off_hk, start_n, seqlen_k, block_size, k_ready.index(slot),
                    k_smem, slot * PANELS, PANELS, BLOCK_N,
                )  # fmt: skip
            else:
                _load(
                    k_desc, off_b, off_hk, k_start + start_n, k_ready.index(slot), k_smem,
                    slot * PANELS, PANELS,
                )  # fmt: skip
            mbarrier.wait(kv_empty.index(NUM_STAGES + slot), phase ^ 1)  # and its V
            if PAGED:
                # The last tile's rows past the sequence's keys are the page's unset rows (or
                # its last page again): a bounded load.
                if start_n + BLOCK_N > seqlen_k:
                    _load_pages(
                        v_desc, bt_row, off_hk, start_n, seqlen_k, block_size, fix_bar, v_smem,
                        slot, 1, BLOCK_N,
                    )  # fmt: skip
                    _fix_v(fix_bar, n_fix, v_smem, slot, seqlen_k - start_n, v_ready.index(slot))
                    n_fix += 1
                else:
                    _load_pages(
                        v_desc, bt_row, off_hk, start_n, seqlen_k, block_size,
                        v_ready.index(slot), v_smem, slot, 1, BLOCK_N,
                    )  # fmt: skip
            elif VARLEN:
                # Rows past the sequence's keys that the tensor holds (the copy engine fills
                # only rows past the tensor's end with zeros): a bounded load.
                if (start_n + BLOCK_N > seqlen_k) & (k_start + seqlen_k < total_k):
                    _load(v_desc, off_b, off_hk, k_start + start_n, fix_bar, v_smem, slot, 1)
                    _fix_v(fix_bar, n_fix, v_smem, slot, seqlen_k - start_n, v_ready.index(slot))
                    n_fix += 1
                else:
                    _load(
                        v_desc, off_b, off_hk, k_start + start_n, v_ready.index(slot), v_smem,
                        slot, 1,
                    )  # fmt: skip
            else:
                _load(v_desc, off_b, off_hk, start_n, v_ready.index(slot), v_smem, slot, 1)
    return n_tiles, n_fix


@gluon.jit
def producer(
    run,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    PERSISTENT: gl.constexpr,
    VARLEN: gl.constexpr,
    PAGED: gl.constexpr = False,
    Q_BUFS: gl.constexpr = 3,
    DYNAMIC: gl.constexpr = False,
):
    """The producer warp's partition; ``run`` holds the kernel's runtime values it needs
    (``kernels/hopper/fwd.py: attn_fwd_sm90_kernel``)."""
    (
        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
        kv_empty, fix_bar, items, CU_Q, CU_K, WORK, num_heads, kv_group, batch, seqlen_q, seqlen_k,
        lpt_heads,
        divisors, window_left, window_right, total_q, total_k, BLOCK_TABLE, stride_btb,
        block_size,
    ) = run  # fmt: skip
    if PERSISTENT:
        pid = gl.program_id(0)
        grid = programs(pid, VARLEN or (Q_BUFS == 1))
        seqlen_q = opaque(seqlen_q)
        seqlen_k = opaque(seqlen_k)
        num_heads = opaque(num_heads)
        lpt_heads = opaque(lpt_heads)
        n_work = gl.cdiv(seqlen_q, BLOCK_M) * opaque(batch) * num_heads
        kv = 0
        n_fix = 0
        if DYNAMIC:
            # The first wave as dealt, the rest from the counter (WORK), each item posted to the
            # consumers beside its Q (``_producer_tile``); past the last, an item >= n_work
            # with a plain arrive ends their loops.
            wave = 0
            w = pid
            while w < n_work:
                n, n_fix = _producer_tile(
                    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                    v_ready, kv_empty, fix_bar, items, CU_Q, CU_K, WORK, w, wave, kv, n_fix,
                    num_heads, kv_group, seqlen_q, seqlen_k, lpt_heads, divisors, window_left,
                    window_right, total_q, total_k, BLOCK_TABLE, stride_btb, block_size, BLOCK_M,
                    BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL, HAS_WINDOW, PERSISTENT, VARLEN,
                    PAGED, Q_BUFS, DYNAMIC,
                )  # fmt: skip
                kv += n
                wave += 1
                w = dealt_item(WORK, n_work, grid)
            for c in gl.static_range(NUM_CONSUMERS):
                qi = (wave % Q_BUFS) * NUM_CONSUMERS + c
                mbarrier.wait(q_empty.index(qi), ((wave // Q_BUFS) & 1) ^ 1)
                item_post(items, qi, w, 1)
                mbarrier.arrive(q_ready.index(qi), count=1)
        else:
            for wave in range(gl.cdiv(n_work, grid)):
                # Every wave but the last gives each program a tile: the wave is the tile count.
                w = snake(wave, pid, grid)
                if w < n_work:
                    n, n_fix = _producer_tile(
                        q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty,
                        k_ready, v_ready, kv_empty, fix_bar, items, CU_Q, CU_K, WORK, w, wave,
                        kv, n_fix, num_heads, kv_group, seqlen_q, seqlen_k, lpt_heads, divisors,
                        window_left, window_right, total_q, total_k, BLOCK_TABLE, stride_btb,
                        block_size, BLOCK_M, BLOCK_N, NUM_STAGES, NUM_CONSUMERS, IS_CAUSAL,
                        HAS_WINDOW, PERSISTENT, VARLEN, PAGED, Q_BUFS,
                    )  # fmt: skip
                    kv += n
    else:
        _producer_tile(
            q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
            kv_empty, fix_bar, items, CU_Q, CU_K, WORK, gl.program_id(0), 0, 0, 0, num_heads,
            kv_group, seqlen_q, seqlen_k, lpt_heads, divisors, window_left, window_right, total_q,
            total_k, BLOCK_TABLE, stride_btb, block_size, BLOCK_M, BLOCK_N, NUM_STAGES,
            NUM_CONSUMERS, IS_CAUSAL, HAS_WINDOW, PERSISTENT, VARLEN, PAGED, Q_BUFS,
        )  # fmt: skip
