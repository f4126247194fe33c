"""The Hopper backward at head dim 256 and MLA's (192, 128) (``ops/bwd256.py``): its kernels
against the float64 reference on the GPU, with masks, score options, GQA and packed batches, and
where they are not taken."""

import pytest
import torch

import flashcore
from helpers import (
    check_backward,
    make_qkv,
    mask_options,
    spy_d256,
)
from shapes import Case, MaskCase

# Head dim 256: the Gluon backward of ops/bwd256.py (a dQ and a dK/dV kernel).
D256_BWD = [
    Case(2, 4, 4, 1000, 1000, 256),
    Case(1, 4, 2, 513, 777, 256),
    Case(1, 4, 1, 777, 513, 256),
    Case(1, 2, 1, 203, 1100, 256),
    Case(1, 8, 8, 2048, 2048, 256),
    # Head dims 136-248 run the same kernels over 256-column boxes: the columns past the
    # tensors' load as zeros and are not stored (the gradients' padding is never written).
    Case(1, 4, 2, 600, 700, 136),
    Case(2, 4, 4, 513, 513, 192),
    Case(1, 4, 1, 700, 300, 248),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", D256_BWD, ids=[c.id for c in D256_BWD])
def test_backward_gpu_d256(case, dtype, causal, layout, monkeypatch):
    """Head dim 256 (and 136-248) on Hopper: GQA/MQA, ragged Sq and Sk either way, both layouts;
    the Gluon backward ran, and the gradients keep the inputs' strides."""
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(case, dtype, "cuda", layout=layout)
    dq, dk, dv = check_backward(q, k, v, causal=causal)
    assert calls, "the head-dim-256 Gluon backward did not run"
    if layout == "bshd":
        assert (dq.stride(), dk.stride(), dv.stride()) == (q.stride(), k.stride(), v.stride())


D256_MASKS = [
    (MaskCase(Case(1, 4, 2, 700, 900, 256), window=(200, 30)), torch.bfloat16),
    (MaskCase(Case(1, 4, 4, 900, 900, 256), causal=True, window=(300, 0)), torch.bfloat16),
    (MaskCase(Case(2, 4, 2, 600, 700, 256), causal=True, softcap=30.0), torch.bfloat16),
    (MaskCase(Case(1, 4, 1, 777, 513, 256), softcap=5.0), torch.float16),
    # Gemma 2's attention at head dim 256: causal, a sliding window and softcap 50.
    (
        MaskCase(Case(1, 4, 2, 1100, 1100, 256), causal=True, window=(300, 0), softcap=50.0),
        torch.bfloat16,
    ),
    (MaskCase(Case(1, 4, 4, 513, 777, 256), alibi="h"), torch.float16),
    (MaskCase(Case(2, 4, 2, 700, 600, 256), causal=True, alibi="bh"), torch.bfloat16),
    (
        MaskCase(Case(1, 4, 2, 600, 900, 256), window=(200, 30), softcap=20.0, alibi="h"),
        torch.float16,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", D256_BWD[1:4] + D256_BWD[5:], ids=lambda c: c.id)
def test_backward_gpu_d256_tma_epilogue(case, causal, layout, monkeypatch):
    """dK and dV of the 64-key dK/dV kernel stored by TMA (``bwd256.DKDV_TMA_EPILOGUE``, forced):
    ragged Sk (the copy engine drops the rows past it), head dims below 256 (and the columns
    past them), GQA/MQA, both layouts."""
    from flashcore.ops import bwd256

    monkeypatch.setattr(bwd256, "DKDV_TMA_EPILOGUE", True)
    bwd256._PLANS.clear()
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(case, torch.bfloat16, "cuda", layout=layout)
    check_backward(q, k, v, causal=causal)
    assert calls and all(p.dkdv[2]["TMA_EPILOGUE"] for p in bwd256._PLANS.values())


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("mc", "dtype"), D256_MASKS, ids=[f"{mc.id}-{str(d)[6:]}" for mc, d in D256_MASKS]
)
def test_backward_gpu_d256_masks(mc, dtype, monkeypatch):
    """Window, softcap and ALiBi (alone and together) at head dim 256 on Hopper."""
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(mc.case, dtype, "cuda")
    check_backward(q, k, v, **mask_options(mc, "cuda"))
    assert calls


D256_MLA = [
    (MaskCase(Case(2, 4, 4, 1000, 1000, 192)), "bhsd", torch.bfloat16),
    (MaskCase(Case(1, 4, 2, 513, 777, 192), causal=True), "bshd", torch.float16),
    (MaskCase(Case(1, 4, 1, 777, 513, 192), causal=True), "bhsd", torch.bfloat16),
    (MaskCase(Case(1, 8, 8, 2048, 2048, 192), causal=True), "bhsd", torch.bfloat16),
    # Keys ending halfway through a 128-key block (the 128-key kernel's consumer 1 past Sk), and
    # fewer keys than one block with more queries than keys.
    (MaskCase(Case(1, 4, 1, 300, 1088, 192)), "bhsd", torch.float16),
    (MaskCase(Case(2, 4, 2, 130, 100, 192), causal=True), "bshd", torch.bfloat16),
    (
        MaskCase(Case(1, 4, 2, 600, 900, 192), window=(200, 30), softcap=20.0, alibi="h"),
        "bhsd",
        torch.float16,
    ),
]


# The 128-key kernel as shipped, without SKIP_MASKED, MASK_EXPONENT, FRESH_DESC or SPLIT_DIAG; the
# 64-key fused kernel; the dQ kernel beside the 64-key dK/dV kernel; "-regs": dK and dV stored
# from registers instead of by TMA.
MLA_PATHS = ["wide", "wide-noskip", "wide-nomexp", "wide-nofresh", "wide-nosplit", "wide-regs"]
MLA_PATHS += ["fused-dq", "fused-dq-regs", "dq-kernel", "dq-kernel-regs"]


@pytest.mark.gpu
@pytest.mark.parametrize("path", MLA_PATHS)
@pytest.mark.parametrize(
    ("mc", "layout", "dtype"),
    D256_MLA,
    ids=[f"{mc.id}-{layout}-{str(d)[6:]}" for mc, layout, d in D256_MLA],
)
def test_backward_gpu_d256_mla(mc, layout, dtype, path, monkeypatch):
    """MLA's head dims (q and k 192, v 128) through the head-dim-256 kernels (Q and K in a 128-
    and a 64-column tile): GQA/MQA, ragged lengths either way, causal, the score options; dQ in
    the dK/dV kernel, at 128 keys a program where the options allow (``bwd256.WIDE_MLA``, as
    shipped: "wide"; "wide-noskip" without skipping consumer 1's causal steps that see none of
    its keys, ``bwd256.WIDE_SKIP_MASKED``; "wide-nomexp" with its exponent formed after the
    masks' branches, ``bwd256.WIDE_MASK_EXPONENT`` off; "wide-nofresh" with its fixed tiles'
    descriptors formed before the step loop, ``bwd256.WIDE_FRESH_DESC`` off; "wide-nosplit" with
    the causal diagonal's steps in the same loop as the others, ``bwd256.WIDE_SPLIT_DIAG`` off) or
    at 64 ("fused-dq"), and by the dQ kernel ("dq-kernel"); "-regs": dK and dV stored from registers
    (``bwd256.WIDE_TMA_EPILOGUE`` and ``DKDV_TMA_EPILOGUE`` off; on elsewhere, by TMA)."""
    from flashcore.ops import bwd256

    monkeypatch.setattr(bwd256, "FUSED_MLA", not path.startswith("dq-kernel"))
    tma = not path.endswith("-regs")
    monkeypatch.setattr(bwd256, "DKDV_TMA_EPILOGUE", tma)
    monkeypatch.setattr(bwd256, "WIDE_MLA", path.startswith("wide"))
    monkeypatch.setattr(bwd256, "WIDE_SKIP_MASKED", path != "wide-noskip")
    monkeypatch.setattr(bwd256, "WIDE_MASK_EXPONENT", path != "wide-nomexp")
    monkeypatch.setattr(bwd256, "WIDE_FRESH_DESC", path != "wide-nofresh")
    monkeypatch.setattr(bwd256, "WIDE_SPLIT_DIAG", path != "wide-nosplit")
    monkeypatch.setattr(bwd256, "WIDE_TMA_EPILOGUE", tma)
    bwd256._PLANS.clear()
    calls = spy_d256(monkeypatch)
    q, k, _ = make_qkv(mc.case, dtype, "cuda", layout=layout)
    _, _, v = make_qkv(mc.case._replace(head_dim=128), dtype, "cuda", layout=layout)
    options = mask_options(mc, "cuda")
    dv = check_backward(q, k, v, **options)[2]
    assert calls, "the head-dim-256 Gluon backward did not run"
    assert dv.shape == v.shape
    plain = not (mc.window or mc.softcap or mc.alibi)
    assert any(p.wide for p in bwd256._PLANS.values()) == (path.startswith("wide") and plain)
    assert all(p.dkdv[2]["TMA_EPILOGUE"] == tma for p in bwd256._PLANS.values())
    wide = [p for p in bwd256._PLANS.values() if p.wide]
    assert all(p.dkdv[2]["FRESH_DESC"] == (path != "wide-nofresh") for p in wide)


@pytest.mark.gpu
def test_backward_gpu_d256_deterministic_and_lse_grad(monkeypatch):
    """No atomics: two backwards are bit-identical, ``deterministic=True`` takes the kernels
    too; a gradient through the LSE reaches the gradients (delta carries it)."""
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(Case(1, 4, 2, 1000, 1100, 256), torch.bfloat16, "cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flashcore.attention(q, k, v, causal=True, deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), dout)
    assert calls
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    q, k, v = (t.detach() for t in (q, k, v))
    check_backward(q, k, v, causal=False, dlse=torch.randn(1, 4, 1000, device="cuda"))


@pytest.mark.gpu
def test_backward_gpu_mla_deterministic(monkeypatch):
    """MLA's dQ is reduce-added in the dK/dV kernel by default (its plan holds the fp32
    accumulator) and by the dQ kernel with ``deterministic=True``, whose two backwards are
    bit-identical."""
    from flashcore.ops import bwd256

    calls = spy_d256(monkeypatch)
    q, k, _ = make_qkv(Case(1, 4, 2, 700, 900, 192), torch.bfloat16, "cuda")
    v = make_qkv(Case(1, 4, 2, 700, 900, 128), torch.bfloat16, "cuda")[2]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for deterministic in (False, True):
        bwd256._PLANS.clear()
        out = flashcore.attention(q, k, v, causal=True, deterministic=deterministic)
        dout = torch.randn_like(out)
        first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        second = torch.autograd.grad(out, (q, k, v), dout)
        (plan,) = bwd256._PLANS.values()
        assert (plan.acc is None) == deterministic
        if deterministic:
            for a, b in zip(first, second, strict=True):
                assert torch.equal(a, b)
        # Either way dK and dV are written once per program.
        assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    assert len(calls) == 4


@pytest.mark.gpu
def test_backward_gpu_d256_not_taken(monkeypatch):
    """fp32, a value head dim unlike the query's but MLA's, and head dims outside 136-256 or not
    a multiple of 8 keep the other backwards (``bwd256.takes``)."""
    calls = spy_d256(monkeypatch)
    q, k, v = make_qkv(Case(1, 2, 2, 300, 300, 256), torch.bfloat16, "cuda")
    check_backward(*(t.float() for t in (q, k, v)), causal=False)
    check_backward(q[..., :192], k[..., :192], v[..., :64], causal=True)
    q, k, v = make_qkv(Case(1, 2, 2, 300, 300, 132), torch.bfloat16, "cuda")
    check_backward(q, k, v, causal=False)
    q, k, v = make_qkv(Case(1, 2, 2, 300, 300, 120), torch.bfloat16, "cuda")
    check_backward(q, k, v, causal=False)
    assert not calls
    # MLA's head dims run these kernels causal; non-causal at every length where the 128-key
    # kernel takes them, else from MLA_NON_CAUSAL_MIN_SEQLEN keys (``bwd256.MLA_NON_CAUSAL``
    # off, as shipped).
    from flashcore.ops import bwd256

    monkeypatch.setattr(bwd256, "MLA_NON_CAUSAL", False)
    q, k, v = make_qkv(Case(1, 2, 2, 300, 300, 192), torch.bfloat16, "cuda")
    check_backward(q, k, v[..., :128], causal=False, softcap=20.0)
    check_backward(q, k, v[..., :128], causal=False, window=(100, 100))
    assert not calls
    check_backward(q, k, v[..., :128], causal=False)
    assert len(calls) == 1
    check_backward(q, k, v[..., :128], causal=True, softcap=20.0)
    assert len(calls) == 2
    long_k = torch.empty(1, 2, bwd256.MLA_NON_CAUSAL_MIN_SEQLEN, 192, device="cuda").bfloat16()
    long_v = long_k[..., :128]
    dout = torch.empty_like(q[..., :128])
    short = (q, long_k[:, :, :-1], long_v[:, :, :-1], dout, False, None, None)
    assert bwd256.takes(*short)
    assert not bwd256.takes(*short, (-1, -1), 20.0)
    assert not bwd256.takes(*short, deterministic=True)
    assert bwd256.takes(q, long_k, long_v, dout, False, None, None, (-1, -1), 20.0)
    monkeypatch.setattr(bwd256, "WIDE_MLA", False)
    assert not bwd256.takes(*short)
