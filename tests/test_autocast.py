"""``torch.autocast``: the entry points take their inputs as autocast hands them to PyTorch's SDPA.

Where autocast is on for q's device, float32, float16 and bfloat16 inputs run in autocast's dtype
(the result in it too, bit for bit a call with the inputs cast by hand) and gradients return in
each input's own dtype. An fp32 model under ``torch.autocast(dtype=torch.bfloat16)`` gets q and k
in fp32 after a rotary embedding and v in bf16: PyTorch's SDPA runs that, so must FlashCore.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import flashcore
from helpers import cu_seqlens

DTYPES = [torch.bfloat16, torch.float16]
IDS = ["bf16", "fp16"]


def _cast(*tensors, dtype):
    return tuple(t.detach().to(dtype) for t in tensors)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_attention_under_autocast(dtype, device):
    """q and k in fp32, v in autocast's dtype (a rotary embedding's promotion): the forward in
    that dtype, equal to the hand-cast call; dq and dk in fp32, dv in the autocast dtype, equal
    to the hand-cast call's gradients; the express path's repeat and options alike."""
    q = torch.randn(1, 4, 24, 32, device=device, requires_grad=True)
    k = torch.randn(1, 2, 40, 32, device=device, requires_grad=True)
    v = torch.randn(1, 2, 40, 32, device=device).to(dtype).requires_grad_()
    dout = torch.randn(1, 4, 24, 32, device=device).to(dtype)
    for options in ({"causal": True}, {"causal": True}, {"window": (7, 0), "softcap": 5.0}):
        q.grad = k.grad = v.grad = None
        with torch.autocast(device, dtype=dtype):
            out = flashcore.attention(q, k, v, **options)
            assert F.scaled_dot_product_attention(q, k, v.float(), enable_gqa=True).dtype == dtype
        assert out.dtype == dtype
        out.backward(dout)
        qc, kc, vc = (t.requires_grad_() for t in _cast(q, k, v, dtype=dtype))
        want = flashcore.attention(qc, kc, vc, **options)
        want.backward(dout)
        assert torch.equal(out, want), options
        assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, dtype)
        for name, got, ref in (("dq", q.grad, qc.grad), ("dk", k.grad, kc.grad)):
            assert torch.equal(got, ref.float()), (name, options)
        assert torch.equal(v.grad, vc.grad), options


def test_autocast_leaves_what_it_does_not_cast(device):
    """float64 stays float64 (autocast does not cast it) and is refused as outside autocast;
    autocast on for another device type leaves fp32 inputs in fp32."""
    q, k, v = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    refused = pytest.raises(TypeError, match="q must be float16, bfloat16 or float32")
    with torch.autocast(device, dtype=torch.bfloat16), refused:
        flashcore.attention(q.double(), k, v)
    other = "cpu" if device == "cuda" else "cuda"
    with warnings.catch_warnings():
        # Autocast for CUDA on a machine without it warns that it is disabled.
        warnings.simplefilter("ignore", UserWarning)
        with torch.autocast(other, dtype=torch.bfloat16):
            out = flashcore.attention(q, k, v)
    assert out.dtype == torch.float32
    assert torch.equal(out, flashcore.attention(q, k, v))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_varlen_under_autocast(dtype, device):
    """attention_varlen, forward and backward, as attention."""
    lens = (5, 17, 9)
    cu = cu_seqlens(lens, device)
    q = torch.randn(sum(lens), 4, 32, device=device, requires_grad=True)
    k = torch.randn(sum(lens), 2, 32, device=device, requires_grad=True)
    v = torch.randn(sum(lens), 2, 32, device=device).to(dtype).requires_grad_()
    with torch.autocast(device, dtype=dtype):
        out = flashcore.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert out.dtype == dtype
    out.float().sum().backward()
    qc, kc, vc = (t.requires_grad_() for t in _cast(q, k, v, dtype=dtype))
    want = flashcore.attention_varlen(qc, kc, vc, cu, cu, max(lens), max(lens), causal=True)
    want.float().sum().backward()
    assert torch.equal(out, want)
    assert q.grad.dtype == torch.float32 and torch.equal(q.grad, qc.grad.float())
    assert torch.equal(v.grad, vc.grad)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_kvcache_under_autocast(paged, device):
    """attention_with_kvcache: fp32 queries and caches run in bf16, as cast by hand."""
    q = torch.randn(2, 4, 1, 32, device=device)
    if paged:
        k, v = (torch.randn(6, 2, 16, 32, device=device) for _ in range(2))
        table = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=device)
    else:
        k, v = (torch.randn(2, 2, 48, 32, device=device) for _ in range(2))
        table = None
    lens = torch.tensor([37, 48], dtype=torch.int32, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = flashcore.attention_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table)
    assert out.dtype == torch.bfloat16
    qc, kc, vc = _cast(q, k, v, dtype=torch.bfloat16)
    want = flashcore.attention_with_kvcache(qc, kc, vc, cache_seqlens=lens, block_table=table)
    assert torch.equal(out, want)


def test_sdpa_drop_in_under_autocast(device, fresh_sdpa_warnings):
    """The SDPA drop-in takes mixed dtypes under autocast as PyTorch's SDPA does (no fallback,
    no warning), and a fallback (an attn_mask) returns what PyTorch's autocast gives."""
    q, k = (torch.randn(1, 2, 12, 16, device=device) for _ in range(2))
    v = torch.randn(1, 2, 12, 16, device=device, dtype=torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = flashcore.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert not [w for w in caught if "instead" in str(w.message)], caught
        mask = torch.ones(12, 12, dtype=torch.bool, device=device).tril()
        with pytest.warns(UserWarning, match="ran PyTorch's SDPA instead"):
            fallback = flashcore.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == torch.bfloat16
    qc, kc = _cast(q, k, dtype=torch.bfloat16)
    assert torch.equal(out, flashcore.attention(qc, kc, v, causal=True))
    assert fallback.dtype == torch_out.dtype == torch.bfloat16
    assert torch.equal(fallback, torch_out)
