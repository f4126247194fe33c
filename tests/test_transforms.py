"""Forward-mode AD and ``torch.func`` transforms: right or refused, never silently wrong.

FlashCore's ops have no forward-mode (jvp) formula, and PyTorch does not refuse custom ops for
that: through them ``torch.func.jvp`` gave a zero tangent and a dual tensor's tangent went
missing. The entry points now raise for forward-mode AD; the SDPA drop-in hands such calls to
PyTorch's SDPA. Reverse-mode transforms (``grad``, ``vjp``, ``jacrev``) give autograd's
gradients (``ops.transforms``), and ``vmap`` folds the vmapped dim into the batch (one launch;
per sample for packed batches and sinks), so per-sample gradients (``vmap(grad(f))``) are each
sample's own. A second derivative raises, as it does eagerly; a vmap over an eager backward
(``is_grads_batched``) raises an error that says so.

Exact comparisons use ``deterministic=True`` where a backward runs (the Hopper backward's
reduce-adds may order dQ's sums differently between two calls).
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcore
from flashcore.ops import fwd
from helpers import alibi_slopes, cu_seqlens, make_qkv
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


def test_vmap(device, monkeypatch):
    """vmap over a leading dim: one call of the folded batch (N samples of B as N * B), whether
    k and v are vmapped too or shared, at any in_dim; the ALiBi slopes folded with them."""
    q, k, v = _qkv(device)
    qs = torch.stack([q, 0.5 * q, -q])
    launched, launch = [], fwd.launch

    def spy(q, *args, **kwargs):
        launched.append(tuple(q.shape))
        return launch(q, *args, **kwargs)

    monkeypatch.setattr(fwd, "launch", spy)
    out, lse = torch.func.vmap(
        lambda q: flashcore.attention(q, k, v, causal=True, return_lse=True)
    )(qs)
    assert launched == [(6, 4, 12, 16)]  # one launch of the folded batch
    monkeypatch.undo()
    want = flashcore.attention(
        qs.flatten(0, 1), k.repeat(3, 1, 1, 1), v.repeat(3, 1, 1, 1), causal=True, return_lse=True
    )
    assert torch.equal(out, want[0].unflatten(0, (3, 2)))
    assert torch.equal(lse, want[1].unflatten(0, (3, 2)))
    for i in range(3):
        assert torch.equal(out[i], flashcore.attention(qs[i], k, v, causal=True))
    ks = torch.stack([k, 2 * k], dim=1)
    out = torch.func.vmap(lambda k: flashcore.attention(q, k, v), in_dims=1)(ks)
    for i in range(2):
        assert torch.equal(out[i], flashcore.attention(q, ks[:, i], v))
    slopes = (alibi_slopes(4, None, device), alibi_slopes(4, 2, device))
    for s in slopes:
        out = torch.func.vmap(lambda q, s=s: flashcore.attention(q, k, v, alibi_slopes=s))(qs)
        for i in range(3):
            assert torch.equal(out[i], flashcore.attention(qs[i], k, v, alibi_slopes=s))
    per_sample = torch.stack([slopes[0], 0.5 * slopes[0], 2 * slopes[0]])
    out = torch.func.vmap(lambda q, s: flashcore.attention(q, k, v, alibi_slopes=s))(qs, per_sample)
    for i in range(3):
        assert torch.equal(out[i], flashcore.attention(qs[i], k, v, alibi_slopes=per_sample[i]))


def test_vmap_nested_and_eager_backward(device):
    """A vmap of a vmap folds twice; a vmapped call's output takes an eager backward (the
    folded Function sits in the autograd graph): each sample's own values and gradients."""
    q, k, v = _qkv(device)
    grid = torch.randn(2, 3, *q.shape, device=device)
    fn = lambda q: flashcore.attention(q, k, v, causal=True, deterministic=True)  # noqa: E731
    out = torch.func.vmap(torch.func.vmap(fn))(grid)
    for i in range(2):
        for j in range(3):
            assert torch.equal(out[i, j], fn(grid[i, j]))
    qs = grid[0].clone().requires_grad_()
    torch.func.vmap(fn)(qs).square().sum().backward()
    for i in range(3):
        (want,) = _autograd(lambda q: fn(q).square().sum(), qs[i])
        assert torch.equal(qs.grad[i], want)


