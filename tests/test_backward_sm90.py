"""The Hopper backward at head dims 64 and 128 (and those padded to them): its launches against
the float64 reference on the GPU, the tier's choice under "auto" and the rules behind it, its dQ
conversion kernel."""

import pytest
import torch

import flashcore
from flashcore import tuning
from flashcore.tuning import sm90_backward
from helpers import (
    check_backward,
    check_forward,
    make_qkv,
    mask_options,
    record_backward_tiers,
    record_sm90_forwards,
    require_sm90,
    sm90_backward_switch,
)
from shapes import BWD_GPU, Case, MaskCase

SM90_BWD = [c for c in BWD_GPU if c.head_dim in (64, 128)] + [
    Case(2, 4, 4, 1000, 1000, 128),
    Case(1, 3, 3, 1500, 1000, 64),
    Case(2, 16, 1, 513, 257, 64),
    Case(1, 2, 2, 203, 113, 128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", SM90_BWD, ids=[c.id for c in SM90_BWD])
def test_backward_gpu_sm90_tier(case, dtype, causal, layout):
    """The GPU cases the Hopper backward covers (D 64/128), forced onto it, both layouts."""
    q, k, v = make_qkv(case, dtype, "cuda", layout=layout)
    with flashcore.use_tier("sm90"):
        dq, dk, dv = check_backward(q, k, v, causal=causal)
    if layout == "bshd":
        assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


# The consumers' fixed tiles' descriptors formed in the step loop in every build
# (``bwd_sm90.FRESH_DESC_ALWAYS``): causal and ragged lengths, GQA, a window, softcap and ALiBi,
# both head dims (at D = 64 K and V sit in registers in the plain builds, which the switch leaves
# as they are).
SM90_FRESH = [
    (MaskCase(Case(2, 4, 4, 1000, 1000, 128), causal=True), torch.bfloat16),
    (MaskCase(Case(2, 4, 4, 1000, 1000, 128)), torch.float16),
    (MaskCase(Case(1, 3, 3, 1500, 1000, 64), causal=True), torch.float16),
    (MaskCase(Case(1, 8, 2, 2048, 2048, 128), causal=True), torch.bfloat16),
    (MaskCase(Case(1, 4, 2, 300, 517, 128), causal=True, window=(100, 0)), torch.bfloat16),
    (MaskCase(Case(1, 4, 2, 517, 300, 64), window=(64, 16), softcap=30.0, alibi="bh"),
     torch.float16),
    (MaskCase(Case(1, 4, 4, 777, 700, 128), causal=True, softcap=20.0), torch.bfloat16),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("mc", "dtype"), SM90_FRESH, ids=[f"{mc.id}-{str(d)[6:]}" for mc, d in SM90_FRESH]
)
def test_backward_gpu_sm90_fresh_desc(mc, dtype, monkeypatch):
    """The Hopper backward (D 64/128, forced) with ``bwd_sm90.FRESH_DESC_ALWAYS``: the
    consumers' K, V and dQ K-column descriptors formed in the step loop in every build (shipped:
    in those with the dQ products beside dK)."""
    with sm90_backward_switch(monkeypatch, "FRESH_DESC_ALWAYS") as plans:
        q, k, v = make_qkv(mc.case, dtype, "cuda", layout="bshd")
        with flashcore.use_tier("sm90"):
            check_backward(q, k, v, **mask_options(mc, "cuda"))
        assert plans and all(
            p.main_meta["FRESH_DESC"] != p.main_meta["KV_REGS"] for p in plans.values()
        )


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["grouped", "split"])
@pytest.mark.parametrize(
    "mc",
    [
        MaskCase(Case(2, 8, 2, 700, 1100, 128), causal=True),
        MaskCase(Case(1, 4, 1, 513, 777, 64), window=(200, 30), softcap=20.0, alibi="h"),
    ],
    ids=["gqa-causal", "mqa-window-softcap-alibi"],
)
def test_backward_gpu_sm90_group_split(mc, split, monkeypatch):
    """GQA/MQA on the Hopper backward both ways (``bwd_sm90.split_group`` forced): a program per
    kv head walking its group, and a program per query head with K/V repeated and dK/dV summed
    per group; strided (B, S, H, D) gradients written in place."""
    from flashcore.ops import bwd_sm90

    require_sm90()
    monkeypatch.setattr(bwd_sm90, "split_group", lambda *args: split)
    q, k, v = make_qkv(mc.case, torch.bfloat16, "cuda", layout="bshd")
    with flashcore.use_tier("sm90"):
        _, dk, dv = check_backward(q, k, v, **mask_options(mc, "cuda"))
    assert (dk.stride(), dv.stride()) == (k.stride(), v.stride())


# Steps a consumer's keys are not seen in, skipped: consumer 1's first causal step
# (``bwd_sm90.SKIP_MASKED``, on) with GQA (the skip is the group's first head's step), queries
# longer and shorter than the keys, the dQ warpgroup (D = 64), a window with a softcap at D = 64
# (with a softcap D = 128 keeps each dQ in its step and takes no skip), and 4096 rows, where the
# dQ products run beside dK; consumer 0's last step at a window's left edge
# and, not causal, consumer 1's first at its right edge (``bwd_sm90.SKIP_MASKED_WINDOW``, on),
# causal and not, with GQA, the dQ warpgroup and the dQ products beside dK (non-causal).
SM90_SKIP = [
    ("SKIP_MASKED", MaskCase(Case(2, 8, 2, 700, 1100, 128), causal=True), torch.bfloat16),
    ("SKIP_MASKED", MaskCase(Case(1, 4, 4, 1100, 700, 128), causal=True), torch.float16),
    ("SKIP_MASKED", MaskCase(Case(2, 4, 4, 1000, 1000, 64), causal=True), torch.bfloat16),
    ("SKIP_MASKED", MaskCase(Case(1, 4, 2, 777, 513, 64), causal=True, window=(300, 0),
                             softcap=20.0), torch.float16),
    ("SKIP_MASKED", MaskCase(Case(1, 8, 8, 4096, 4096, 128), causal=True), torch.bfloat16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(1, 4, 4, 1000, 1000, 128), causal=True, window=(128, 0)),
     torch.bfloat16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(2, 8, 2, 1100, 700, 128), causal=True, window=(256, 0)),
     torch.float16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(1, 4, 4, 2048, 2048, 128), window=(300, 200)),
     torch.bfloat16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(2, 4, 4, 700, 900, 64), window=(200, 50)), torch.float16),
    ("SKIP_MASKED_WINDOW", MaskCase(Case(1, 4, 2, 777, 513, 64), causal=True, window=(100, 0),
                                  softcap=20.0), torch.bfloat16),
    # BAND_MASK (on as shipped): causal windows' two masks as one comparison; the same P, so
    # the same bits in dK and dV as with the two masks apart.
    ("BAND_MASK", MaskCase(Case(1, 4, 4, 1000, 1000, 128), causal=True, window=(128, 0)),
     torch.bfloat16),
    ("BAND_MASK", MaskCase(Case(2, 8, 2, 1100, 700, 128), causal=True, window=(256, 0),
                           softcap=30.0), torch.float16),
    ("BAND_MASK", MaskCase(Case(1, 4, 2, 777, 513, 64), causal=True, window=(100, 0),
                           softcap=20.0), torch.bfloat16),
    ("BAND_MASK", MaskCase(Case(2, 4, 4, 700, 900, 64), causal=True, window=(200, 0), alibi="bh"),
     torch.float16),
    ("BAND_MASK", MaskCase(Case(1, 8, 8, 4096, 4096, 128), causal=True, window=(4095 - 64, 0)),
     torch.bfloat16),
    # DQ_LAG_OPTIONS: softcap, and causal ALiBi, at D=128 with each step's dQ a step late, and
    # with it the skipped steps and the dQ products beside dK.
    ("DQ_LAG_OPTIONS", MaskCase(Case(2, 8, 2, 1100, 700, 128), causal=True, softcap=30.0),
     torch.bfloat16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(1, 4, 4, 777, 513, 128), softcap=20.0), torch.float16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(1, 4, 4, 1000, 1000, 128), causal=True, alibi="bh"),
     torch.bfloat16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(1, 4, 2, 1100, 1100, 128), causal=True, window=(256, 0),
                                softcap=50.0), torch.bfloat16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(2, 4, 4, 700, 900, 128), window=(200, 50), softcap=20.0,
                                alibi="h"), torch.float16),
    ("DQ_LAG_OPTIONS", MaskCase(Case(1, 8, 8, 4096, 4096, 128), causal=True, softcap=30.0),
     torch.bfloat16),
]  # fmt: skip


