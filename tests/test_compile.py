"""``torch.library`` and ``torch.compile`` integration.

``opcheck`` runs on the calls the public API really makes: a dispatch mode records every
``flashcore::`` op called during a forward and a backward, and each recorded call is checked
(schema, fake tensor, autograd registration, AOT dispatch). A lost autograd registration makes the
backward tests fail (PyTorch's "no autograd formula" error), never skip.
"""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashcore
from helpers import (
    check_forward,
    check_grads,
    make_qkv,
    make_varlen,
)
from shapes import Case, VarlenCase

# (case, dtype, causal, layout, masks): GQA with Sq != Sk and (B, S, H, D) strides; a plain fp16
# one; one with a window, softcap, (B, H) ALiBi slopes (a tensor argument without gradient) and
# sinks (one with a gradient).
OPCHECK = [
    (Case(1, 4, 2, 17, 29, 32), torch.float32, True, "bshd", None),
    (Case(2, 2, 2, 16, 16, 16), torch.float16, False, "bhsd", None),
    (Case(2, 2, 1, 21, 30, 16), torch.float32, False, "bhsd", "masks"),
]


def _masks(kind, case: Case, device, grad: bool = False) -> dict:
    if kind is None:
        return {}
    slopes = torch.rand(case.batch, case.heads, device=device)
    sinks = torch.randn(case.heads, device=device).requires_grad_(grad)
    return {"window": (5, 2), "softcap": 4.0, "alibi_slopes": slopes, "sinks": sinks}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _RecordCalls(TorchDispatchMode):
    """Records ``(op, args, kwargs)`` of every ``flashcore::`` op dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "flashcore":
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


# attention_varlen: MQA, a sequence with Sq > Sk, one without keys, one without queries.
VARLEN_OPCHECK = VarlenCase(2, 1, (9, 20, 0, 5), (14, 0, 3, 5), 16)


def _record(case, dtype, causal, layout, masks, device, *, backward: bool) -> tuple[list, list]:
    """The flashcore op calls of a forward, and of its backward (empty unless ``backward``)."""
    q, k, v = (t.requires_grad_(backward) for t in make_qkv(case, dtype, device, layout=layout))
    options = _masks(masks, case, device, grad=backward)
    with _RecordCalls() as fwd_calls:
        out = flashcore.attention(q, k, v, causal=causal, **options)
    return _record_backward(out, fwd_calls, backward)


def _record_varlen(device, *, backward: bool) -> tuple[list, list]:
    """As ``_record``, for ``attention_varlen`` on VARLEN_OPCHECK (fp32, causal)."""
    case = VARLEN_OPCHECK
    q, k, v, cu_q, cu_k = make_varlen(case, torch.float32, device)
    q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
    maxima = max(case.seqlens_q), max(case.seqlens_k)
    with _RecordCalls() as fwd_calls:
        out = flashcore.attention_varlen(q, k, v, cu_q, cu_k, *maxima, causal=True)
    return _record_backward(out, fwd_calls, backward)


def _record_backward(out, fwd_calls, backward: bool) -> tuple[list, list]:
    with _RecordCalls() as bwd_calls:
        if backward:
            out.backward(torch.randn_like(out))
    assert fwd_calls.calls, "no flashcore op was called"
    return fwd_calls.calls, bwd_calls.calls


def _fresh(arg, requires_grad: bool):
    if not isinstance(arg, torch.Tensor):
        return arg
    return arg.detach().clone().requires_grad_(requires_grad and arg.requires_grad)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
@pytest.mark.parametrize(
    ("case", "dtype", "causal", "layout", "masks"), OPCHECK, ids=["gqa", "plain", "masks"]
)
def test_opcheck(case, dtype, causal, layout, masks, backward, device):
    """With ``fwd+bwd`` the forward ops get their recorded requires_grad (so opcheck runs their
    autograd formula) and the backward ops none (double backward is not offered)."""
    fwd_calls, bwd_calls = _record(case, dtype, causal, layout, masks, device, backward=backward)
    _opcheck(fwd_calls, bwd_calls, backward)


def test_opcheck_varlen(device):
    """The varlen ops, as ``test_opcheck`` with ``fwd+bwd`` (the forward op with its autograd
    formula, then the backward op); their fake kernels never read cu_seqlens."""
    _opcheck(*_record_varlen(device, backward=True), True)


def _opcheck(fwd_calls: list, bwd_calls: list, backward: bool) -> None:
    for calls, grad in ((fwd_calls, backward), (bwd_calls, False)):
        for op, args, kwargs in calls:
            torch.library.opcheck(op, tuple(_fresh(a, grad) for a in args), kwargs)


def test_every_op_is_exercised(device):
    """Each registered ``flashcore::`` op is reached by the forward or backward of the API."""
    # torch.ops.<namespace> lists only the ops looked up so far; the dispatcher knows all of them.
    registered = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("flashcore::")}
    assert "flashcore::attn_fwd" in registered
    case, dtype, causal, layout, masks = OPCHECK[0]
    fwd_calls, bwd_calls = _record(case, dtype, causal, layout, masks, device, backward=True)
    varlen_fwd_calls, varlen_bwd_calls = _record_varlen(device, backward=True)
    with _RecordCalls() as decode_calls:
        _decode_call(device)
    calls = fwd_calls + bwd_calls + varlen_fwd_calls + varlen_bwd_calls + decode_calls.calls
    called = {op._schema.name for op, _, _ in calls}
    missing = registered - called
    assert not missing, f"ops never called by the forward/backward, so never opchecked: {missing}"


def _decode_inputs(device: str) -> tuple:
    """A paged GQA cache with Sq=2 queries and per-head ALiBi slopes."""
    q = torch.randn(2, 4, 2, 32, device=device)
    k = torch.randn(5, 2, 16, 32, device=device)
    v = torch.randn(5, 2, 16, 32, device=device)
    lens = torch.tensor([20, 7], dtype=torch.int32, device=device)
    table = torch.tensor([[3, 0], [4, 1]], dtype=torch.int32, device=device)
    return q, k, v, lens, table, torch.rand(4, device=device)


def _decode(q, k, v, lens, table, slopes, **options):
    return flashcore.attention_with_kvcache(
        q, k, v, cache_seqlens=lens, block_table=table, alibi_slopes=slopes, num_splits=2,
        return_lse=True, **options,
    )  # fmt: skip


def _decode_call(device: str, **options):
    return _decode(*_decode_inputs(device), **options)


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["plain", "softcap-sinks"])
def test_opcheck_kvcache(softcap, device):
    sinks = None if softcap is None else torch.randn(4, device=device)
    with _RecordCalls() as rec:
        _decode_call(device, softcap=softcap, window=(9, -1), sinks=sinks)
    assert [op._schema.name for op, _, _ in rec.calls] == ["flashcore::attn_kvcache"]
    for op, args, kwargs in rec.calls:
        torch.library.opcheck(op, tuple(_fresh(a, False) for a in args), kwargs)


def test_compile_kvcache(device):
    inputs = _decode_inputs(device)
    compiled = torch.compile(_decode, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse = compiled(*inputs)
    _assert_no_dynamo_warnings(caught)
    want_out, want_lse = _decode(*inputs)
    assert torch.equal(out, want_out)
    assert torch.equal(lse, want_lse)


def _assert_no_dynamo_warnings(caught) -> None:
    dynamo = [str(w.message) for w in caught if "dynamo" in str(w.message).lower()]
    assert not dynamo, f"dynamo warned while tracing flashcore: {dynamo}"


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_forward(backend, dynamic, device):
    """fullgraph=True: the API's validation traces without a graph break, static or dynamic."""

    def fn(q, k, v):
        out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
        return out.float() * 2.0, lse

    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
    for case in (Case(1, 4, 2, 37, 53, 32), Case(2, 2, 1, 20, 9, 32)):
        q, k, v = make_qkv(case, torch.float16, device, layout="bshd")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, lse = compiled(q, k, v)
        _assert_no_dynamo_warnings(caught)
        want_out, want_lse = fn(q, k, v)
        assert torch.equal(out, want_out)
        assert torch.equal(lse, want_lse)


