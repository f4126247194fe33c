"""``attention_varlen`` on packed variable-length batches against the per-sequence reference."""

import pytest
import torch

import flashcore
from helpers import (
    check_varlen,
    cu_seqlens,
    make_varlen,
)
from shapes import DTYPES, VARLEN, VARLEN_GPU, VarlenCase


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", VARLEN, ids=[c.id for c in VARLEN])
def test_varlen(case, dtype, causal, device):
    """Forward, then dq, dk, dv through out and lse."""
    check_varlen(case, *make_varlen(case, dtype, device), causal=causal, backward=True)


@pytest.mark.parametrize(
    "masks",
    [{"window": (6, 2)}, {"softcap": 3.0, "alibi": "bh"}, {"window": (9, -1), "alibi": "h"}],
    ids=["window", "softcap-alibi_bh", "left_window-alibi_h"],
)
def test_varlen_masks(masks, device):
    """Window, softcap and ALiBi per sequence: each sequence's own bottom-right alignment and
    positions, ALiBi ``(B, H)`` slopes row b for sequence b; forward and backward, bf16."""
    case = VARLEN[0]
    options = dict(masks)
    alibi = options.pop("alibi", None)
    if alibi is not None:
        shape = (len(case.seqlens_q), case.heads) if alibi == "bh" else (case.heads,)
        options["alibi_slopes"] = torch.rand(shape, device=device)
    check_varlen(
        case, *make_varlen(case, torch.bfloat16, device), causal=False, backward=True, **options
    )


def test_varlen_empty_sequences(device):
    # Sequence 1 has no key: out 0, lse -inf, zero dq. Sequence 2 has no query: zero dk, dv.
    case = VarlenCase(2, 2, (20, 30, 0), (25, 0, 7), 16)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.float16, device)
    out, lse, (dq, dk, dv) = check_varlen(case, q, k, v, cu_q, cu_k, causal=True, backward=True)
    assert torch.all(out[20:] == 0) and torch.all(lse[:, 20:] == float("-inf"))
    assert torch.all(dq[20:] == 0)
    assert torch.all(dk[25:] == 0) and torch.all(dv[25:] == 0)


def test_varlen_matches_attention(device):
    # One sequence is exactly attention on (1, H, S, D): same kernels, same tiles, same bits.
    case = VarlenCase(4, 2, (45,), (70,), 64)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, device)
    out, lse = flashcore.attention_varlen(q, k, v, cu_q, cu_k, 45, 70, causal=True, return_lse=True)
    as_4d = [t.transpose(0, 1)[None] for t in (q, k, v)]
    want_out, want_lse = flashcore.attention(*as_4d, causal=True, return_lse=True)
    assert torch.equal(out, want_out[0].transpose(0, 1))
    assert torch.equal(lse, want_lse[0])


def test_varlen_strided(device):
    # (total, H, D) views with a row stride that is not H * D, and a sliced head dim.
    case = VarlenCase(2, 1, (9, 33), (40, 12), 32)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.float16, device)
    q, k, v = (torch.cat([t, t], dim=-1)[..., 32:] for t in (q, k, v))
    assert not q.is_contiguous()
    check_varlen(case, q, k, v, cu_q, cu_k, causal=True, backward=True)


def test_varlen_strided_offsets(device):
    # cu_seqlens as strided views (every other element of a longer tensor): the same numbers,
    # forward and backward, as with contiguous offsets (the kernels read offset b at base + b).
    case = VarlenCase(2, 1, (9, 33, 20), (40, 12, 20), 32)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.float16, device)

    def spread(cu):
        wide = torch.full((2 * cu.shape[0],), 10**6, dtype=torch.int32, device=device)
        wide[::2] = cu
        return wide[::2]

    strided = spread(cu_q), spread(cu_k)
    assert strided[0].stride(0) == 2
    outs = []
    for offsets in ((cu_q, cu_k), strided):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = flashcore.attention_varlen(qq, kk, vv, *offsets, 33, 40, causal=True)
        out.backward(torch.ones_like(out))
        outs.append((out.detach(), qq.grad, kk.grad, vv.grad))
    for want, got in zip(*outs, strict=True):
        assert torch.equal(want, got)


