"""``attention_varlen`` on the Hopper tier: packed batches through the Hopper forward and
backwards (head dims 64/128, 256 and MLA's) against the per-sequence reference, sequences kept
apart, the work list, and the rules that pick the grid and the tier for a packed batch."""

import pytest
import torch

import flashcore
from flashcore import tuning
from helpers import (
    check_varlen,
    make_varlen,
    record_backward_tiers,
    record_sm90_forwards,
    require_sm90,
    sm90_backward_switch,
    spy_d256,
)
from shapes import VarlenCase

# Packed batches through the Hopper forward (use_tier("sm90")): sequences shorter than a
# consumer's 64 rows, empty ones, lengths at and past the tiles' edges, and the builds the
# launcher picks from the longest lengths: (case, V's head dim, options).
VARLEN_SM90 = [
    # D = 128: two consumers, on the flat grid (lengths that vary: fwd_sm90_configs.varlen_spread)
    # or the persistent one (lengths near equal).
    (VarlenCase(8, 2, (1000, 1003, 990, 1017), (1000, 1003, 990, 1017), 128), 128, {}),
    (VarlenCase(8, 2, (1000, 1003, 990, 1017), (1100, 1003, 990, 1017), 128), 128,
     {"causal": True}),
    (VarlenCase(8, 2, (300, 1, 0, 129, 64, 1000), (517, 64, 10, 129, 0, 1000), 128), 128, {}),
    (VarlenCase(8, 2, (300, 1, 0, 129, 64, 1000), (517, 64, 10, 129, 0, 1000), 128), 128,
     {"causal": True}),
    # D = 64 (the config by the longest lengths, fwd_sm90.plan): three consumers, and causal up
    # to 1024 one consumer a CTA, two or three CTAs an SM by the grid.
    (VarlenCase(4, 4, (4000, 3000, 2100, 1), (4000, 3000, 2100, 2), 64), 64, {}),
    (VarlenCase(4, 4, (2100, 2048, 2200, 2150), (2100, 2048, 2200, 2150), 64), 64, {}),
    (VarlenCase(8, 8, (200, 511, 33, 480), (200, 511, 40, 480), 64), 64, {"causal": True}),
    (VarlenCase(40, 8, (200, 511, 33, 480, 300, 400, 64, 450), (200, 511, 40, 480, 300, 400,
     64, 450), 64), 64, {"causal": True}),
    # Head dims 256, MLA's (192, 128) and a padded 80 (O's columns past 80 never written).
    (VarlenCase(4, 2, (300, 77, 700), (517, 64, 700), 256), 256, {"causal": True}),
    (VarlenCase(4, 4, (300, 77, 700), (517, 64, 700), 192), 128, {"causal": True}),
    # ... at equal lengths (packed, the flat grid: the persistent one with one Q buffer a
    # consumer takes dense problems only; fwd_sm90.plan).
    (VarlenCase(4, 4, (700, 700, 700), (900, 900, 900), 192), 128, {"causal": True}),
    (VarlenCase(4, 2, (300, 77, 700), (517, 64, 700), 80), 80, {}),
    # Window, softcap, ALiBi (per-sequence slopes) and sinks.
    (VarlenCase(4, 2, (300, 1, 129, 900), (517, 64, 129, 900), 128), 128,
     {"window": (100, 20), "softcap": 30.0}),
    (VarlenCase(4, 2, (300, 1, 129, 900), (517, 64, 129, 900), 128), 128,
     {"causal": True, "alibi": "bh", "sinks": True}),
]  # fmt: skip