def test_export(device):
    """torch.export of a module calling flashcore.attention: the op in the exported graph, the
    same values when the exported program runs."""

    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return flashcore.attention(q, k, v, causal=True, window=(9, 0))

    q, k, v = make_qkv(Case(1, 4, 2, 21, 30, 16), torch.float32, device)
    program = torch.export.export(Block(), (q, k, v))
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert any("flashcore" in op for op in ops), ops
    assert torch.equal(program.module()(q, k, v), Block()(q, k, v))


def test_compile_autocast(device):
    """fullgraph=True under torch.autocast: the cast of fp32 inputs (tests/test_autocast.py)
    traces without a graph break; the same values and gradients as the eager call."""

    def fn(q, k, v):
        with torch.autocast(device, dtype=torch.bfloat16):
            return flashcore.attention(q, k, v, causal=True)

    case = Case(1, 4, 2, 37, 53, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.float32, device))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    _assert_no_dynamo_warnings(caught)
    assert out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    want = fn(q, k, v)
    want_grads = torch.autograd.grad(want.float().sum(), (q, k, v))
    assert torch.equal(out, want)
    for name, g, w in zip("qkv", grads, want_grads, strict=True):
        assert g.dtype == torch.float32 and torch.equal(g, w), name


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_backward(backend, device):

    def fn(q, k, v):
        return flashcore.attention(q, k, v, causal=True)

    case = Case(1, 4, 2, 37, 53, 32)
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.float16, device))
    out = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = {"q": q.grad, "k": k.grad, "v": v.grad}
    check_grads(grads, q, k, v, dout, causal=True)


