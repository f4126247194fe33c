"""``attention_varlen(..., block_table=)``: packed queries against paged K/V caches (chunked
prefill, FlashAttention-2's paged varlen), forward only, against the reference on the same keys
gathered dense."""

from __future__ import annotations

import itertools

import pytest
import torch

import flashcore
from flashcore import reference
from helpers import cu_seqlens, paged_pools
from numerics import assert_fa_rule


def make_paged(seqlens_q, seqlens_k, heads, kv_heads, d, dv, block_size, dtype, device):
    """Packed q, paged k/v (``helpers.paged_pools``: pages shuffled, two owned by no sequence,
    every unowned row NaN), the block table, the offsets, and the same keys packed dense for the
    reference."""
    q = torch.randn(sum(seqlens_q), heads, d, dtype=dtype, device=device)
    k_dense = torch.randn(sum(seqlens_k), kv_heads, d, dtype=dtype, device=device)
    v_dense = torch.randn(sum(seqlens_k), kv_heads, dv, dtype=dtype, device=device)
    cu_q, cu_k = cu_seqlens(seqlens_q, device), cu_seqlens(seqlens_k, device)
    bounds = list(itertools.pairwise(cu_k.tolist()))
    k, v, table = paged_pools(
        [k_dense[a:b] for a, b in bounds], [v_dense[a:b] for a, b in bounds], block_size
    )
    return q, k, v, table, cu_q, cu_k, k_dense, v_dense


CASES = {
    # name: (seqlens_q, seqlens_k, heads, kv_heads, d, dv, block_size, options)
    "causal-gqa": ((5, 40, 0, 17), (70, 40, 9, 17), 4, 2, 32, 32, 16, {"causal": True}),
    "window-softcap-sinks": (
        (30, 12), (45, 100), 2, 1, 16, 16, 32,
        {"causal": True, "window": (20, 0), "softcap": 5.0, "sinks": True},
    ),
    "no-keys-dv": ((8, 9), (0, 33), 2, 2, 32, 48, 16, {"causal": False}),
    # No sequence holds a key, with a page in the table: max_seqlen_k = 0 is the true maximum.
    "no-keys-at-all": ((3, 5), (0, 0), 2, 2, 32, 32, 16, {"causal": True, "sinks": True}),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_varlen(name, dtype, device):
    seqlens_q, seqlens_k, heads, kv_heads, d, dv, block_size, options = CASES[name]
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(heads, device=device)
    q, k, v, table, cu_q, cu_k, k_dense, v_dense = make_paged(
        seqlens_q, seqlens_k, heads, kv_heads, d, dv, block_size, dtype, device
    )
    maxima = max(seqlens_q), max(seqlens_k)
    out, lse = flashcore.attention_varlen(
        q, k, v, cu_q, cu_k, *maxima, block_table=table, return_lse=True, **options
    )
    assert out.shape == (q.shape[0], heads, dv)
    ref = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, **options)
    pt = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, dtype=dtype, **options)
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse.float(), ref.lse)
    # The same keys packed dense give the same numbers up to rounding.
    want = flashcore.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, *maxima, **options)
    torch.testing.assert_close(out, want, rtol=2e-3, atol=2e-3)


def test_paged_varlen_column_major_table(device):
    # A block table whose rows are not contiguous (column-major storage, same values): the
    # same numbers as the contiguous table (its rows are read as base + j).
    seqlens_q, seqlens_k, heads, kv_heads, d, dv, block_size, options = CASES["causal-gqa"]
    q, k, v, table, cu_q, cu_k, _, _ = make_paged(
        seqlens_q, seqlens_k, heads, kv_heads, d, dv, block_size, torch.float16, device
    )
    column_major = table.t().contiguous().t()
    assert column_major.stride(1) != 1 and torch.equal(column_major, table)
    maxima = max(seqlens_q), max(seqlens_k)
    want = flashcore.attention_varlen(q, k, v, cu_q, cu_k, *maxima, block_table=table, **options)
    got = flashcore.attention_varlen(
        q, k, v, cu_q, cu_k, *maxima, block_table=column_major, **options
    )
    assert torch.equal(want, got)