def _sm90_case_id(entry) -> str:
    case, dv, opts = entry
    names = "-".join(k if v is True else f"{k}{v}" for k, v in opts.items())
    return f"{case.id}-v{dv}" + (f"-{names}" if names else "")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("case", "dv", "opts"), VARLEN_SM90, ids=[_sm90_case_id(e) for e in VARLEN_SM90]
)
def test_varlen_gpu_sm90(monkeypatch, case, dv, opts, dtype):
    """The Hopper forward on packed batches (the launch recorded): out and LSE per sequence
    against the float64 reference, and every row written (the same bits as a direct launch into
    NaN-filled tensors)."""
    from flashcore.ops.problem import Varlen
    from helpers import launch_sm90_forward

    require_sm90()
    forwards = record_sm90_forwards(monkeypatch)
    q, k, v, cu_q, cu_k = make_varlen(case, dtype, "cuda")
    if dv != case.head_dim:
        v = torch.randn(*v.shape[:-1], dv, dtype=dtype, device="cuda")
    opts = dict(opts)
    causal = opts.pop("causal", False)
    if opts.pop("alibi", None):
        opts["alibi_slopes"] = torch.rand(len(case.seqlens_q), case.heads, device="cuda")
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(case.heads, device="cuda")
    with flashcore.use_tier("sm90"):
        out, lse, _ = check_varlen(case, q, k, v, cu_q, cu_k, causal=causal, backward=False, **opts)
    assert forwards == [1]
    maxima = max(case.seqlens_q), max(case.seqlens_k)
    direct = launch_sm90_forward(q, k, v, causal=causal, varlen=Varlen(cu_q, cu_k, *maxima), **opts)
    assert torch.equal(direct[0], out) and torch.equal(direct[1], lse)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_gpu_sm90_sequences_isolated(causal, head_dim):
    """A sequence's key tiles reach into the next sequence's rows (or past the last offset):
    whatever those rows hold, NaN or inf included, the sequence's results are the same bits.
    The Hopper forward zeroes those V rows before ``P V`` (``0 * inf`` would be NaN)."""

    require_sm90()
    case = VarlenCase(4, 2, (100, 37, 260, 5), (130, 37, 300, 9), head_dim)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    maxima = max(case.seqlens_q), max(case.seqlens_k)

    def run(k, v):
        with flashcore.use_tier("sm90"):
            return flashcore.attention_varlen(
                q, k, v, cu_q, cu_k, *maxima, causal=causal, return_lse=True
            )

    out, lse = run(k, v)
    assert not out.isnan().any()
    # Rows past the last offset hold NaN.
    pad = torch.full((45, *k.shape[1:]), float("nan"), dtype=k.dtype, device="cuda")
    got = run(torch.cat([k, pad]), torch.cat([v, pad]))
    assert torch.equal(got[0], out) and torch.equal(got[1], lse)
    # Sequence 1's keys and values are inf: the other sequences' rows keep their bits.
    k1, v1 = k.clone(), v.clone()
    k1[130:167], v1[130:167] = float("inf"), float("inf")
    got_out, got_lse = run(k1, v1)
    others = torch.ones(q.shape[0], dtype=torch.bool, device="cuda")
    others[100:137] = False
    assert torch.equal(got_out[others], out[others])
    assert torch.equal(got_lse[:, others], lse[:, others])


# Packed batches through the Hopper backward (use_tier("sm90")): sequences empty, shorter than
# a step's 64 rows, at and past the 64-row and 128-key edges, Sq != Sk, a padded head dim, the
# score options, GQA with and without the group split (ops/bwd_sm90.py: split_group; the
# 16-head batch has enough programs not to split), and D = 64's dQ warpgroup.
VARLEN_SM90_BWD = [
    (VarlenCase(8, 2, (300, 1, 0, 129, 64, 1000), (517, 64, 10, 129, 0, 1000), 128), {}),
    (VarlenCase(8, 2, (300, 1, 0, 129, 64, 1000), (517, 64, 10, 129, 0, 1000), 128),
     {"causal": True}),
    (VarlenCase(4, 4, (1000, 3000, 2100, 1), (1000, 3000, 2100, 2), 64), {}),
    (VarlenCase(8, 8, (200, 511, 33, 480, 64), (200, 511, 40, 480, 65), 64), {"causal": True}),
    (VarlenCase(4, 2, (300, 77, 700), (517, 64, 700), 80), {}),
    (VarlenCase(4, 2, (300, 1, 129, 900), (517, 64, 129, 900), 128),
     {"window": (100, 20), "softcap": 30.0}),
    (VarlenCase(4, 2, (300, 1, 129, 900), (517, 64, 129, 900), 128),
     {"causal": True, "alibi": "bh"}),
    (VarlenCase(16, 4, (1900, 2000, 1, 2048, 1500, 2100, 1800, 640),
     (1900, 2000, 7, 2048, 1500, 2100, 1800, 640), 128), {"causal": True}),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("case", "opts"), VARLEN_SM90_BWD, ids=[_sm90_case_id((c, c.head_dim, o)) for c, o in
                                            VARLEN_SM90_BWD]
)  # fmt: skip
def test_varlen_gpu_sm90_backward(monkeypatch, case, opts, dtype):
    """The Hopper backward on packed batches (the tier recorded): dq, dk, dv per sequence
    against the float64 reference with FlashAttention's rule."""
    require_sm90()
    ran = record_backward_tiers(monkeypatch)
    check_sm90_backward(case, opts, dtype)
    assert ran == ["sm90"]