SKIP_META = {"SKIP_MASKED": "SKIP_MASKED", "SKIP_MASKED_WINDOW": "SKIP_WINDOW",
             "BAND_MASK": "BAND_MASK", "DQ_LAG_OPTIONS": "LAG_OPTIONS"}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("switch", "mc", "dtype"),
    SM90_SKIP,
    ids=[f"{sw.lower()}-{mc.id}-{str(d)[6:]}" for sw, mc, d in SM90_SKIP],
)
def test_backward_gpu_sm90_skip_masked(switch, mc, dtype, monkeypatch):
    """The Hopper backward (D 64/128, forced) with a skip switch off and on: the skipped steps'
    products are exactly zero, so dK and dV are bit for bit equal, dQ equal to its reduce
    order, and each passes the FA rule. The same for BAND_MASK (the masks of a causal window
    formed another way) and DQ_LAG_OPTIONS (softcap and ALiBi with the dQ a step late)."""
    from flashcore.ops import bwd, bwd_sm90

    require_sm90()
    q, k, v = make_qkv(mc.case, dtype, "cuda", layout="bshd")
    grads = {}
    for on in (False, True):
        monkeypatch.setattr(bwd_sm90, switch, on)
        bwd_sm90._PLANS.clear()
        bwd.forget()
        torch.manual_seed(1)
        with flashcore.use_tier("sm90"):
            grads[on] = check_backward(q, k, v, **mask_options(mc, "cuda"))
        assert all(p.main_meta[SKIP_META[switch]] == on for p in bwd_sm90._PLANS.values())
    bwd_sm90._PLANS.clear()
    bwd.forget()
    (dq0, dk0, dv0), (dq1, dk1, dv1) = grads[False], grads[True]
    assert torch.equal(dk0, dk1) and torch.equal(dv0, dv1)
    # dQ's fp32 sums reduce-added in another order: at most a rounding of its dtype apart.
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    assert (dq1.float() - dq0.float()).abs().max() <= ulp * dq0.float().abs().max()