@pytest.mark.gpu
def test_paged_varlen_gpu():
    seqlens_q, seqlens_k = (512, 1, 1000, 37), (4096, 1, 1000, 3000)
    q, k, v, table, cu_q, cu_k, k_dense, v_dense = make_paged(
        seqlens_q, seqlens_k, 32, 8, 128, 128, 256, torch.bfloat16, "cuda"
    )
    out = flashcore.attention_varlen(
        q, k, v, cu_q, cu_k, 1000, 4096, block_table=table, causal=True
    )
    ref = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, causal=True)
    pt = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, causal=True, dtype=q.dtype)
    assert_fa_rule("out", out, pt.out, ref.out)


def test_paged_varlen_errors(device):
    q, k, v, table, cu_q, cu_k, _, _ = make_paged(
        (4, 4), (20, 30), 2, 1, 16, 16, 16, torch.float32, device
    )
    args = (q, k, v, cu_q, cu_k, 4, 30)
    with pytest.raises(TypeError, match=r"^block_table must be int32"):
        flashcore.attention_varlen(*args, block_table=table.long())
    with pytest.raises(ValueError, match=r"^block_table must have shape \(2, \*\)"):
        flashcore.attention_varlen(*args, block_table=table[:1])
    with pytest.raises(ValueError, match=r"^k must have 4 dims"):
        flashcore.attention_varlen(q, k[0], v[0], cu_q, cu_k, 4, 30, block_table=table)
    with pytest.raises(ValueError, match=r"block_size .* multiple of 16, got 8"):
        flashcore.attention_varlen(
            q, k[:, :, :8], v[:, :, :8], cu_q, cu_k, 4, 16, block_table=table
        )
    with pytest.raises(ValueError, match=r"max_seqlen_k must be .* max_blocks \* block_size"):
        flashcore.attention_varlen(q, k, v, cu_q, cu_k, 4, 33, block_table=table)
    with pytest.raises(NotImplementedError, match=r"block_table is forward-only"):
        flashcore.attention_varlen(q.requires_grad_(), k, v, cu_q, cu_k, 4, 30, block_table=table)


def test_paged_varlen_op(device):
    """The op with a block table: opcheck (no gradient) and torch.compile(fullgraph)."""
    from flashcore.ops import registry as ops

    q, k, v, table, cu_q, cu_k, _, _ = make_paged(
        (3, 5), (17, 9), 2, 1, 16, 16, 16, torch.float32, device
    )
    args = (q, k, v, cu_q, cu_k, 5, 17, True, 0.25, -1, -1, 0.0, None, None, table)
    torch.library.opcheck(ops.attn_fwd, args)

    def fn(q, k, v, cu_q, cu_k, table):
        return flashcore.attention_varlen(
            q, k, v, cu_q, cu_k, 5, 17, causal=True, block_table=table
        )

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, cu_q, cu_k, table)
    assert torch.equal(got, fn(q, k, v, cu_q, cu_k, table))
    torch._dynamo.reset()


@pytest.mark.parametrize("block_n", [16, 32], ids=["tile-in-page", "rows-gathered"])
def test_paged_varlen_both_gathers(block_n, device):
    """Tiles of 16 keys lie in one 16-row page (one lookup a tile); tiles of 32 span two pages
    (a lookup a row): both give the dense numbers."""
    from flashcore.ops import fwd, problem
    from flashcore.tuning import FwdConfig

    seqlens_q, seqlens_k = (7, 20), (50, 37)
    q, k, v, table, cu_q, cu_k, k_dense, v_dense = make_paged(
        seqlens_q, seqlens_k, 2, 1, 16, 16, 16, torch.float32, device
    )
    varlen = problem.Varlen(cu_q, cu_k, 20, 50)
    config = FwdConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=1)
    out, _ = fwd.launch(q, k, v, True, 0.25, config, varlen, block_table=table)
    ref = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, causal=True, scale=0.25)
    pt = reference.attention_varlen(
        q, k_dense, v_dense, cu_q, cu_k, causal=True, scale=0.25, dtype=torch.float32
    )
    assert_fa_rule("out", out, pt.out, ref.out)


# (block_n, block_size, PAGED): pages below the key tile, powers of two (3, shifts and int32
# offsets) or not (1, divisions), and tiles within one page (2).
BLOCK_SIZES = [(64, 16, 3), (32, 16, 3), (64, 32, 3), (32, 48, 1), (64, 48, 1), (16, 32, 2)]