def test_varlen_zero_size(device, monkeypatch):
    from flashcore.ops import bwd

    monkeypatch.setattr(bwd, "kernels", lambda: pytest.fail("kernel launched on empty input"))
    # No key at all: out 0, lse -inf; no query at all: empty results.
    case = VarlenCase(2, 2, (3, 4), (0, 0), 16)
    q, k, v, cu_q, cu_k = (
        t.requires_grad_(t.is_floating_point()) for t in make_varlen(case, torch.float16, device)
    )
    out, lse = flashcore.attention_varlen(q, k, v, cu_q, cu_k, 4, 0, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert torch.all(dq == 0) and dk.shape == k.shape and dv.shape == v.shape
    empty = torch.zeros(0, 2, 16, device=device)
    cu = cu_seqlens((0,), device)
    out = flashcore.attention_varlen(empty, empty, empty, cu, cu, 0, 0)
    assert out.shape == empty.shape


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", VARLEN_GPU, ids=[c.id for c in VARLEN_GPU])
def test_varlen_gpu(case, dtype, causal):
    check_varlen(case, *make_varlen(case, dtype, "cuda"), causal=causal, backward=True)


@pytest.mark.gpu
def test_varlen_gpu_no_sync():
    # max_seqlen_* are host ints and cu_seqlens is never read on the host: no device sync.
    case = VARLEN_GPU[0]
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    q.requires_grad_()
    maxima = max(case.seqlens_q), max(case.seqlens_k)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = flashcore.attention_varlen(q, k, v, cu_q, cu_k, *maxima, causal=True)
        out.backward(torch.ones_like(out))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _last_tile_cost(lq, lk, block_m, block_n, causal, window, n_tiles):
    """Key tiles of ``block_n`` from the first to the last key the rows of query tile
    ``n_tiles - 1`` see (``reference.visible_mask``), plus one."""
    from flashcore import reference

    rows = slice((n_tiles - 1) * block_m, n_tiles * block_m)
    keys = reference.visible_mask(lq, lk, causal=causal, window=window)[rows].any(0).nonzero()
    return int(keys.max() // block_n - keys.min() // block_n + 2) if keys.numel() else 1


@pytest.mark.parametrize(
    ("lens_q", "lens_k", "causal", "window", "block_m", "max_q"),
    [
        ((421, 1316, 0, 4017, 1, 128, 129), None, False, None, 128, None),
        ((421, 1316, 0, 4017, 1, 128, 129), None, True, None, 192, None),
        ((300, 77, 700, 64), (517, 64, 10, 700), True, None, 64, None),
        ((300, 77, 700, 64), (517, 64, 10, 700), False, (100, 20), 128, None),
        ((300, 77, 700, 64), (517, 64, 10, 700), True, (200, 0), 128, None),
        # 100 sequences (two chunks of them), the grid's longest below the real one (the tiles
        # past it are not listed), and sequences of more programs than a chunk writes.
        (tuple(range(1, 1000, 10)), None, True, None, 128, 500),
        ((4017, 30, 2500), (4017, 30, 2600), True, None, 16, None),
    ],
    ids=["full", "causal", "causal-ragged-k", "window", "causal-window", "many", "long"],
)
def test_work_list(lens_q, lens_k, causal, window, block_m, max_q, device):
    """The Hopper forward's work list of a packed batch (built by one program on the device):
    each sequence's programs (``heads`` per query tile, at most the grid's tiles from
    ``max_seqlen_q``) as consecutive pairs ``(b, 0 .. n - 1)``, every sequence once, costliest
    (by its last tile) first, then ``(-1, 0)`` to the end; their number first."""
    from flashcore.ops import work_list

    lens_k = lens_k or lens_q
    heads, block_n = 3, 64
    cu_q, cu_k = cu_seqlens(lens_q, device), cu_seqlens(lens_k, device)
    max_q = max_q or max(lens_q)
    if window:
        left, right = window[0], window[1] if not causal else max_q + max(lens_k)
    else:
        left = right = 0
    plan = work_list.plan(
        len(lens_q), heads, sum(lens_q), sum(lens_k), max_q, max(lens_k), block_m, block_n,
        causal=causal, window_left=left, window_right=right, has_window=window is not None,
    )  # fmt: skip
    work = work_list.build(plan, cu_q, cu_k)
    pairs = work[2 : 2 + 2 * plan.size].view(-1, 2).tolist()
    want = {}
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k, strict=True)):
        n_tiles = min(-(-lq // block_m), -(-max_q // block_m))
        if n_tiles:
            cost = _last_tile_cost(lq, lk, block_m, block_n, causal, window, n_tiles)
            want[b] = (n_tiles * heads, cost)
    n = sum(items for items, _ in want.values())
    assert plan.size >= n and work[0] == n
    assert pairs[n:] == [[-1, 0]] * (plan.size - n)
    runs = []  # (b, length) of each run of pairs with one b
    for i, (b, r) in enumerate(pairs[:n]):
        if i == 0 or b != pairs[i - 1][0]:
            runs.append([b, 0])
        assert r == runs[-1][1]
        runs[-1][1] += 1
    assert sorted(runs) == sorted([b, items] for b, (items, _) in want.items())
    placed = [want[b][1] for b, _ in runs]
    assert placed == sorted(placed, reverse=True)
