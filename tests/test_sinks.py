"""Learnable attention sinks (``sinks=``): forward, LSE and gradients (dq, dk, dv and dsinks)
against the reference, with every option they combine with, on every entry point.

The sink is one more logit per query head in each row's softmax with no value; rows that see no
key give out 0 and lse = sink. The ops' registration with sinks is opchecked in test_compile.py.
"""

from __future__ import annotations

import pytest
import torch

import flashcore
from flashcore import reference
from helpers import (
    cu_seqlens,
    launch_sm90_forward,
    make_qkv,
    mask_options,
    record_backward_tiers,
    sm90_tier_runs,
    spy_d256,
)
from numerics import assert_fa_rule
from shapes import DTYPES, Case, MaskCase

# (mask case, label): plain GQA with Sq < Sk; causal with Sq > Sk (rows without keys); window,
# softcap and (B, H) ALiBi together; MQA at a padded head dim.
SINK_CASES = [
    (MaskCase(Case(2, 4, 2, 21, 37, 32)), "gqa"),
    (MaskCase(Case(1, 2, 2, 70, 45, 64), causal=True), "causal-rows-without-keys"),
    (MaskCase(Case(1, 4, 2, 45, 70, 32), window=(8, 3), softcap=5.0, alibi="bh"), "masks"),
    (MaskCase(Case(2, 2, 1, 33, 40, 80), causal=True, window=(16, 0)), "mqa-d80"),
]

SINK_CASES_GPU = [
    (MaskCase(Case(2, 16, 4, 1024, 1024, 128), causal=True), "causal-1k-d128"),
    (MaskCase(Case(1, 8, 8, 777, 2049, 64), window=(256, 0), softcap=30.0), "window-softcap"),
    (MaskCase(Case(2, 8, 1, 500, 300, 256), alibi="h"), "mqa-d256-sq>sk"),
]