@pytest.mark.parametrize("window", [None, (40, 0)], ids=["causal", "window"])
@pytest.mark.parametrize(
    ("block_n", "block_size", "paged"), BLOCK_SIZES, ids=[f"n{n}-bs{b}" for n, b, _ in BLOCK_SIZES]
)
def test_paged_varlen_block_sizes(block_n, block_size, paged, window, device):
    """Each way a key tile finds its pages gives the dense numbers: causal and with a sliding
    window (its masked band at the left edge), sequences ending mid-page and mid-tile and one
    ending with its last page, so that the lookups a tile ahead meet every range's end."""
    from flashcore.ops import fwd, problem
    from flashcore.tuning import FwdConfig

    seqlens_q, seqlens_k = (9, 50, 1), (150, 64, 33)
    q, k, v, table, cu_q, cu_k, k_dense, v_dense = make_paged(
        seqlens_q, seqlens_k, 2, 1, 16, 16, block_size, torch.float32, device
    )
    assert fwd.paged_mode(k, v, block_n) == paged
    varlen = problem.Varlen(cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    config = FwdConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=1)
    out, lse = fwd.launch(
        q, k, v, True, 0.25, config, varlen, window=window or (-1, -1), block_table=table
    )
    options = {"causal": True, "scale": 0.25, "window": window}
    ref = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, **options)
    pt = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, dtype=torch.float32, **options)
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse.float(), ref.lse)


@pytest.mark.parametrize(("block_n", "block_size", "paged"), [(64, 16, 3), (64, 48, 1)])
def test_paged_varlen_table_entries_outside_the_pool(block_n, block_size, paged, device):
    """The portable forward's lookups a key row (PAGED 1 and 3) clamp a block-table entry
    outside ``[0, num_blocks)`` into the pool as an unsigned number: a negative entry and one
    past the pool read the last page, never memory outside it (the numbers are the reference's
    on the keys those pages hold)."""
    from flashcore.ops import fwd, problem
    from flashcore.tuning import FwdConfig

    seqlens_q, seqlens_k = (9, 50), (150, 64)
    q, k, v, table, cu_q, cu_k, _, _ = make_paged(
        seqlens_q, seqlens_k, 2, 1, 16, 16, block_size, torch.float32, device
    )
    last = k.shape[0] - 1
    k[last], v[last] = torch.randn_like(k[last]), torch.randn_like(v[last])
    table[0, 1], table[1, 0] = -3, last + 1000
    clamped = torch.where((table < 0) | (table > last), last, table)

    def gather(pool):
        rows = [pool[clamped[b]].transpose(1, 2).flatten(0, 1)[:n] for b, n in enumerate(seqlens_k)]
        return torch.cat(rows)

    assert fwd.paged_mode(k, v, block_n) == paged
    varlen = problem.Varlen(cu_q, cu_k, max(seqlens_q), max(seqlens_k))
    config = FwdConfig(block_m=16, block_n=block_n, num_warps=4, num_stages=1)
    out, lse = fwd.launch(q, k, v, True, 0.25, config, varlen, block_table=table)
    k_dense, v_dense = gather(k), gather(v)
    ref = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, causal=True, scale=0.25)
    pt = reference.attention_varlen(
        q, k_dense, v_dense, cu_q, cu_k, causal=True, scale=0.25, dtype=torch.float32
    )
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse.float(), ref.lse)


def test_paged_mode():
    """The launcher's choice of page lookup: a cache of 2**31 elements or more keeps 64-bit
    offsets (PAGED 1) even for power-of-two pages below the tile."""
    from flashcore.ops.fwd import paged_mode

    def cache(pages: int, block_size: int, d: int = 128) -> torch.Tensor:
        return torch.empty(pages, 8, block_size, d, device="meta")

    assert paged_mode(cache(10, 256), cache(10, 256), 64) == 2
    assert paged_mode(cache(10, 64), cache(10, 64), 64) == 2
    assert paged_mode(cache(10, 16), cache(10, 16), 64) == 3
    assert paged_mode(cache(10, 32), cache(10, 32), 128) == 3
    assert paged_mode(cache(10, 48), cache(10, 48), 64) == 1
    # 2**17 pages of 8 x 16 x 128 elements: offsets up to 2**31 - 1.
    assert paged_mode(cache(2**17, 16), cache(2**17, 16), 64) == 3
    assert paged_mode(cache(2**17 + 1, 16), cache(2**17 + 1, 16), 64) == 1
    assert paged_mode(cache(2**17, 16), cache(2**17, 16, 256), 64) == 1