def test_sm90_backward_group_split_rule():
    """When GQA/MQA runs a program per query head: causal below two programs per SM, otherwise
    only when it takes fewer waves than the grouped grid's longest program."""
    from flashcore.ops import bwd_sm90
    from flashcore.ops.bwd_sm90 import split_group

    full = (-1, -1)
    assert not split_group(1, 16, 132, True, full)  # no group
    assert split_group(4, 128, 132, True, full)  # (1, 16/4, 4096): 32 key blocks x 4
    assert not split_group(4, 2048, 132, True, full)  # (8, 32/8, 4096)
    assert split_group(4, 32, 132, False, full)  # one wave either way, a quarter of the steps
    assert not split_group(4, 128, 132, False, full)  # 4 waves of 1/4 against 1 of 4/4
    assert not split_group(4, 128, 132, True, (512, 0))  # a window: work spread evenly
    # Never more extra memory than SPLIT_MAX_BYTES (MQA with many heads at long keys).
    limit = bwd_sm90.SPLIT_MAX_BYTES
    assert split_group(4, 128, 132, True, full, limit)
    assert not split_group(64, 256, 132, True, full, limit + 1)


@pytest.mark.parametrize(("major", "want"), [(12, 96), (13, 80), (14, 80)])
def test_dq_warpgroup_registers_follow_the_ptxas(monkeypatch, major, want):
    """The D=64 backward's dQ warpgroup: 96 registers where Triton compiles sm_90 with CUDA 12's
    ptxas (3.6-3.8), 80 with CUDA 13's (3.9 on, which spilled consumer 0's loop at 96); D=128
    has no dQ warpgroup. (The ptxas version stood in for; the installed one read as such.)"""
    pytest.importorskip("triton.backends.nvidia")
    import triton

    from flashcore.ops import bwd_sm90

    # The wheels' own ptxas for sm_90 (read from each): CUDA 12's up to 3.8, 13's in 3.9.
    known = {"3.6.": 12, "3.7.": 12, "3.8.": 12, "3.9.": 13}
    prefix = ".".join(triton.__version__.split(".")[:2]) + "."
    if prefix in known:
        assert bwd_sm90.ptxas_major() == known[prefix]
    monkeypatch.setattr(bwd_sm90, "ptxas_major", lambda: major)
    dq_regs = bwd_sm90.dq_regs.__wrapped__
    assert dq_regs(bwd_sm90.CONFIGS[64]) == want
    assert dq_regs(bwd_sm90.CONFIGS[128]) == bwd_sm90.CONFIGS[128].dq_regs