def make_sinks(heads: int, device: str, no_sink: bool = True) -> torch.Tensor:
    """Sinks around the scores' scale; with ``no_sink`` one of them is -inf (no sink for that
    head; not where rows see no key: the reference's gradient is then 0/0)."""
    sinks = torch.randn(heads, device=device) * 2.0
    if no_sink:
        sinks[heads // 2] = float("-inf")
    return sinks


def case_sinks(mc: MaskCase, device: str) -> torch.Tensor:
    """``make_sinks`` for a case, with a -inf sink only if every row sees a key."""
    c = mc.case
    seen = reference.visible_mask(c.seqlen_q, c.seqlen_k, causal=mc.causal, window=mc.window)
    return make_sinks(c.heads, device, no_sink=bool(seen.any(dim=1).all()))


def reference_out_grads(q, k, v, sinks, dout, dlse, *, dtype, **opts):
    """``(out, lse), (dq, dk, dv, dsinks)`` of the reference in ``dtype`` (fresh leaves)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
    ref = reference.attention(*leaves[:3], sinks=leaves[3], dtype=dtype, **opts)
    grads = torch.autograd.grad((ref.out, ref.lse), leaves, (dout.to(dtype), dlse.to(dtype)))
    return ref, grads


def check_sinks_case(q, k, v, sinks, **opts) -> None:
    """Forward and backward (through out and lse) against the reference, FlashAttention's rule
    on out, lse, dq, dk, dv and dsinks (the sinks' pt baseline in q's dtype as the others)."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    sinks = sinks.detach().requires_grad_()
    out, lse = flashcore.attention(q, k, v, sinks=sinks, return_lse=True, **opts)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v, sinks), (dout, dlse))
    ref64, want64 = reference_out_grads(q, k, v, sinks, dout, dlse, dtype=torch.float64, **opts)
    pt, want_pt = reference_out_grads(q, k, v, sinks, dout, dlse, dtype=q.dtype, **opts)
    assert_fa_rule("out", out, pt.out, ref64.out)
    assert_fa_rule("lse", lse, pt.lse, ref64.lse)
    for name, g, p, r in zip(("dq", "dk", "dv", "dsinks"), got, want_pt, want64, strict=True):
        assert_fa_rule(name, g, p, r)
    assert got[3].dtype == torch.float32


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("mc", "label"), SINK_CASES, ids=[c[1] for c in SINK_CASES])
def test_sinks_forward_backward(mc, label, dtype, device):
    q, k, v = make_qkv(mc.case, dtype, device)
    check_sinks_case(q, k, v, case_sinks(mc, device), **mask_options(mc, device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("mc", "label"), SINK_CASES_GPU, ids=[c[1] for c in SINK_CASES_GPU])
def test_sinks_gpu(mc, label, dtype, device):
    q, k, v = make_qkv(mc.case, dtype, device, layout="bshd")
    check_sinks_case(q, k, v, case_sinks(mc, device), **mask_options(mc, device))


SINK_CASES_SM90 = [
    (MaskCase(Case(2, 16, 4, 1024, 1024, 128), causal=True), "causal-d128-gqa"),
    (MaskCase(Case(1, 8, 8, 700, 1100, 64)), "full-d64-sq<sk"),
    (MaskCase(Case(1, 4, 2, 1100, 300, 128), causal=True), "causal-sq>sk-rows-without-keys"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(("mc", "label"), SINK_CASES_SM90, ids=[c[1] for c in SINK_CASES_SM90])
def test_sinks_gpu_sm90_backward(mc, label, dtype, device, monkeypatch):
    """The Hopper backward with sinks (it needs nothing but delta for them): forced onto it where
    it runs (sm_90), with a check that it did run there."""
    ran = record_backward_tiers(monkeypatch)
    q, k, v = make_qkv(mc.case, dtype, device, layout="bshd")
    with flashcore.use_tier("sm90"):
        check_sinks_case(q, k, v, case_sinks(mc, device), **mask_options(mc, device))
    assert ran == ["sm90" if sm90_tier_runs(q.device) else "portable"]


def test_rows_without_keys_give_the_sink(device):
    """Causal Sq > Sk: rows 0..Sq-Sk-1 see no key: out 0, lse = sink; their dq is 0 and the
    sinks' gradient from them is dlse (p_sink = 1, delta = -dlse)."""
    q, k, v = (
        t.requires_grad_() for t in make_qkv(Case(1, 2, 1, 20, 5, 16), torch.float32, device)
    )
    sinks = torch.tensor([0.5, -1.5], device=device, requires_grad=True)
    out, lse = flashcore.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    assert torch.all(out[:, :, :15] == 0)
    want = sinks.detach()[:, None].expand(2, 15)
    torch.testing.assert_close(lse[0, :, :15], want, rtol=1e-6, atol=0)
    dlse = torch.zeros_like(lse)
    dlse[:, :, :15] = 1.0
    dq, dsinks = torch.autograd.grad(lse, (q, sinks), dlse)
    assert torch.all(dq[:, :, :15] == 0)
    torch.testing.assert_close(dsinks, torch.full_like(dsinks, 15.0))


def test_no_keys_at_all(device):
    """Sk = 0 launches nothing: out 0, lse = sink on every row; dsinks = sum of dlse."""
    q = torch.randn(2, 3, 4, 16, device=device, requires_grad=True)
    k = torch.randn(2, 3, 0, 16, device=device)
    sinks = torch.randn(3, device=device, requires_grad=True)
    out, lse = flashcore.attention(q, k, k, sinks=sinks, return_lse=True)
    assert torch.all(out == 0)
    assert torch.equal(lse, sinks.detach()[None, :, None].expand(2, 3, 4))
    dlse = torch.randn_like(lse)
    (dsinks,) = torch.autograd.grad(lse, sinks, dlse)
    torch.testing.assert_close(dsinks, dlse.sum(dim=(0, 2)))


def test_sinks_of_minus_inf_are_no_sinks(device):
    """Every sink -inf gives exactly the results of no sinks (and a zero sink gradient)."""
    q, k, v = make_qkv(Case(1, 2, 2, 30, 41, 32), torch.float16, device)
    sinks = torch.full((2,), float("-inf"), device=device, requires_grad=True)
    out, lse = flashcore.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)
    want_out, want_lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    (dsinks,) = torch.autograd.grad(out, sinks, torch.randn_like(out))
    assert torch.equal(dsinks, torch.zeros_like(dsinks))


def test_sinks_varlen(device):
    """attention_varlen with sinks: sequences with Sq > Sk, no keys and no queries; forward and
    backward against the per-sequence reference."""
    seqlens_q, seqlens_k = (9, 20, 0, 5, 4), (14, 0, 3, 5, 30)
    heads, kv_heads, d = 4, 2, 32
    q = torch.randn(sum(seqlens_q), heads, d, device=device, requires_grad=True)
    k = torch.randn(sum(seqlens_k), kv_heads, d, device=device, requires_grad=True)
    v = torch.randn(sum(seqlens_k), kv_heads, d, device=device, requires_grad=True)
    cu_q, cu_k = cu_seqlens(seqlens_q, device), cu_seqlens(seqlens_k, device)
    sinks = make_sinks(heads, device, no_sink=False).requires_grad_()
    opts = {"causal": True, "softcap": 6.0}
    out, lse = flashcore.attention_varlen(
        q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), sinks=sinks, return_lse=True, **opts
    )
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v, sinks), (dout, dlse))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref = reference.attention_varlen(*leaves[:3], cu_q, cu_k, sinks=leaves[3], **opts)
    want = torch.autograd.grad((ref.out, ref.lse), leaves, (dout.double(), dlse.double()))
    # fp32 inputs: pt (the reference in fp32) is as exact as the kernels; the floor dominates.
    leaves32 = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    pt = reference.attention_varlen(
        *leaves32[:3], cu_q, cu_k, sinks=leaves32[3], dtype=torch.float32, **opts
    )
    want_pt = torch.autograd.grad((pt.out, pt.lse), leaves32, (dout, dlse))
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse, ref.lse)
    for name, g, p, r in zip(("dq", "dk", "dv", "dsinks"), got, want_pt, want, strict=True):
        assert_fa_rule(name, g, p, r)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sinks_varlen_gpu_sm90_backward(head_dim, device, monkeypatch):
    """A packed batch with sinks through the Hopper backward (its delta, in the packed LSE's
    layout, gives the sinks' gradient): sequences with Sq > Sk, no keys and no queries, causal
    with softcap, bf16, against the per-sequence reference; the tier recorded."""
    ran = record_backward_tiers(monkeypatch)
    seqlens_q, seqlens_k = (90, 200, 0, 65, 64, 300), (140, 0, 30, 65, 300, 129)
    heads, kv_heads, dtype = 4, 2, torch.bfloat16
    q = torch.randn(sum(seqlens_q), heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(sum(seqlens_k), kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(sum(seqlens_k), kv_heads, head_dim, device=device, dtype=dtype)
    cu_q, cu_k = cu_seqlens(seqlens_q, device), cu_seqlens(seqlens_k, device)
    sinks = torch.randn(heads, device=device)
    opts = {"causal": True, "softcap": 20.0}
    inputs = [t.requires_grad_() for t in (q, k, v, sinks)]
    with flashcore.use_tier("sm90"):
        out, lse = flashcore.attention_varlen(
            *inputs[:3], cu_q, cu_k, max(seqlens_q), max(seqlens_k), sinks=inputs[3],
            return_lse=True, **opts,
        )  # fmt: skip
        dout, dlse = torch.randn_like(out), torch.randn_like(lse)
        got = torch.autograd.grad((out, lse), inputs, (dout, dlse))
    assert ran == ["sm90" if sm90_tier_runs(q.device) else "portable"]

    def ref(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        r = reference.attention_varlen(*leaves[:3], cu_q, cu_k, sinks=leaves[3], dtype=dtype,
                                       **opts)  # fmt: skip
        grads = torch.autograd.grad((r.out, r.lse), leaves, (dout.to(dtype), dlse.to(dtype)))
        return r, grads

    (ref64, want64), (pt, want_pt) = ref(torch.float64), ref(dtype)
    assert_fa_rule("out", out, pt.out, ref64.out)
    assert_fa_rule("lse", lse, pt.lse, ref64.lse)
    for name, g, p, r in zip(("dq", "dk", "dv", "dsinks"), got, want_pt, want64, strict=True):
        assert_fa_rule(name, g, p, r)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_sinks_kvcache(paged, num_splits, device):
    """Decoding with sinks: the sink joins one split only, whatever the split count; an empty
    sequence gives out 0 and lse = sink."""
    batch, heads, kv_heads, seqlen_q, d, block = 3, 4, 2, 2, 32, 16
    q = torch.randn(batch, heads, seqlen_q, d, device=device, dtype=torch.float16)
    lens = torch.tensor([0, 37, 64], dtype=torch.int32, device=device)
    if paged:
        k_cache = torch.randn(12, kv_heads, block, d, device=device, dtype=torch.float16)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(12, device=device).to(torch.int32).view(batch, 4)
    else:
        k_cache = torch.randn(batch, kv_heads, 64, d, device=device, dtype=torch.float16)
        v_cache = torch.randn_like(k_cache)
        table = None
    sinks = make_sinks(heads, device)
    opts = {"cache_seqlens": lens, "block_table": table, "window": (20, -1), "softcap": 10.0}
    out, lse = flashcore.attention_with_kvcache(
        q, k_cache, v_cache, sinks=sinks, num_splits=num_splits, return_lse=True, **opts
    )
    ref = reference.attention_with_kvcache(q, k_cache, v_cache, sinks=sinks, **opts)
    pt = reference.attention_with_kvcache(
        q, k_cache, v_cache, sinks=sinks, dtype=torch.float16, **opts
    )
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse.float(), ref.lse)
    assert torch.all(out[0] == 0)
    # The kernel's base-2 round trip (sink * log2(e) * ln(2)) costs an ulp.
    torch.testing.assert_close(lse[0], sinks[:, None].expand(heads, seqlen_q), rtol=1e-6, atol=0)


def test_sinks_compile_fullgraph(device):
    """torch.compile(fullgraph=True) traces the sinks argument, forward and backward."""

    def fn(q, k, v, sinks):
        return flashcore.attention(q, k, v, causal=True, sinks=sinks, return_lse=True)

    torch._dynamo.reset()
    q, k, v = (
        t.requires_grad_() for t in make_qkv(Case(1, 2, 1, 24, 24, 16), torch.float32, device)
    )
    sinks = torch.randn(2, device=device, requires_grad=True)
    out, lse = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, sinks)
    want_out, want_lse = fn(q, k, v, sinks)
    assert torch.equal(out, want_out)
    assert torch.equal(lse, want_lse)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, sinks), dout)
    want = torch.autograd.grad(want_out, (q, sinks), dout)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    torch._dynamo.reset()


