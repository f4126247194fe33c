"""Forward-mode AD and ``torch.func`` transforms: right or refused, never silently wrong.

FlashCore's ops have no forward-mode (jvp) formula, and PyTorch does not refuse custom ops for
that: through them ``torch.func.jvp`` gave a zero tangent and a dual tensor's tangent went
missing. The entry points now raise for forward-mode AD; the SDPA drop-in hands such calls to
PyTorch's SDPA. ``vmap`` runs (PyTorch's per-sample fallback for the registered op), and
``torch.func.grad`` either raises PyTorch's own error or gives the autograd gradient; a vmap
over the backward (``is_grads_batched``) raises an error that says so.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcore
from helpers import cu_seqlens, make_qkv
from shapes import Case


def _qkv(device):
    return make_qkv(Case(2, 4, 2, 12, 12, 16), torch.float32, device)


def test_jvp_refused(device):
    """torch.func.jvp, jacfwd and dual tensors through each entry point raise (each gave a zero
    or missing tangent before)."""
    q, k, v = _qkv(device)
    refused = pytest.raises(NotImplementedError, match="has no forward-mode derivative")
    with refused:
        torch.func.jvp(lambda q: flashcore.attention(q, k, v), (q,), (torch.ones_like(q),))
    with refused:
        torch.func.jacfwd(lambda v: flashcore.attention(q, k, v).sum())(v)
    lens = cu_seqlens((5, 7), device)
    packed = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)
    with fwAD.dual_level():
        dual_q = fwAD.make_dual(q, torch.ones_like(q))
        with refused:
            flashcore.attention(dual_q, k, v, causal=True)
        dual_v = fwAD.make_dual(packed[2], torch.ones_like(packed[2]))
        with refused:
            flashcore.attention_varlen(packed[0], packed[1], dual_v, lens, lens, 7, 7)
        cache_seqlens = torch.full((2,), 12, dtype=torch.int32, device=device)
        with refused:
            flashcore.attention_with_kvcache(
                fwAD.make_dual(q[:, :, :1], q[:, :, :1]), k, v, cache_seqlens=cache_seqlens
            )
        # Without a tangent on its inputs a call inside a dual level is an ordinary one.
        assert torch.equal(flashcore.attention(q, k, v), flashcore.attention(q.clone(), k, v))


def test_sdpa_drop_in_hands_jvp_to_pytorch(device, fresh_sdpa_warnings):
    """Under forward-mode AD the drop-in falls back to PyTorch's SDPA (whose math backend has a
    jvp), with its warning: the same primal and tangent as PyTorch's."""
    q, k, v = (t.double() for t in _qkv(device))
    k, v = k[:, :1], v[:, :1]  # broadcast kv heads, as PyTorch takes them
    tangent = torch.randn_like(q)
    with sdpa_kernel(SDPBackend.MATH):
        with pytest.warns(UserWarning, match="forward-mode AD"):
            got = torch.func.jvp(
                lambda q: flashcore.scaled_dot_product_attention(q.float(), k.float(), v.float()),
                (q,), (tangent,),
            )  # fmt: skip
        want = torch.func.jvp(
            lambda q: F.scaled_dot_product_attention(q.float(), k.float(), v.float()),
            (q,), (tangent,),
        )  # fmt: skip
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_vmap(device):
    """vmap over a leading dim: each slice as its own call."""
    q, k, v = _qkv(device)
    qs = torch.stack([q, 0.5 * q, -q])
    out = torch.func.vmap(lambda q: flashcore.attention(q, k, v, causal=True))(qs)
    for i in range(3):
        assert torch.equal(out[i], flashcore.attention(qs[i], k, v, causal=True))


def test_func_grad_right_or_refused(device):
    """torch.func.grad through the registered op: PyTorch refuses custom ops' autograd under
    its transforms today (a RuntimeError naming setup_context); should it start to allow it,
    the gradient must be autograd's."""
    q, k, v = _qkv(device)
    fn = lambda q: flashcore.attention(q, k, v, causal=True).square().sum()  # noqa: E731
    try:
        got = torch.func.grad(fn)(q)
    except RuntimeError as e:
        assert "functorch transforms" in str(e)
        return
    (want,) = torch.autograd.grad(fn(q.clone().requires_grad_()), q)
    assert torch.equal(got, want)


def test_batched_backward_refused(device):
    """A vmap over the backward (``is_grads_batched``, a vmapped ``autograd.grad``) raises a
    NotImplementedError that says so (PyTorch's own error named a BatchedTensorImpl's storage);
    a plain backward afterwards is unaffected."""
    q, k, v = (t.requires_grad_() for t in _qkv(device))
    out = flashcore.attention(q, k, v, causal=True)
    douts = torch.randn(3, *out.shape, device=device)
    refused = pytest.raises(NotImplementedError, match="backward does not run under")
    with refused:
        torch.autograd.grad(out, (q, k, v), douts, is_grads_batched=True, retain_graph=True)
    with refused:
        torch.func.vmap(lambda d: torch.autograd.grad(out, q, d, retain_graph=True))(douts)
    (dq,) = torch.autograd.grad(out, q, douts[0])
    assert dq.shape == q.shape and torch.isfinite(dq).all()