@pytest.mark.gpu
def test_backward_gpu_sm90_lse_grad():
    case = Case(2, 8, 2, 1500, 1000, 128)
    q, k, v = make_qkv(case, torch.bfloat16, "cuda")
    dlse = torch.randn(case.batch, case.heads, case.seqlen_q, device="cuda")
    with flashcore.use_tier("sm90"):
        check_backward(q, k, v, causal=True, dlse=dlse)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("tier", "deterministic", "torch_flag", "want"),
    [
        ("auto", False, False, "sm90"),
        ("sm90", False, False, "sm90"),
        ("portable", False, False, "portable"),
        ("auto", True, False, "portable"),
        ("sm90", True, False, "portable"),
        ("auto", False, True, "portable"),
    ],
)
def test_backward_tier_choice(monkeypatch, tier, deterministic, torch_flag, want):
    """Which backward runs: the tier in effect at the forward (the backward runs on autograd's
    thread, outside the block), never the Hopper one with ``deterministic`` or under
    ``torch.use_deterministic_algorithms``; "auto" takes it for long sequences."""
    require_sm90()
    ran = record_backward_tiers(monkeypatch)
    # 6.9e10 FLOPs (causal): above tuning.SM90_BWD_MIN_FLOPS, so "auto" takes the tier eagerly.
    q, k, v = make_qkv(Case(1, 16, 4, 4096, 4096, 128), torch.bfloat16, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: torch_flag)
    with flashcore.use_tier(tier):
        out = flashcore.attention(q, k, v, causal=True, deterministic=deterministic)
    out.backward(torch.randn_like(out))
    assert ran == [want]


@pytest.mark.gpu
def test_backward_auto_keeps_short_sequences_portable(monkeypatch):
    require_sm90()
    ran = record_backward_tiers(monkeypatch)
    # 256 queries against 16k keys: above the FLOP floor (6.9e10), below the length floor.
    case = Case(2, 16, 16, 256, 16384, 128)
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.bfloat16, "cuda"))
    flashcore.attention(q, k, v).sum().backward()
    assert ran == ["portable"]


@pytest.mark.parametrize(
    ("seqlen", "head_dim", "causal", "varlen", "want"),
    [
        (512, 128, False, False, True),  # dense: from 512 on, D=128 or 64, causal or not
        (511, 128, False, False, False),
        (512, 128, True, False, True),
        (511, 128, True, False, False),
        (512, 64, False, False, True),
        (511, 64, False, False, False),
        (511, 64, True, False, False),
        (512, 64, True, False, True),
        (256, 128, False, True, True),  # packed batches (mean lengths): D=128 from 256 on
        (255, 128, False, True, False),
        (383, 128, True, True, False),  # causal from 384 on
        (384, 128, True, True, True),
        (383, 64, False, True, False),  # D=64 from 384 on, causal or not
        (384, 64, True, True, True),
    ],
)
def test_sm90_backward_auto_rule(seqlen, head_dim, causal, varlen, want):
    """Where "auto" takes the Hopper backward by lengths (tuning.sm90_backward: the measured
    crossovers), above its FLOP floor; the shorter side decides."""
    flops = 1e12
    assert sm90_backward(seqlen, seqlen, head_dim, flops, causal, varlen=varlen) is want
    assert sm90_backward(seqlen, 1 << 16, head_dim, flops, causal, varlen=varlen) is want
    assert sm90_backward(1 << 16, seqlen, head_dim, flops, causal, varlen=varlen) is want