def test_strided_sinks(device):
    """A non-contiguous (H,) view is read correctly (copied) and gets its gradient."""
    q, k, v = make_qkv(Case(1, 3, 3, 10, 12, 16), torch.float32, device)
    base = torch.randn(3, 2, device=device, requires_grad=True)
    out = flashcore.attention(q, k, v, sinks=base[:, 1])
    want = flashcore.attention(q, k, v, sinks=base[:, 1].detach().contiguous())
    assert torch.equal(out, want)
    (g,) = torch.autograd.grad(out.sum(), base)
    assert torch.all(g[:, 0] == 0) and torch.all(g[:, 1] != 0)


@pytest.mark.parametrize(
    ("sinks", "error", "match"),
    [
        ([0.0, 1.0], TypeError, "sinks must be a torch.Tensor"),
        (torch.zeros(3), ValueError, r"sinks must have shape \(heads,\) = \(2,\)"),
        (torch.zeros(1, 2), ValueError, "sinks must have shape"),
        (torch.zeros(2, dtype=torch.float16), TypeError, "sinks must be float32"),
        (torch.zeros(2, dtype=torch.float64), TypeError, "sinks must be float32"),
    ],
    ids=["list", "heads", "rank", "fp16", "fp64"],
)
def test_bad_sinks(sinks, error, match, device):
    q, k, v = make_qkv(Case(1, 2, 1, 8, 8, 16), torch.float32, device)
    if isinstance(sinks, torch.Tensor):
        sinks = sinks.to(device)
    with pytest.raises(error, match=match):
        flashcore.attention(q, k, v, sinks=sinks)
    cu = cu_seqlens((8,), device)
    with pytest.raises(error, match=match):
        flashcore.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                   v[0].transpose(0, 1), cu, cu, 8, 8, sinks=sinks)  # fmt: skip