def test_vmap_per_sample_calls(device):
    """Packed batches, sinks and decoding from a cache run one call per sample: each sample's
    own result."""
    q, k, v = _qkv(device)
    qs, sinks = torch.stack([q, -q]), torch.randn(2, 4, device=device)
    out = torch.func.vmap(lambda q, s: flashcore.attention(q, k, v, sinks=s))(qs, sinks)
    for i in range(2):
        assert torch.equal(out[i], flashcore.attention(qs[i], k, v, sinks=sinks[i]))
    lens = cu_seqlens((5, 7), device)
    packed = torch.randn(3, 12, 4, 16, device=device)
    pk, pv = k[0].transpose(0, 1)[:12], v[0].transpose(0, 1)[:12]
    out = torch.func.vmap(lambda q: flashcore.attention_varlen(q, pk, pv, lens, lens, 7, 7))(packed)
    for i in range(3):
        assert torch.equal(out[i], flashcore.attention_varlen(packed[i], pk, pv, lens, lens, 7, 7))
    seqlens = torch.tensor([12, 7], dtype=torch.int32, device=device)
    rows = torch.stack([q[:, :, :1], -q[:, :, 1:2]])
    out = torch.func.vmap(
        lambda q: flashcore.attention_with_kvcache(q, k, v, cache_seqlens=seqlens)
    )(rows)
    for i in range(2):
        want = flashcore.attention_with_kvcache(rows[i], k, v, cache_seqlens=seqlens)
        assert torch.equal(out[i], want)


def test_kvcache_under_grad_refused(device):
    """torch.func.grad through attention_with_kvcache (no backward) raises an error that says
    so (PyTorch's named the Function's missing setup_context)."""
    q, k, v = _qkv(device)
    seqlens = torch.tensor([12, 7], dtype=torch.int32, device=device)
    fn = lambda q: flashcore.attention_with_kvcache(q, k, v, cache_seqlens=seqlens)  # noqa: E731
    with pytest.raises(NotImplementedError, match="attention_with_kvcache has no backward"):
        torch.func.grad(lambda q: fn(q).sum())(q[:, :, :1])
    # A vmapped call on inputs that require grad outside any grad transform runs.
    rows = torch.stack([q[:, :, :1], -q[:, :, :1]]).requires_grad_()
    out = torch.func.vmap(fn)(rows)
    assert torch.equal(out[1].detach(), fn(rows[1].detach()))


def test_registered_ops_vmap(device):
    """The registered ops called under vmap directly fold as the API's Functions do."""
    q, k, v = _qkv(device)
    qs, outs = torch.stack([q, -q]), []
    # cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap,
    # alibi_slopes
    options = (None, None, 0, 0, True, 0.25, -1, -1, 0.0, None)
    out, lse = torch.func.vmap(lambda q: torch.ops.flashcore.attn_fwd(q, k, v, *options))(qs)
    for i in range(2):
        outs.append(torch.ops.flashcore.attn_fwd(qs[i], k, v, *options))
        assert torch.equal(out[i], outs[i][0]) and torch.equal(lse[i], outs[i][1])
    douts = torch.randn_like(out)
    grads = torch.func.vmap(
        lambda do, q, o, lse: torch.ops.flashcore.attn_bwd(
            do, q, k, v, o, lse, None, *options, None, True
        )
    )(douts, qs, out, lse)
    for i in range(2):
        want = torch.ops.flashcore.attn_bwd(
            douts[i], qs[i], k, v, *outs[i], None, *options, None, True
        )
        for g, w in zip(grads[:3], want[:3], strict=True):
            assert torch.equal(g[i], w)


def _autograd(fn, *inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves)