def test_sm90_backward_flop_floor():
    """An eager call takes the Hopper backward from ``SM90_BWD_MIN_FLOPS`` on (below it the host's
    cost sets the pace); a call being captured into a CUDA graph has no FLOP floor."""

    floor = tuning.SM90_BWD_MIN_FLOPS
    assert sm90_backward(4096, 4096, 128, floor)
    assert not sm90_backward(4096, 4096, 128, floor * 0.99)
    assert sm90_backward(4096, 4096, 128, floor * 0.01, graph=True)
    assert sm90_backward(1024, 1024, 64, 1.0, True, True)
    assert not sm90_backward(511, 511, 64, 1e12, True, True)  # the length floors still apply


@pytest.mark.parametrize(
    ("shape", "causal", "work", "want"),
    [
        ((16, 16, 16, 512, 128), True, 3.221e10, True),  # 1.7e10 FLOPs in 1024 programs
        ((16, 32, 32, 512, 64), True, 3.221e10, True),
        ((4, 16, 16, 1024, 128), True, 2.47e10, False),  # the same FLOPs in 512 programs
        ((2, 8, 8, 2048, 128), True, 2.094e10, False),  # and in 128
        ((8, 32, 8, 512, 128), True, 2.416e10, False),  # GQA: a program per kv head
        ((8, 32, 32, 512, 128), True, 3.221e10, True),  # the same without GQA
        ((2, 8, 8, 2048, 128), False, 3.704e10, True),  # 3.4e10 FLOPs: over by FLOPs alone
    ],
)
def test_sm90_backward_work_counts_programs(shape, causal, work, want):
    """The eager floor weighs the Hopper backward's work as its grid does it: each program (128
    keys of one kv head) costs ``SM90_BWD_PROGRAM_STEPS`` steps of 64 query rows besides its
    products, and causal one more for each query head's key block; many short programs pass
    the floor (``tuning.SM90_BWD_MIN_FLOPS``, 3e10) at fewer FLOPs (docs/performance_backward.md,
    "The eager floor counts programs"; the floor: docs/performance_host.md, "Quick
    backwards")."""

    batch, heads, kv_heads, seqlen, head_dim = shape
    got = tuning.sm90_backward_work(
        batch, heads, kv_heads, seqlen, seqlen, head_dim, causal, 64, 128
    )
    assert got == pytest.approx(work, rel=1e-3)
    assert sm90_backward(seqlen, seqlen, head_dim, got, causal) is want