def test_bad_sinks_device_and_kvcache_grad(device):
    q = torch.randn(1, 2, 1, 16, device=device)
    cache = torch.randn(1, 1, 16, 16, device=device)
    lens = torch.tensor([5], dtype=torch.int32, device=device)
    if device == "cuda":
        with pytest.raises(ValueError, match="sinks must be on q's device"):
            flashcore.attention(q, cache, cache, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks requires grad, but attention_with_kvcache"):
        flashcore.attention_with_kvcache(
            q,
            cache,
            cache,
            cache_seqlens=lens,
            sinks=torch.zeros(2, device=device).requires_grad_(),
        )
    with torch.no_grad():
        sinks = torch.zeros(2, device=device).requires_grad_()
        out = flashcore.attention_with_kvcache(q, cache, cache, cache_seqlens=lens, sinks=sinks)
    assert out.shape == q.shape


SINK_CASES_SM90_FORWARD = [
    (MaskCase(Case(2, 16, 4, 1024, 1024, 128), causal=True), "causal-d128-gqa"),
    (MaskCase(Case(1, 8, 2, 1100, 300, 64), causal=True), "causal-sq>sk-rows-without-keys"),
    (MaskCase(Case(1, 4, 4, 700, 900, 64), window=(128, 0), softcap=30.0), "window-softcap"),
    (MaskCase(Case(2, 8, 8, 2048, 2048, 64), causal=True), "causal-2k-d64"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["flat", "persistent", "three", "one", "one-3-ctas"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    ("mc", "label"), SINK_CASES_SM90_FORWARD, ids=[c[1] for c in SINK_CASES_SM90_FORWARD]
)
def test_sinks_gpu_sm90_forward_kernel(mc, label, dtype, schedule, device):
    """The Hopper forward's HAS_SINKS build, launched directly on every schedule, three consumers
    at D=64 and one a CTA (the dispatch picks one schedule per shape): out and LSE against the
    reference."""
    from flashcore.ops import fwd_sm90, fwd_sm90_configs

    q, k, v = make_qkv(mc.case, dtype, device)
    if not (sm90_tier_runs(q.device) and fwd_sm90.dense_problem(q, k, v)):
        pytest.skip("needs an sm_90 GPU and a Triton the sm90 tier was verified on")
    if schedule in ("three", "one-3-ctas") and mc.case.head_dim != 64:
        pytest.skip("a D=64 config")
    if schedule.startswith("one") and (mc.window is not None or mc.softcap or mc.alibi):
        pytest.skip("one consumer a CTA is taken without a window, softcap or ALiBi")
    opts = mask_options(mc, device)
    sinks = case_sinks(mc, device)
    c = mc.case
    config = {
        "flat": fwd_sm90_configs.CONFIGS[c.head_dim]._replace(persistent=False),
        "persistent": fwd_sm90_configs.CONFIGS[c.head_dim]._replace(persistent=True),
        "three": fwd_sm90_configs.D64_THREE._replace(persistent=False),
        "one": fwd_sm90_configs.ONE[c.head_dim],
        "one-3-ctas": fwd_sm90_configs.ONE_D64_THREE_CTAS,
    }[schedule]
    out, lse = launch_sm90_forward(q, k, v, sinks=sinks, config=config, **opts)
    scale = c.head_dim**-0.5
    ref = reference.attention(q, k, v, sinks=sinks, scale=scale, dtype=torch.float64, **opts)
    pt = reference.attention(q, k, v, sinks=sinks, scale=scale, dtype=dtype, **opts)
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse, ref.lse)


@pytest.mark.gpu
def test_sinks_gpu_d256(monkeypatch):
    """Sinks at head dim 256 with the Hopper backward (``ops/bwd256.py``): its P comes from the
    LSE, which includes the sinks, so nothing of the kernels changes."""
    calls = spy_d256(monkeypatch)
    mc = MaskCase(Case(2, 4, 2, 600, 700, 256), causal=True)
    q, k, v = make_qkv(mc.case, torch.bfloat16, "cuda")
    check_sinks_case(q, k, v, case_sinks(mc, "cuda"), **mask_options(mc, "cuda"))
    assert calls