def check_sm90_backward(case, opts: dict, dtype) -> None:
    """One packed batch of ``VARLEN_SM90_BWD`` forward and backward under ``use_tier("sm90")``,
    against the float64 reference."""
    q, k, v, cu_q, cu_k = make_varlen(case, dtype, "cuda")
    opts = dict(opts)
    causal = opts.pop("causal", False)
    if opts.pop("alibi", None):
        opts["alibi_slopes"] = torch.rand(len(case.seqlens_q), case.heads, device="cuda")
    with flashcore.use_tier("sm90"):
        check_varlen(case, q, k, v, cu_q, cu_k, causal=causal, backward=True, **opts)


VARLEN_SM90_FRESH = [row for row in VARLEN_SM90_BWD if row[0].head_dim == 128]


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("case", "opts"), VARLEN_SM90_FRESH, ids=[_sm90_case_id((c, c.head_dim, o)) for c, o in
                                              VARLEN_SM90_FRESH]
)  # fmt: skip
def test_varlen_gpu_sm90_backward_fresh_desc(monkeypatch, case, opts):
    """The Hopper backward on packed batches with ``bwd_sm90.FRESH_DESC_ALWAYS`` (the consumers'
    fixed tiles' descriptors formed in the step loop, causal too), bf16, as
    ``test_varlen_gpu_sm90_backward``."""
    with sm90_backward_switch(monkeypatch, "FRESH_DESC_ALWAYS") as plans:
        check_sm90_backward(case, opts, torch.bfloat16)
        assert plans and all(p.main_meta["FRESH_DESC"] for p in plans.values())


VARLEN_SM90_BAND = [
    (VarlenCase(8, 2, (700, 1, 1300, 64), (700, 90, 1000, 64), 128), {"window": (127, 0)}),
    (VarlenCase(4, 4, (513, 1000, 300), (513, 1100, 300), 64), {"window": (100, 0),
                                                                "softcap": 20.0}),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("case", "opts"), VARLEN_SM90_BAND, ids=[_sm90_case_id((c, c.head_dim, o)) for c, o in
                                             VARLEN_SM90_BAND]
)  # fmt: skip
def test_varlen_gpu_sm90_backward_band_mask(monkeypatch, case, opts):
    """The Hopper backward on packed batches, causal with a window, with ``bwd_sm90.BAND_MASK``
    (the diagonal's and the window's masks as one comparison; on as shipped, and set here so
    that the test keeps it covered if the default changes), bf16, as
    ``test_varlen_gpu_sm90_backward``."""
    with sm90_backward_switch(monkeypatch, "BAND_MASK") as plans:
        check_sm90_backward(case, {"causal": True, **opts}, torch.bfloat16)
        assert plans and all(p.main_meta["BAND_MASK"] for p in plans.values())


VARLEN_SM90_LAG = [
    (VarlenCase(8, 2, (700, 1, 1300, 64), (700, 90, 1000, 64), 128), {"causal": True,
                                                                      "softcap": 30.0}),
    (VarlenCase(4, 4, (513, 1000, 300), (513, 1100, 300), 128), {"window": (100, 20),
                                                                 "alibi": True, "softcap": 20.0}),
    (VarlenCase(4, 2, (1, 900, 1300), (1, 900, 1300), 128), {"causal": True, "alibi": True}),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("case", "opts"), VARLEN_SM90_LAG, ids=[_sm90_case_id((c, c.head_dim, o)) for c, o in
                                            VARLEN_SM90_LAG]
)  # fmt: skip
def test_varlen_gpu_sm90_backward_lag_options(monkeypatch, case, opts):
    """The Hopper backward on packed batches with softcap or causal ALiBi at D=128 and
    ``bwd_sm90.DQ_LAG_OPTIONS`` (each step's dQ a step late), bf16, as
    ``test_varlen_gpu_sm90_backward``."""
    with sm90_backward_switch(monkeypatch, "DQ_LAG_OPTIONS") as plans:
        check_sm90_backward(case, opts, torch.bfloat16)
        assert plans and all(p.main_meta["LAG_OPTIONS"] for p in plans.values())