def test_compile_varlen(device):
    """fullgraph=True through attention_varlen's checks, forward and backward; a second batch
    with other lengths and maxima runs through the same compiled function."""

    def fn(q, k, v, cu_q, cu_k, max_q, max_k):
        return flashcore.attention_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True
        )

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for case in (VARLEN_OPCHECK, VarlenCase(2, 1, (7, 30), (12, 25), 16)):
        q, k, v, cu_q, cu_k = make_varlen(case, torch.float16, device)
        maxima = max(case.seqlens_q), max(case.seqlens_k)
        want = fn(q, k, v, cu_q, cu_k, *maxima)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = compiled(q, k, v, cu_q, cu_k, *maxima)
        _assert_no_dynamo_warnings(caught)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # The compiled backward runs the same op as the eager one (checked against the reference
    # in test_varlen.py): the gradients must agree bit for bit.
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    grads = [
        torch.autograd.grad(f(q, k, v, cu_q, cu_k, *maxima)[0], (q, k, v), dout)
        for f in (compiled, fn)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_sdpa(backend, device):
    """The SDPA drop-in's FlashCore path (3-D input, top-left causal with Sq > Sk) has no break."""

    def fn(q, k, v):
        return flashcore.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, k, v = make_qkv(Case(1, 4, 2, 37, 21, 32), torch.float32, device)
    q, k, v = q[0], k[0], v[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend=backend, fullgraph=True)(q, k, v)
    _assert_no_dynamo_warnings(caught)
    assert torch.equal(out, fn(q, k, v))


def test_compile_checks_inputs(device):
    """Validation still runs under torch.compile and raises the eager error.

    (With fullgraph=True dynamo reports the same error wrapped as an "Observed exception".)
    """
    q, k, v = make_qkv(Case(1, 3, 2, 8, 8, 16), torch.float16, device)
    compiled = torch.compile(flashcore.attention, backend="aot_eager")
    with pytest.raises(ValueError, match=r"must be a multiple of k/v's heads"):
        compiled(q, k, v)


def test_compiled_matches_reference(device):
    q, k, v = make_qkv(Case(1, 2, 1, 45, 70, 64), torch.bfloat16, device)
    compiled = torch.compile(
        lambda q, k, v: flashcore.attention(q, k, v, causal=True, return_lse=True),
        backend="inductor",
        fullgraph=True,
    )
    out, lse = compiled(q, k, v)
    check_forward(out, lse, q, k, v, causal=True)