# Head dims between 64 and 128 on the Hopper tiers (ops/fwd_sm90.py: PADDED_HEAD_DIMS): the D = 128
# kernels over 128-column boxes, which the copy engine pads with zeros on loads and clips on
# stores. Ragged lengths both ways, GQA and MQA, causal with Sq > Sk, (B, S, H, D) views, a window
# with softcap, ALiBi, and a gradient through the LSE.
PADDED_CASES = [
    (MaskCase(Case(2, 4, 2, 300, 517, 96), causal=True), "bshd", False),
    (MaskCase(Case(1, 4, 1, 777, 1025, 80)), "bhsd", True),
    (MaskCase(Case(2, 4, 4, 700, 300, 112), causal=True), "bhsd", False),
    (MaskCase(Case(1, 4, 4, 513, 513, 96), window=(100, 20), softcap=30.0), "bhsd", False),
    (MaskCase(Case(1, 4, 2, 390, 600, 72), alibi="h"), "bshd", False),
    # Below 64, on the D = 64 kernels (fwd_sm90.NARROW_HEAD_DIMS).
    (MaskCase(Case(2, 4, 2, 300, 517, 56), causal=True), "bshd", False),
    (MaskCase(Case(1, 4, 1, 777, 1025, 48)), "bhsd", True),
    (MaskCase(Case(1, 4, 4, 513, 513, 48), window=(100, 20), softcap=30.0), "bhsd", False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("mc", "layout", "with_dlse"),
    PADDED_CASES,
    ids=[f"{m.id}-{lay}{'-dlse' * g}" for m, lay, g in PADDED_CASES],
)
def test_sm90_padded_head_dims(monkeypatch, mc, layout, with_dlse, dtype):
    """Forward and backward at head dims 48-112 through the Hopper tiers (``use_tier("sm90")``;
    ``PADDED_VERIFIED`` and ``NARROW_VERIFIED`` set on for the test), both launchers
    recorded: out, LSE, dq, dk and dv against the float64 reference."""
    from flashcore.ops import fwd_sm90

    require_sm90()
    monkeypatch.setattr(fwd_sm90, "PADDED_VERIFIED", True)
    monkeypatch.setattr(fwd_sm90, "NARROW_VERIFIED", True)
    forwards = record_sm90_forwards(monkeypatch)
    backwards = record_backward_tiers(monkeypatch)
    q, k, v = make_qkv(mc.case, dtype, "cuda", layout=layout)
    kw = mask_options(mc, "cuda")
    dlse = torch.randn(q.shape[:3], device="cuda") if with_dlse else None
    with flashcore.use_tier("sm90"):
        out, lse = flashcore.attention(q, k, v, return_lse=True, **kw)
        check_forward(out, lse, q, k, v, **kw)
        check_backward(q, k, v, dlse=dlse, **kw)
    assert forwards == [1, 1] and backwards == ["sm90"]


# Triton 3.6's interpreter rounds fp32 to bf16 toward zero (the GPU to nearest even): bf16 is
# checked on the GPU only.
@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize(
    "shape, acc_rows, packed",
    [((2, 3, 70, 80), 128, False), ((1, 2, 64, 64), 64, False), ((1, 3, 130, 48), 130, True)],
)
def test_sm90_dq_conversion_kernel(device, dtype, shape, acc_rows, packed):
    # The Hopper backward's last kernel: dQ = scale * its fp32 accumulator, rounded as
    # torch.mul(acc, scale, out=dq) rounds it, bit for bit; rows past Sq (permuted rows pad the
    # accumulator to seqlen_pad) and padded head dims (BLOCK_D above D) left out; dq by strides
    # ((B, S, H, D) views; a packed batch's (total, H, D)).
    pytest.importorskip("triton.experimental.gluon")
    import triton

    from flashcore.kernels.hopper import bwd_rows
    from flashcore.ops.bwd_sm90 import dq_strides

    batch, heads, seqlen, dim = shape
    acc = torch.randn(batch, heads, acc_rows, dim, device=device, dtype=torch.float32) * 100
    scale = dim**-0.5
    if packed:
        dq = torch.full((seqlen, heads, dim), float("nan"), device=device, dtype=dtype)
        want = torch.mul(acc[0].transpose(0, 1), scale).to(dtype)
    else:
        dq = torch.full((batch, seqlen, heads, dim), float("nan"), device=device, dtype=dtype)
        dq = dq.transpose(1, 2)
        want = torch.empty_like(dq)
        torch.mul(acc[:, :, :seqlen], scale, out=want)
    strides = dq_strides(dq, packed)
    block_d = triton.next_power_of_2(dim)
    grid = (triton.cdiv(seqlen, 64) * batch * heads,)
    bwd_rows.bwd_dq_kernel[grid](
        acc, dq, scale, *strides, heads, seqlen, acc_rows, HEAD_DIM=dim, BLOCK_D=block_d,
        BLOCK_M=64,
    )  # fmt: skip
    assert torch.equal(dq.float(), want.float())