@pytest.mark.gpu
def test_varlen_gpu_deterministic_keeps_portable_backward(monkeypatch):
    """``deterministic=True`` keeps a packed batch's backward on the portable tier (no
    reduce-adds): two runs give the same bits; without it "auto" takes the Hopper backward."""
    require_sm90()
    ran = record_backward_tiers(monkeypatch)
    # 2e10 FLOPs: under the eager floor that keeps such a batch portable (the test's subject is
    # deterministic=True, so "auto" is let take the Hopper backward by its lengths alone).
    monkeypatch.setattr(tuning, "SM90_BWD_MIN_FLOPS", 0.0)
    case = VarlenCase(8, 2, (3000, 2100, 2500), (3000, 2100, 2600), 128)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)

    def grads(deterministic):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = flashcore.attention_varlen(
            *leaves, cu_q, cu_k, 3000, 3000, causal=True, deterministic=deterministic
        )
        return torch.autograd.grad(out, leaves, dout)

    first, second = grads(True), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    grads(False)
    assert ran == ["portable", "portable", "sm90"]


def test_varlen_sm90_backward_judges_mean_lengths(monkeypatch):
    """ "auto" takes the Hopper backward for a packed batch by its mean lengths (total rows over
    sequences) on the packed floors, and the FLOPs those means give on the eager floor, and asks
    ``supports`` with the packing."""
    from flashcore.ops import bwd, bwd_sm90, runtime
    from flashcore.ops.problem import Varlen

    asked = []
    monkeypatch.setattr(runtime, "tier_forced", lambda: False)
    monkeypatch.setattr(
        bwd_sm90, "supports", lambda *a, **kw: asked.append(kw["varlen"]) or kw["varlen"]
    )

    def wanted(total, batch, longest, causal=False, capturing=False):
        q = torch.empty(total, 16, 128, dtype=torch.bfloat16)
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        varlen = Varlen(cu, cu, longest, longest)
        return bwd._takes_sm90(q, q, q, q, q, q, causal, (-1, -1), None, varlen, capturing)

    assert wanted(16 * 2048, 16, 4096)
    assert wanted(192 * 277, 192, 512)  # mean 277: above the packed floor of 256 at D = 128
    assert not wanted(256 * 200, 256, 512)  # mean 200: below it
    assert not wanted(16 * 380, 16, 4096, causal=True)  # causal D = 128: from 384
    assert wanted(64 * 512, 64, 1024, causal=True)  # 6.9e10 FLOPs
    assert not wanted(8 * 512, 8, 1024)  # 4k tokens: 1.7e10 FLOPs, under the eager floor
    assert wanted(8 * 512, 8, 1024, capturing=True)  # captured: no FLOP floor
    assert asked == [True] * 4


def poison_neighbours(grads, same, q, k, v, dout) -> None:
    """The sequence-isolation checks of a packed backward over ``VarlenCase(4, 2, (100, 37, 260,
    5), (130, 37, 300, 9), D)``'s tensors: ``grads(q, k, v, dout)`` with NaN rows past the last
    offset, then with sequence 1's rows inf (queries 100..136, keys 130..166), and ``same(got,
    want, rows_q, rows_k)`` asserting the other rows' gradients unchanged."""
    want = grads(q, k, v, dout)
    assert not any(g.isnan().any() for g in want)

    def padded(t):  # 70 rows of NaN past the last offset
        nan = torch.full((70, *t.shape[1:]), float("nan"), dtype=t.dtype, device="cuda")
        return torch.cat([t, nan])

    got = grads(*(padded(t) for t in (q, k, v, dout)))
    every_q = torch.arange(q.shape[0], device="cuda")
    every_k = torch.arange(k.shape[0], device="cuda")
    same(got, want, every_q, every_k)
    # Sequence 1's rows are inf: the others keep theirs.
    q1, k1, v1, dout1 = (t.clone() for t in (q, k, v, dout))
    q1[100:137] = dout1[100:137] = k1[130:167] = v1[130:167] = float("inf")
    others_q = torch.cat([every_q[:100], every_q[137:]])
    others_k = torch.cat([every_k[:130], every_k[167:]])
    same(grads(q1, k1, v1, dout1), want, others_q, others_k)