def test_func_grad(device):
    """torch.func.grad (and vjp) give autograd's gradients: GQA causal q, k, v, sinks, a
    gradient through the LSE, a packed batch."""
    q, k, v = _qkv(device)
    sinks = torch.randn(4, device=device)

    def loss(q, k, v, s):
        out, lse = flashcore.attention(
            q, k, v, causal=True, sinks=s, return_lse=True, deterministic=True
        )
        return out.square().sum() + lse.sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    for g, w in zip(got, _autograd(loss, q, k, v, sinks), strict=True):
        assert torch.equal(g, w)
    out, vjp = torch.func.vjp(lambda v: flashcore.attention(q, k, v, deterministic=True), v)
    dout = torch.randn_like(out)
    (want,) = _autograd(
        lambda v: (flashcore.attention(q, k, v, deterministic=True) * dout).sum(), v
    )
    assert torch.equal(vjp(dout)[0], want)
    lens = cu_seqlens((5, 7), device)
    packed = q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1)

    def packed_loss(k):
        out = flashcore.attention_varlen(
            packed[0], k, packed[2], lens, lens, 7, 7, causal=True, deterministic=True
        )
        return out.square().sum()

    assert torch.equal(
        torch.func.grad(packed_loss)(packed[1]), _autograd(packed_loss, packed[1])[0]
    )


def test_per_sample_grads(device):
    """vmap(grad(f)): each sample's gradient, dense (folded into one backward) and with sinks
    (one backward a sample)."""
    q, k, v = _qkv(device)
    qs = torch.stack([q, 0.5 * q, -q])

    def loss(q, s=None):
        return flashcore.attention(q, k, v, causal=True, sinks=s, deterministic=True).square().sum()

    got = torch.func.vmap(torch.func.grad(loss))(qs)
    for i in range(3):
        assert torch.equal(got[i], _autograd(loss, qs[i])[0])
    sinks = torch.randn(3, 4, device=device)
    got = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)))(qs, sinks)
    for i in range(3):
        want = _autograd(loss, qs[i], sinks[i])
        assert torch.equal(got[0][i], want[0]) and torch.equal(got[1][i], want[1])


def test_jacrev(device):
    """jacrev (a vmap over the backward's op) equals the Jacobian taken a row at a time."""
    q, k, v = (t[:1, :2, :4] for t in _qkv(device))
    v = v[..., :2].contiguous()  # a value head dim of its own: 16 outputs, 16 rows of backward
    fn = lambda v: flashcore.attention(q, k, v, causal=True, deterministic=True)  # noqa: E731
    got = torch.func.jacrev(fn)(v)
    want = torch.autograd.functional.jacobian(fn, v)
    assert got.shape == (*q.shape[:-1], v.shape[-1], *v.shape)
    assert torch.equal(got, want)


def test_functionalize_and_tracing(device):
    """functionalize runs the op (PyTorch has no functionalize rule for a Function), and make_fx
    traces grad and vmap into the ops (a dispatch mode under the transforms)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v = _qkv(device)
    fn = lambda q: flashcore.attention(q, k, v, causal=True)  # noqa: E731
    assert torch.equal(torch.func.functionalize(fn)(q), fn(q))
    loss = lambda q: fn(q).square().sum()  # noqa: E731
    traced = make_fx(torch.func.grad(loss))(q)
    ops = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert {"flashcore.attn_fwd.default", "flashcore.attn_bwd.default"} <= ops
    traced = make_fx(torch.func.vmap(fn))(torch.stack([q, -q]))
    assert "flashcore.attn_fwd.default" in {str(n.target) for n in traced.graph.nodes}


def test_second_derivative_under_grad_raises(device):
    """grad of grad raises, as a second derivative does eagerly."""
    q, k, v = _qkv(device)
    first = torch.func.grad(lambda q: flashcore.attention(q, k, v).square().sum())
    with pytest.raises(RuntimeError, match="backward is not differentiable"):
        torch.func.grad(lambda q: first(q).sum())(q)


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
