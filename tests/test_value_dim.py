"""A value head dim unlike the query/key one (``Dv != D``, MLA): forward, backward, varlen and
decoding against the reference; out (and dv) have v's head dim."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashcore
from flashcore import reference
from helpers import (
    check_backward,
    check_forward,
    check_varlen,
    cu_seqlens,
    launch_sm90_forward,
    mask_options,
    sm90_tier_runs,
)
from numerics import assert_fa_rule
from shapes import DTYPES, Case, MaskCase, VarlenCase

# (mask case, Dv): D and Dv on either side of each other, padded (non-power-of-two) dims on
# either side, with GQA/MQA, causal with Sq > Sk, window + softcap + ALiBi.
DV_CASES = [
    (MaskCase(Case(2, 4, 2, 21, 37, 48)), 32),
    (MaskCase(Case(1, 2, 1, 45, 30, 16), causal=True), 80),
    (MaskCase(Case(1, 4, 2, 40, 70, 32), window=(9, 2), softcap=4.0, alibi="h"), 16),
    # Q/K head dim 192: the backward tiles Q, K, dQ, dK in two panels, 128 + 64 (ops/bwd.py:
    # d_panels), with V at MLA's 128 and at 192.
    (MaskCase(Case(1, 2, 1, 37, 70, 192), causal=True), 128),
    (MaskCase(Case(1, 2, 2, 45, 33, 192), window=(9, 2), softcap=4.0, alibi="h"), 192),
]

DV_CASES_GPU = [
    (MaskCase(Case(2, 16, 16, 1024, 1024, 192), causal=True), 128),  # MLA training
    (MaskCase(Case(1, 8, 2, 777, 2049, 192)), 128),
    (MaskCase(Case(2, 8, 8, 600, 600, 64), window=(128, 0), softcap=20.0), 256),
    (MaskCase(Case(1, 4, 1, 300, 517, 256), causal=True, alibi="bh"), 96),
]


def test_backward_d_panels():
    """The backward's column panels: 192 in 128 + 64 for 16-bit inputs, one tile otherwise."""
    from flashcore.ops.bwd import d_panels

    assert d_panels(192, torch.float16) == d_panels(192, torch.bfloat16) == (128, 64)
    assert d_panels(192, torch.float32) == (256, 0)
    assert d_panels(128, torch.bfloat16) == (128, 0)
    assert d_panels(80, torch.float16) == (128, 0)


def make_qkv_dv(case: Case, head_dim_v: int, dtype, device, layout: str = "bhsd"):
    b, h, hkv, sq, sk, d = case

    def rand(heads, seqlen, dim):
        if layout == "bshd":
            return torch.randn(b, seqlen, heads, dim, dtype=dtype, device=device).transpose(1, 2)
        return torch.randn(b, heads, seqlen, dim, dtype=dtype, device=device)

    return rand(h, sq, d), rand(hkv, sk, d), rand(hkv, sk, head_dim_v)


def check_case(q, k, v, opts) -> None:
    out, lse = flashcore.attention(q, k, v, return_lse=True, **opts)
    assert out.shape == (*q.shape[:3], v.shape[-1])
    check_forward(out, lse, q, k, v, **opts)
    dq, dk, dv = check_backward(q, k, v, dlse=torch.randn_like(lse), **opts)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("mc", "dv"), DV_CASES, ids=[f"{m.id}-dv{dv}" for m, dv in DV_CASES])