# The Hopper forward on paged caches (ops/fwd_sm90.py: page_rows): pages holding a whole key tile
# or several (one load a tile), and pages of 16, 32 and 64 keys (one load a page). Sequences end
# mid-page, mid-tile and on a page's end; one has a single key, one none.
# name: (seqlens_q, seqlens_k, heads, kv_heads, d, dv, block_size, options)
SM90_PAGED = {
    "bs256-causal-gqa": (
        (300, 1, 700, 37, 5), (1000, 1, 700, 2100, 0), 8, 2, 128, 128, 256, {"causal": True},
    ),
    "bs128-full": ((129, 64, 500), (384, 1, 777), 4, 4, 128, 128, 128, {}),
    "bs16-causal": ((200, 3, 130), (1024, 17, 700), 4, 1, 128, 128, 16, {"causal": True}),
    "bs32-d64-window-softcap-sinks": (
        (400, 90), (900, 1313), 6, 2, 64, 64, 32,
        {"causal": True, "window": (300, 0), "softcap": 20.0, "sinks": True},
    ),
    "bs64-alibi": ((250, 77), (640, 1000), 4, 2, 128, 128, 64, {"alibi": True}),
    "bs16-mla": ((300, 45), (800, 333), 4, 2, 192, 128, 16, {"causal": True}),
    # Equal lengths (causal MLA): the flat grid (the persistent one with one Q buffer a consumer
    # takes dense problems only; fwd_sm90.plan).
    "bs64-mla-even": ((500, 500), (900, 900), 4, 2, 192, 128, 64, {"causal": True}),
    # Head dim 256 (64-key tiles: 16-key pages four a tile, 256-key pages four tiles each) and a
    # head dim the tier pads to 128 (96: the boxes' columns past it are the copy engine's zeros).
    "bs16-d256-causal": ((200, 64), (700, 129), 4, 2, 256, 256, 16, {"causal": True}),
    "bs256-d256": ((130, 7), (600, 1000), 2, 1, 256, 256, 256, {}),
    "bs32-d96-causal": ((300, 20), (1000, 515), 4, 4, 96, 96, 32, {"causal": True}),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(SM90_PAGED))
def test_paged_varlen_gpu_sm90(name, dtype, monkeypatch):
    """Packed queries against paged caches on the Hopper forward (the launch recorded): out and
    LSE against the float64 reference on the keys gathered dense, and the same bits as the Hopper
    forward on those keys packed dense. The pools' unowned rows are NaN (``paged_pools``), so a
    sequence's last V tile must have its foreign rows zeroed."""
    from helpers import record_sm90_forwards, require_sm90

    require_sm90()
    seqlens_q, seqlens_k, heads, kv_heads, d, dv, block_size, options = SM90_PAGED[name]
    options = dict(options)
    if options.pop("sinks", False):
        options["sinks"] = torch.randn(heads, device="cuda")
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(len(seqlens_q), heads, device="cuda")
    q, k, v, table, cu_q, cu_k, k_dense, v_dense = make_paged(
        seqlens_q, seqlens_k, heads, kv_heads, d, dv, block_size, dtype, "cuda"
    )
    maxima = max(seqlens_q), max(seqlens_k)
    forwards = record_sm90_forwards(monkeypatch)
    with flashcore.use_tier("sm90"):
        out, lse = flashcore.attention_varlen(
            q, k, v, cu_q, cu_k, *maxima, block_table=table, return_lse=True, **options
        )
    assert forwards == [1]
    ref = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, **options)
    pt = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, dtype=dtype, **options)
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse.float(), ref.lse)
    with flashcore.use_tier("sm90"):
        want = flashcore.attention_varlen(
            q, k_dense, v_dense, cu_q, cu_k, *maxima, return_lse=True, **options
        )
    assert forwards == [1, 1]
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.gpu
def test_paged_varlen_gpu_sm90_page_sizes_it_leaves(monkeypatch):
    """Pages the Hopper forward's tiles do not fit (48 keys: neither a power of two below the
    128-key tile nor a multiple of it) run the portable forward, with the same numbers."""
    from helpers import record_sm90_forwards, require_sm90

    require_sm90()
    q, k, v, table, cu_q, cu_k, k_dense, v_dense = make_paged(
        (100, 30), (500, 200), 4, 2, 128, 128, 48, torch.bfloat16, "cuda"
    )
    forwards = record_sm90_forwards(monkeypatch)
    with flashcore.use_tier("sm90"):
        out = flashcore.attention_varlen(q, k, v, cu_q, cu_k, 100, 500, block_table=table)
    assert forwards == []
    ref = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k)
    pt = reference.attention_varlen(q, k_dense, v_dense, cu_q, cu_k, dtype=q.dtype)
    assert_fa_rule("out", out, pt.out, ref.out)