def same_but_dq_order(got, want, rows_q, rows_k) -> None:
    """``poison_neighbours``' check for a backward whose dQ is summed by reduce-adds in any order:
    dK and dV the same bits, dQ within an ulp of its largest element (bf16)."""
    dq, dk, dv = got
    assert torch.equal(dk[rows_k], want[1][rows_k]) and torch.equal(dv[rows_k], want[2][rows_k])
    ulp = want[0][rows_q].abs().max() * 2.0**-7
    assert (dq[rows_q].float() - want[0][rows_q].float()).abs().max() <= ulp


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_varlen_gpu_sm90_backward_sequences_isolated(causal, head_dim):
    """The Hopper backward's key blocks and query blocks reach into the next sequence's rows (or
    past the last offset): whatever those rows of q, k, v and dout hold, NaN or inf included,
    the other sequences' gradients are unchanged (dK and dV the same bits; dQ, summed by
    reduce-adds in any order, to within an ulp of its largest element)."""
    require_sm90()
    case = VarlenCase(4, 2, (100, 37, 260, 5), (130, 37, 300, 9), head_dim)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    maxima = max(case.seqlens_q), max(case.seqlens_k)

    def grads(q, k, v, dout):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        with flashcore.use_tier("sm90"):
            out = flashcore.attention_varlen(q, k, v, cu_q, cu_k, *maxima, causal=causal)
            return torch.autograd.grad(out, (q, k, v), dout)

    poison_neighbours(grads, same_but_dq_order, q, k, v, dout)