def test_value_dim(mc, dv, dtype, device):
    q, k, v = make_qkv_dv(mc.case, dv, dtype, device)
    check_case(q, k, v, mask_options(mc, device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("mc", "dv"), DV_CASES_GPU, ids=[f"{m.id}-dv{dv}" for m, dv in DV_CASES_GPU]
)
def test_value_dim_gpu(mc, dv, dtype, device):
    q, k, v = make_qkv_dv(mc.case, dv, dtype, device, layout="bshd")
    check_case(q, k, v, mask_options(mc, device))


# The Hopper forward's MLA build (Q and K at 192 in column panels, V and O at 128): ragged
# lengths both ways, GQA and MQA, causal with Sq > Sk and rows that see no key, the (B, S, H, D)
# layout, window, softcap, ALiBi and sinks.
MLA_CASES_SM90 = [
    (MaskCase(Case(2, 16, 16, 1024, 1024, 192), causal=True), "bshd", False),
    (MaskCase(Case(1, 8, 2, 777, 2049, 192)), "bhsd", False),
    (MaskCase(Case(2, 4, 1, 700, 300, 192), causal=True), "bhsd", True),
    # Programs of the persistent grid with several tiles, some of them seeing no key; and that
    # grid with a window (and sinks), whose tiles' key ranges start past key 0.
    (MaskCase(Case(4, 16, 4, 1000, 300, 192), causal=True), "bhsd", False),
    (MaskCase(Case(2, 8, 2, 900, 1100, 192), causal=True, window=(300, 0)), "bshd", True),
    (MaskCase(Case(1, 4, 4, 513, 513, 192), window=(100, 20), softcap=30.0), "bhsd", False),
    (MaskCase(Case(1, 4, 2, 390, 600, 192), alibi="bh"), "bshd", True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("mc", "layout", "with_sinks"),
    MLA_CASES_SM90,
    ids=[f"{m.id}-{lay}{'-sinks' * s}" for m, lay, s in MLA_CASES_SM90],
)
def test_value_dim_gpu_sm90_forward_kernel(mc, layout, with_sinks, dtype, device):
    """The Hopper forward at D = 192, Dv = 128, launched directly over every case (``supports``
    turns these shapes down while ``MLA_VERIFIED`` is off): out and LSE against the float64
    reference, every element of out written."""
    from flashcore.ops import fwd_sm90

    q, k, v = make_qkv_dv(mc.case, 128, dtype, device, layout=layout)
    if not (
        sm90_tier_runs(q.device) and fwd_sm90.dense_problem(q, k, v, (fwd_sm90.MLA_HEAD_DIMS,))
    ):
        pytest.skip("needs an sm_90 GPU and a Triton the sm90 tier was verified on")
    opts = mask_options(mc, device)
    sinks = torch.randn(mc.case.heads, device=device) if with_sinks else None
    out, lse = launch_sm90_forward(q, k, v, sinks=sinks, **opts)
    scale = mc.case.head_dim**-0.5
    ref = reference.attention(q, k, v, sinks=sinks, scale=scale, dtype=torch.float64, **opts)
    pt = reference.attention(q, k, v, sinks=sinks, scale=scale, dtype=dtype, **opts)
    assert not out.isnan().any()
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse, ref.lse)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_value_dim_gpu_sm90_tier(causal, layout, monkeypatch):
    """MLA head dims through ``flashcore.attention``: "auto" at 4096 launches the Hopper forward
    (never the portable one) and out and LSE meet the rule; under ``use_tier("sm90")`` at ragged
    short lengths, out, LSE and the gradients (the portable backward at these head dims) too."""
    from flashcore.ops import fwd, fwd_sm90, runtime

    if runtime.capability(torch.device("cuda")) != (9, 0) or not runtime.sm90_verified():
        pytest.skip("needs an sm_90 GPU and a Triton the sm90 tier was verified on")
    calls = []
    real = fwd_sm90.launch
    monkeypatch.setattr(fwd_sm90, "launch", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(fwd, "kernel", lambda: pytest.fail("portable forward launched"))
    # (2, 4, 4096, 192): 5.2e10 FLOPs causal, above tuning.SM90_FWD_MIN_FLOPS
    q, k, v = make_qkv_dv(Case(2, 4, 2, 4096, 4096, 192), 128, torch.bfloat16, "cuda", layout)
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    check_forward(out, lse, q, k, v, causal=causal)
    assert calls == [1]
    monkeypatch.undo()
    q, k, v = make_qkv_dv(Case(2, 4, 1, 300, 517, 192), 128, torch.float16, "cuda", layout)
    with flashcore.use_tier("sm90"):
        check_case(q, k, v, {"causal": causal})


@pytest.mark.gpu
def test_value_dim_gpu_sm90_graph():
    """A causal MLA forward (the persistent grid, one Q buffer a consumer) captured in a CUDA
    graph: a replay gives the eager call's bits, and again with new queries copied in."""
    from helpers import require_sm90

    require_sm90()
    q, k, v = make_qkv_dv(Case(2, 8, 2, 1000, 1000, 192), 128, torch.bfloat16, "cuda")
    with flashcore.use_tier("sm90"):
        eager = flashcore.attention(q, k, v, causal=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flashcore.attention(q, k, v, causal=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flashcore.attention(q, k, v, causal=True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        q.copy_(torch.randn_like(q))
        graph.replay()
        again = flashcore.attention(q, k, v, causal=True)
        torch.cuda.synchronize()
        assert torch.equal(out, again)
        assert not torch.equal(again, eager)


def test_value_dim_layout_and_sinks(device):
    """A (B, S, H, D) q gives a (B, S, H, Dv) out viewed as (B, H, S, Dv); sinks combine."""
    q, k, v = make_qkv_dv(Case(2, 4, 2, 20, 33, 32), 16, torch.float16, device, layout="bshd")
    sinks = torch.randn(4, device=device)
    out, lse = flashcore.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert out.transpose(1, 2).is_contiguous()
    check_forward(out, lse, q, k, v, causal=True, sinks=sinks)


def test_value_dim_varlen(device):
    case = VarlenCase(4, 2, (9, 20, 0, 5), (14, 0, 3, 5), 32)
    q = torch.randn(sum(case.seqlens_q), 4, 32, device=device)
    k = torch.randn(sum(case.seqlens_k), 2, 32, device=device)
    v = torch.randn(sum(case.seqlens_k), 2, 48, device=device)
    cu_q, cu_k = cu_seqlens(case.seqlens_q, device), cu_seqlens(case.seqlens_k, device)
    out, _, _ = check_varlen(case, q, k, v, cu_q, cu_k, causal=True, backward=True)
    assert out.shape == (q.shape[0], 4, 48)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_value_dim_gpu_mla_varlen(dtype):
    """MLA head dims through the packed backward (the MLA tiles of ``tuning.bwd_config``, with
    IS_VARLEN): ragged and empty sequences, GQA, causal."""
    case = VarlenCase(8, 2, (300, 0, 517, 64, 1000), (300, 9, 700, 64, 999), 192)
    q = torch.randn(sum(case.seqlens_q), 8, 192, device="cuda", dtype=dtype)
    k = torch.randn(sum(case.seqlens_k), 2, 192, device="cuda", dtype=dtype)
    v = torch.randn(sum(case.seqlens_k), 2, 128, device="cuda", dtype=dtype)
    cu_q, cu_k = cu_seqlens(case.seqlens_q, "cuda"), cu_seqlens(case.seqlens_k, "cuda")
    check_varlen(case, q, k, v, cu_q, cu_k, causal=True, backward=True)


def test_mla_forward_schedule(monkeypatch):
    """The Hopper forward's schedule at MLA's head dims (measured on the H200): causal on the
    persistent grid with one Q buffer a consumer, non-causal too up to 16 key tiles (2048 keys
    at MLA's, 1024 at head dim 256) and flat past them or with a window, causal with softcap or
    ALiBi flat (their persistent builds spilled); and "auto" takes the tier from 512 queries and
    keys and, eagerly, 2e10 FLOPs."""
    from flashcore import tuning
    from flashcore.ops import fwd_sm90
    from flashcore.ops.problem import Varlen

    monkeypatch.setattr(fwd_sm90, "num_sms", lambda index: 132)
    q = torch.empty(2, 16, 4096, 192, dtype=torch.bfloat16)
    v = torch.empty(2, 16, 4096, 128, dtype=torch.bfloat16)
    lse = torch.empty(2, 16, 4096)
    options = dict(
        causal=True, qk_scale=0.1, window_left=-1, window_right=-1, has_window=False,
        softcap=0.0, alibi=False, sinks=False, stride_ab=0,
    )  # fmt: skip
    causal = fwd_sm90.plan(q, q, v, lse, **options)
    assert causal.meta["PERSISTENT"] and causal.meta["Q_BUFS"] == 1
    assert causal.grid == (132,)
    # Dealt dynamically over the flat grid's head groups (2.5 MB of K and V a head: 8 heads).
    assert causal.meta["DYNAMIC"] and causal.scalars[14] == 8
    full = fwd_sm90.plan(q, q, v, lse, **{**options, "causal": False})
    assert not full.meta["PERSISTENT"] and full.grid == (32 * 2 * 16,)
    short_options = {**options, "causal": False}
    short = fwd_sm90.plan(q[:, :, :2048], q[:, :, :2048], v[:, :, :2048], lse, **short_options)
    assert short.meta["PERSISTENT"] and short.meta["Q_BUFS"] == 1 and short.grid == (132,)
    assert not short.meta["DYNAMIC"]
    windowed = {**short_options, "has_window": True, "window_left": 100, "window_right": 100}
    assert not fwd_sm90.plan(q, q, v, lse, **windowed).meta["PERSISTENT"]
    for extra in ({"softcap": 30.0}, {"alibi": True}):
        assert not fwd_sm90.plan(q, q, v, lse, **{**options, **extra}).meta["PERSISTENT"]
        q_short, v_short = q[:, :, :512], v[:, :, :512]
        plan = fwd_sm90.plan(q_short, q_short, v_short, lse, **{**short_options, **extra})
        assert not plan.meta["PERSISTENT"]
    assert fwd_sm90.plan(q[..., :128], q[..., :128], v, lse, **options).meta["Q_BUFS"] == 3
    # Packed batches (of equal lengths here) run flat with these builds.
    packed = q.transpose(1, 2).reshape(-1, 16, 192)
    varlen = Varlen(torch.tensor([0, 4096, 8192]), torch.tensor([0, 4096, 8192]), 4096, 4096)
    flat = fwd_sm90.plan(
        packed, packed, v.transpose(1, 2).reshape(-1, 16, 128), lse.reshape(16, -1), **options,
        varlen=varlen, out_strides=(16 * 128, 128),
    )  # fmt: skip
    assert not flat.meta["PERSISTENT"] and flat.meta["VARLEN"]
    # Head dim 256: the same, causal up to 2048 keys only (flat from 4096 measured faster).
    wide = torch.empty(2, 16, 2048, 256, dtype=torch.bfloat16)
    short = fwd_sm90.plan(wide, wide, wide, lse[..., :2048], **options)
    assert short.meta["PERSISTENT"] and short.meta["Q_BUFS"] == 1 and not short.meta["DYNAMIC"]
    wide = torch.empty(1, 16, 4096, 256, dtype=torch.bfloat16)
    assert not fwd_sm90.plan(wide, wide, wide, lse[:1], **options).meta["PERSISTENT"]
    # ... and non-causal up to 1024 keys (16 key tiles of 64).
    for seqlen, persistent in ((1024, True), (1025, False), (2048, False)):
        wide = torch.empty(2, 16, seqlen, 256, dtype=torch.bfloat16)
        plan = fwd_sm90.plan(wide, wide, wide, lse[..., :seqlen], **short_options)
        assert plan.meta["PERSISTENT"] == persistent, seqlen
    # Eagerly from 2e10 FLOPs (4 B H Sq Sk D, halved causal), not the other head dims' 3e10.
    flops = 4 * 16 * 16 * 512 * 512 * 192 / 2
    assert tuning.sm90_forward(512, 512, 192, flops, causal=True)
    assert not tuning.sm90_forward(512, 512, 128, flops, causal=True)
    assert not tuning.sm90_forward(512, 512, 192, flops / 2, causal=True)
    assert not tuning.sm90_forward(256, 256, 192, flops)


def test_mla_backward_tiles():
    """The backward's tiles at MLA's head dims (measured on the H100) and where they do not
    apply: equal head dims of 256, V the wider one, fp32, GPUs before Hopper."""
    from flashcore import tuning

    mla = tuning.bwd_config(192, 2, interpreted=False, head_dim_v=128)
    assert (mla.block_m1, mla.block_n1, mla.block_m2, mla.block_n2) == (32, 128, 128, 64)
    assert (mla.num_stages, mla.dq_stages) == (2, 2)
    # Q/K in 128 + 64 column panels (ops/bwd.py: d_panels): the same tiles with a third stage,
    # for dQ always and for dK/dV without causal.
    panels = tuning.bwd_config(192, 2, interpreted=False, head_dim_v=128, panels=True)
    assert panels == dataclasses.replace(mla, num_stages=3, num_stages2=3)
    causal = tuning.bwd_config(192, 2, interpreted=False, head_dim_v=128, panels=True, causal=True)
    assert causal == dataclasses.replace(mla, num_stages2=3)
    wide = tuning.bwd_config(256, 2, interpreted=False)
    assert (wide.block_m1, wide.block_n1) == (32, 32)
    assert tuning.bwd_config(256, 2, interpreted=False, head_dim_v=256) == wide
    assert tuning.bwd_config(192, 4, interpreted=False, head_dim_v=128).num_stages == 1
    assert tuning.bwd_config(192, 2, interpreted=False, head_dim_v=128, capability=(8, 0)) == wide


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_value_dim_kvcache(paged, device):
    batch, heads, kv_heads, d, dv = 2, 4, 2, 48, 24
    q = torch.randn(batch, heads, 2, d, device=device, dtype=torch.float16)
    lens = torch.tensor([5, 60], dtype=torch.int32, device=device)
    if paged:
        k_cache = torch.randn(8, kv_heads, 16, d, device=device, dtype=torch.float16)
        v_cache = torch.randn(8, kv_heads, 16, dv, device=device, dtype=torch.float16)
        table = torch.randperm(8, device=device).to(torch.int32).view(batch, 4)
    else:
        k_cache = torch.randn(batch, kv_heads, 64, d, device=device, dtype=torch.float16)
        v_cache = torch.randn(batch, kv_heads, 64, dv, device=device, dtype=torch.float16)
        table = None
    for splits in (1, 3):
        out, lse = flashcore.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, block_table=table, num_splits=splits,
            return_lse=True,
        )  # fmt: skip
        assert out.shape == (batch, heads, 2, dv)
        opts = {"cache_seqlens": lens, "block_table": table}
        ref = reference.attention_with_kvcache(q, k_cache, v_cache, **opts)
        pt = reference.attention_with_kvcache(q, k_cache, v_cache, dtype=torch.float16, **opts)
        assert_fa_rule("out", out, pt.out, ref.out)
        assert_fa_rule("lse", lse, pt.lse.float(), ref.lse)


def test_value_dim_compile_and_opcheck(device):
    """The fakes give out v's head dim: torch.compile(fullgraph) and opcheck agree."""
    from flashcore.ops import registry as ops

    q, k, v = make_qkv_dv(Case(1, 2, 1, 12, 17, 32), 16, torch.float32, device, layout="bshd")
    options = (None, None, 0, 0, True, 0.25, -1, -1, 0.0, None, None)
    torch.library.opcheck(ops.attn_fwd, (q, k, v, *options))
    out, lse = ops.attn_fwd(q, k, v, *options)
    args = (torch.randn_like(out), q, k, v, out, lse, None, *options)
    torch.library.opcheck(ops.attn_bwd, args)

    def fn(q, k, v):
        return flashcore.attention(q, k, v, causal=True)

    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    assert torch.equal(got, fn(q, k, v))
    torch._dynamo.reset()


def test_value_dim_errors(device):
    q, k, v = make_qkv_dv(Case(1, 2, 1, 8, 8, 16), 24, torch.float32, device)
    with pytest.raises(ValueError, match=r"^k and v must have the same shape .*head dims may"):
        flashcore.attention(q, k, v[:, :, :5])
    with pytest.raises(NotImplementedError, match=r"v.shape\[-1\] = 260"):
        flashcore.attention(q, k, torch.zeros(1, 1, 8, 260, device=device))
    cache = torch.zeros(1, 1, 16, 16, device=device)
    lens = torch.tensor([3], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match=r"^k_cache and v_cache must have the same shape"):
        flashcore.attention_with_kvcache(q[:, :, :1], cache, cache[:, :, :8], cache_seqlens=lens)