def test_sm90_page_rows():
    """The Hopper forward's box for a page size (no GPU needed): the tile where pages hold a
    multiple of it, one page where a page is a power of two of at least 8 rows below it, else
    the tier leaves the problem to the portable forward."""
    from flashcore.ops.fwd_sm90 import page_rows

    assert [page_rows(bs, 128) for bs in (128, 256, 1024)] == [128, 128, 128]
    assert [page_rows(bs, 128) for bs in (8, 16, 32, 64)] == [8, 16, 32, 64]
    assert [page_rows(bs, 128) for bs in (48, 96, 192, 4)] == [None] * 4
    assert [page_rows(bs, 64) for bs in (64, 192, 16)] == [64, 64, 16]


@pytest.mark.parametrize("block_size", [16, 64, 256, 48])
def test_sm90_plan_paged(block_size, monkeypatch):
    """The Hopper forward's launch plan for paged caches, built on the CPU (the SM count stood
    in): the K/V boxes one page or the key tile (``page_rows``), the page size, the block table's
    row stride and the keys' bound (the table row's pages) among the scalars where the kernel
    takes them, PAGED on; None for a page size its tiles do not fit; a packed batch without a
    table keeps PAGED off and the placeholders 0 and 1."""
    from flashcore.ops import fwd_sm90, runtime
    from flashcore.ops.problem import Varlen

    if not runtime.sm90_verified():
        pytest.skip(f"the sm90 tier is verified on Triton {runtime.SM90_TRITON} only")
    monkeypatch.setattr(fwd_sm90, "num_sms", lambda index: 132)
    heads, kv_heads, d, batch, max_blocks = 8, 2, 128, 3, 4096 // block_size + 2
    q = torch.empty(3000, heads, d, dtype=torch.bfloat16)
    k = torch.empty(100, kv_heads, block_size, d, dtype=torch.bfloat16)
    table = torch.zeros(max_blocks, batch, dtype=torch.int32).t()  # rows strided by 1
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    varlen = Varlen(cu, cu, 1024, 4096)
    lse = torch.empty(heads, 3000)
    options = dict(
        causal=True, qk_scale=0.1, window_left=-1, window_right=-1, has_window=False,
        softcap=0.0, alibi=False, sinks=False, stride_ab=0, varlen=varlen,
        out_strides=(heads * d, d),
    )  # fmt: skip
    names = fwd_sm90.kernels().attn_fwd_sm90_kernel.arg_names[12:]
    p = fwd_sm90.plan(q, k, k, lse, block_table=table, **options)
    rows = fwd_sm90.page_rows(block_size, 128)
    if rows is None:
        assert p is None
        return
    assert p.meta["PAGED"] and p.meta["BLOCK_N"] == 128
    assert p.boxes[1] == [1, 1, rows, d] and p.boxes[2] == [1, 1, rows, d]
    scalars = dict(zip(names, p.scalars, strict=False))
    assert scalars["block_size"] == block_size and scalars["stride_btb"] == 1
    assert scalars["total_q"] == 3000 and scalars["total_k"] == max_blocks * block_size
    dense = fwd_sm90.plan(q, q, q, lse, **options)
    assert not dense.meta["PAGED"] and dense.boxes[1] == [1, 1, 128, d]
    scalars = dict(zip(names, dense.scalars, strict=False))
    assert (scalars["stride_btb"], scalars["block_size"], scalars["total_k"]) == (0, 1, 3000)