# Packed batches through the head-dim-256 backward (ops/bwd256.py; head dims 136-248 the same
# way): sequences empty, shorter than a 64-row block, at and past its edges, Sq != Sk, GQA/MQA,
# and the score options.
VARLEN_D256_BWD = [
    (VarlenCase(4, 2, (300, 1, 0, 129, 64, 700), (517, 64, 10, 129, 0, 700), 256), {}),
    (VarlenCase(4, 2, (300, 1, 0, 129, 64, 700), (517, 64, 10, 129, 0, 700), 256),
     {"causal": True}),
    (VarlenCase(4, 1, (200, 65, 513), (200, 63, 600), 256), {"window": (100, 20), "softcap": 30.0}),
    (VarlenCase(4, 4, (300, 1, 129, 900), (517, 64, 129, 900), 256),
     {"causal": True, "alibi": "bh"}),
    (VarlenCase(4, 2, (300, 77, 700), (517, 64, 700), 192), {"causal": True, "softcap": 50.0}),
    # MLA's head dims: q and k 192, v 128.
    (VarlenCase(4, 2, (300, 1, 129, 700), (517, 64, 129, 700), 192),
     {"causal": True, "value_dim": 128}),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("case", "opts"), VARLEN_D256_BWD, ids=[_sm90_case_id((c, c.head_dim, o)) for c, o in
                                            VARLEN_D256_BWD]
)  # fmt: skip
def test_varlen_gpu_d256_backward(monkeypatch, case, opts, dtype):
    """The head-dim-256 Gluon backward on packed batches: dq, dk, dv per sequence against the
    float64 reference with FlashAttention's rule (through out and lse)."""
    calls = spy_d256(monkeypatch)
    q, k, v, cu_q, cu_k = make_varlen(case, dtype, "cuda")
    opts = dict(opts)
    if "value_dim" in opts:
        v = v[..., : opts.pop("value_dim")].contiguous()
    causal = opts.pop("causal", False)
    if opts.pop("alibi", None):
        opts["alibi_slopes"] = torch.rand(len(case.seqlens_q), case.heads, device="cuda")
    check_varlen(case, q, k, v, cu_q, cu_k, causal=causal, backward=True, **opts)
    assert calls, "the head-dim-256 Gluon backward did not run"


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["", "tma"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_gpu_d256_backward_sequences_isolated(monkeypatch, causal, tma):
    """The head-dim-256 backward's blocks reach into the next sequence's rows (or past the last
    offset): whatever those rows of q, k, v and dout hold, NaN or inf included, the other
    sequences' gradients are the same bits (no atomics); "tma": dK and dV of the blocks inside
    a sequence stored by TMA (``bwd256.DKDV_TMA_EPILOGUE``), also against the float64
    reference."""
    from flashcore.ops import bwd256

    monkeypatch.setattr(bwd256, "DKDV_TMA_EPILOGUE", tma)
    bwd256._PLANS.clear()
    calls = spy_d256(monkeypatch)
    case = VarlenCase(4, 2, (100, 37, 260, 5), (130, 37, 300, 9), 256)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    dout = torch.randn_like(q)
    maxima = max(case.seqlens_q), max(case.seqlens_k)

    def grads(q, k, v, dout):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flashcore.attention_varlen(q, k, v, cu_q, cu_k, *maxima, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    def same(got, want, rows_q, rows_k):
        for g, w, rows in zip(got, want, (rows_q, rows_k, rows_k), strict=True):
            assert torch.equal(g[rows], w[rows])

    poison_neighbours(grads, same, q, k, v, dout)
    assert calls
    assert all(p.dkdv[2]["TMA_EPILOGUE"] == tma for p in bwd256._PLANS.values())
    if tma:
        check_varlen(case, q, k, v, cu_q, cu_k, causal=causal, backward=True)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("causal", "skip", "tma", "mexp", "fresh", "split"),
    [(False, False, False, False, False, False), (True, False, False, False, False, False),
     (True, True, False, False, False, False), (False, False, True, False, False, False),
     (True, True, True, False, False, False), (False, False, True, True, False, False),
     (True, True, True, True, False, False), (False, False, True, True, True, False),
     (True, True, True, True, True, False), (True, True, True, True, True, True)],
    ids=["full", "causal", "causal-skip", "full-tma", "causal-skip-tma", "full-tma-mexp",
         "causal-skip-tma-mexp", "full-tma-mexp-fresh", "causal-skip-tma-mexp-fresh",
         "causal-skip-tma-mexp-fresh-split"],
)  # fmt: skip
def test_varlen_gpu_mla_wide_backward(monkeypatch, causal, skip, tma, mexp, fresh, split):
    """MLA's 128-key backward (``kernels/hopper/bwd_mla.py``) on packed batches
    (``bwd256.WIDE_MLA_VARLEN``; causal with and without ``WIDE_SKIP_MASKED``; with
    ``WIDE_TMA_EPILOGUE``, blocks inside a sequence stored by TMA; with ``WIDE_MASK_EXPONENT``,
    the exponent formed before the masks' branches; with ``WIDE_FRESH_DESC``, the fixed tiles'
    descriptors formed in the step loop; with ``WIDE_SPLIT_DIAG``, the diagonal's steps
    in a loop of their own): sequences empty, of one
    row, ending inside either consumer's half of a block and past it, GQA, against the float64
    reference; then with NaN past the last offset and inf in sequence 1's rows, the other
    sequences' gradients unchanged (dK and dV the same bits, dQ within an ulp of its largest
    element)."""
    from flashcore.ops import bwd256

    monkeypatch.setattr(bwd256, "WIDE_MLA_VARLEN", True)
    monkeypatch.setattr(bwd256, "WIDE_SKIP_MASKED", skip)
    monkeypatch.setattr(bwd256, "WIDE_TMA_EPILOGUE", tma)
    monkeypatch.setattr(bwd256, "WIDE_MASK_EXPONENT", mexp)
    monkeypatch.setattr(bwd256, "WIDE_FRESH_DESC", fresh)
    monkeypatch.setattr(bwd256, "WIDE_SPLIT_DIAG", split)
    calls = spy_d256(monkeypatch)
    bwd256._PLANS.clear()
    case = VarlenCase(4, 2, (300, 1, 0, 129, 64, 700), (517, 64, 10, 129, 0, 700), 192)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    check_varlen(case, q, k, v[..., :128].contiguous(), cu_q, cu_k, causal=causal, backward=True)
    assert calls and any(p.wide for p in bwd256._PLANS.values())
    case = VarlenCase(4, 2, (100, 37, 260, 5), (130, 37, 300, 9), 192)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    v = v[..., :128].contiguous()
    dout = torch.randn(q.shape[0], q.shape[1], 128, dtype=q.dtype, device="cuda")
    maxima = max(case.seqlens_q), max(case.seqlens_k)

    def grads(q, k, v, dout):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flashcore.attention_varlen(q, k, v, cu_q, cu_k, *maxima, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    poison_neighbours(grads, same_but_dq_order, q, k, v, dout)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("head_dim", "opts"),
    [(128, {}), (128, {"causal": True}), (64, {"causal": True}), (64, {}),
     (128, {"window": (300, 40)}), (128, {"causal": True, "sinks": True})],
    ids=["d128", "d128-causal", "d64-causal", "d64", "d128-window", "d128-causal-sinks"],
)  # fmt: skip
def test_varlen_gpu_sm90_work_list(monkeypatch, head_dim, opts):
    """Lengths that vary take the flat grid over a work list (``ops/work_list.py``): the same
    bits as the flat grid sized by the longest sequence, every row written (NaN-filled out and
    LSE), for sequences empty, shorter than a consumer's rows, at and past the tiles' edges,
    more of them than the list program takes at once, and Sq != Sk."""
    from flashcore.ops import fwd_sm90
    from flashcore.ops.problem import Varlen
    from helpers import launch_sm90_forward

    require_sm90()
    lens_q = (4000, 1, 0, 129, 64, 1000, 2100, 33, 700, 1500, 191, 192, 193, 3000, 5, 256, 900)
    lens_k = (4000, 64, 10, 129, 0, 1100, 2100, 40, 700, 1500, 191, 200, 193, 3100, 5, 256, 900)
    case = VarlenCase(4, 2, lens_q, lens_k, head_dim)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    opts = dict(opts)
    if opts.pop("sinks", False):
        opts["sinks"] = torch.randn(case.heads, device="cuda")
    varlen = Varlen(cu_q, cu_k, max(lens_q), max(lens_k))
    plans = []
    real = fwd_sm90.plan

    def recorded(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(fwd_sm90, "plan", recorded)
    listed = launch_sm90_forward(q, k, v, varlen=varlen, **opts)
    longest = launch_sm90_forward(q, k, v, varlen=varlen, use_work_list=False, **opts)
    assert plans[0].work is not None and plans[0].meta["VARLEN"] == 2
    assert plans[1].work is None and plans[1].meta["VARLEN"] == 1
    assert plans[0].grid[0] < plans[1].grid[0]
    assert not listed[0].isnan().any() and not listed[1].isnan().any()
    assert torch.equal(listed[0], longest[0]) and torch.equal(listed[1], longest[1])


def test_varlen_sm90_auto_judges_mean_lengths(monkeypatch):
    """ "auto" takes the Hopper forward for a packed batch by its mean lengths (total rows over
    sequences) on the dense thresholds, not by its longest sequence; planned with the packing."""
    from flashcore.ops import fwd, fwd_sm90
    from flashcore.ops.problem import Varlen

    monkeypatch.setattr(fwd_sm90, "supports", lambda *a, **kw: kw["varlen"])
    monkeypatch.setattr(fwd_sm90, "plan", lambda *a, **kw: ("plan", kw["varlen"]))

    def wanted(total, batch, longest):
        q = torch.empty(total, 16, 128, dtype=torch.bfloat16)
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        varlen = Varlen(cu, cu, longest, longest)
        lse = torch.empty(16, total)
        plan = fwd._sm90_plan(
            q, q, q, q, lse, False, 0.1, (-1, -1), 0.0, None, 0, False, varlen, False
        )
        assert plan is False or plan == ("plan", varlen)
        return plan is not False

    assert wanted(16 * 2048, 16, 4096)
    assert not wanted(192 * 277, 192, 4096)  # mean 277: below the 512 floor at D = 128
    assert not wanted(1000, 1, 1000)  # one sequence, but under 3e10 FLOPs


def test_varlen_spread_takes_the_flat_grid():
    """A packed batch whose grid rows (batch x longest) reach 1.25x its rows runs the flat grid
    (``fwd_sm90_configs.varlen_spread``); equal lengths, and dense problems, keep the launcher's
    choice."""
    from flashcore.ops.fwd_sm90_configs import varlen_spread

    assert varlen_spread(16, 4096, 39600)  # 256-4096 tokens: 1.65x
    assert not varlen_spread(16, 2048, 16 * 2048)  # equal lengths
    assert not varlen_spread(16, 2048, 16 * 1700)  # 1.20x
    assert not varlen_spread(4, 2048, 0)  # dense


def test_varlen_sm90_d64_mean_floor():
    """At head dim 64 "auto" takes the Hopper forward for a packed batch from a mean length of
    2048 on (``tuning.SM90_FWD_MIN_SEQLEN_VARLEN_D64``); dense problems keep their floor."""
    from flashcore import tuning

    flops = 1e12
    assert not tuning.sm90_forward(1277, 1277, 64, flops, varlen=True)
    assert tuning.sm90_forward(2048, 2048, 64, flops, varlen=True)
    assert tuning.sm90_forward(1277, 1277, 64, flops)
    assert tuning.sm90_forward(1277, 1277, 128, flops, varlen=True)
