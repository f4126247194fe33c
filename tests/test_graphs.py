"""CUDA graphs: every op captures, and each replay equals an eager call bit for bit.

A capture fails on any host sync (a read-back of a device tensor) and on any kernel compiled or
loaded inside it, so a capture that succeeds is the proof that the path has neither. Each test
warms up on a side stream (as ``torch.cuda.graph`` asks: every kernel variant compiled and loaded
before the capture), captures once, then changes the inputs' contents in place
(``cache_seqlens``, ``block_table`` and ``cu_seqlens`` included) before every replay and compares
the replay with an eager call on the same inputs. The eager calls run under
``torch.cuda.set_sync_debug_mode("error")``, which raises on a synchronising CUDA call. The
forward and the portable backward are deterministic (each output written by one program, no
atomics), so those comparisons are exact. The Hopper backward (the default on an H100 from
512 queries and keys on, ``tuning.sm90_backward``; its eager FLOP floor is lifted here
by the fixture below, as a capture lifts it) reduce-adds dQ over key blocks in
whatever order they finish: its dq is checked against the float64 reference with
FlashAttention's rule instead, and with ``deterministic=True`` the same capture is again exact.

``torch.cuda.make_graphed_callables`` (forward and backward as two graphs) and
``torch.compile(mode="reduce-overhead")`` (CUDA graph trees) are covered too; ``checked()``
refuses a capture with its own error. The last two tests are CPU unit tests of the messages.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

import flashcore
from flashcore import api, reference, tuning
from flashcore.ops import launch, runtime
from helpers import (
    check_grads,
    cu_seqlens,
    make_qkv,
    make_varlen,
    record_backward_tiers,
    record_sm90_forwards,
    require_sm90,
    sm90_tier_runs,
)
from numerics import assert_fa_rule
from shapes import DETERMINISM, MASKS_GPU, VARLEN_GPU, Case

# GQA (8 query heads on 2 kv heads) and MHA, lengths ragged against every tile.
CASES = DETERMINISM
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
REPLAYS = 3


@pytest.fixture(autouse=True)
def _eager_forward_tier_in_capture(monkeypatch):
    """A captured forward takes the Hopper tier from smaller problems on than an eager one
    (``tuning.SM90_FWD_MIN_FLOPS_GRAPH`` and ``_D64``); these tests compare replays with eager
    "auto" calls bit for bit, so the capture here decides as an eager call would, except in the
    tests of that choice (``test_capture_takes_sm90_forward_below_the_eager_floor``). The tier
    choices kept per problem signature start from none either way."""
    from flashcore.ops import bwd, fwd

    monkeypatch.setattr(tuning, "SM90_FWD_MIN_FLOPS_GRAPH", tuning.SM90_FWD_MIN_FLOPS)
    monkeypatch.setattr(tuning, "SM90_FWD_MIN_FLOPS_GRAPH_D64", tuning.SM90_FWD_MIN_FLOPS)
    monkeypatch.setattr(fwd, "_SM90_PLANS", {})
    # The backward the other way round: an eager call here decides as a capture would (no FLOP
    # floor, ``tuning.SM90_BWD_MIN_FLOPS_GRAPH``), so that these sizes still run the Hopper
    # backward, eagerly and captured, except in the test of that choice.
    monkeypatch.setattr(tuning, "SM90_BWD_MIN_FLOPS", tuning.SM90_BWD_MIN_FLOPS_GRAPH)
    monkeypatch.setattr(bwd, "_SM90", {})


@contextlib.contextmanager
def no_sync():
    """Any synchronising CUDA call inside raises (``torch.cuda.set_sync_debug_mode``)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def capture(fn, warmup: int = 2):
    """``(graph, static outputs)`` of ``fn`` captured once, after ``warmup`` eager calls on a
    side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


@torch.no_grad()
def refill(*tensors: torch.Tensor) -> None:
    """New random contents, in place (the graph keeps reading the same addresses)."""
    for t in tensors:
        t.copy_(torch.randn_like(t))


def as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def assert_equal(names, got, want) -> None:
    got, want = as_tuple(got), as_tuple(want)
    assert len(got) == len(want)
    for name, g, w in zip(names, got, want, strict=False):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.equal(g, w), f"{name}: the replay differs from the eager call"


def assert_dq(exact: bool, got, want, q, k, v, dout, **rule) -> None:
    """A replay's dq: equal to the eager call's where the backward is deterministic (``exact``),
    else within FlashAttention's rule against float64 (the Hopper backward reduce-adds dQ in
    whatever order the key blocks finish); ``rule``: ``check_grads``' options."""
    if exact:
        assert_equal(("dq",), got, want)
    else:
        check_grads({"q": got}, q, k, v, dout, **rule)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["auto", "tma"])
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_attention_graph(case, dtype, causal, return_lse, path, monkeypatch):
    # "tma" forces tensor descriptors (their tensor maps are kernel parameters, baked into the
    # graph with the addresses of q, k, v and out); "auto" moves these small tiles with pointers.
    if path == "tma":
        monkeypatch.setattr(tuning, "TMA_MIN_FLOPS", 0)
    q, k, v = make_qkv(case, dtype, "cuda")

    def call():
        return flashcore.attention(q, k, v, causal=causal, return_lse=return_lse)

    graph, static = capture(call)
    for _ in range(REPLAYS):
        refill(q, k, v)
        graph.replay()
        with no_sync():
            want = call()
        assert_equal(("out", "lse"), static, want)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_attention_graph_options_backward(dtype, deterministic, monkeypatch):
    # Window, softcap, ALiBi and sinks, forward and backward (sinks' gradient too) captured as
    # one graph; the slopes and sinks are tensors whose contents change between replays. At
    # 2048 tokens the default takes the Hopper backward on an H100 (its dQ order varies).
    mc = MASKS_GPU[-1]
    tiers = record_backward_tiers(monkeypatch)
    q, k, v = (t.requires_grad_() for t in make_qkv(mc.case, dtype, "cuda"))
    slopes = torch.rand(mc.case.heads, device="cuda")
    sinks = torch.randn(mc.case.heads, device="cuda", requires_grad=True)
    dout = torch.randn_like(q)
    dlse = torch.randn(q.shape[:3], device="cuda")
    leaves = (q, k, v, sinks)
    options = {"window": mc.window, "softcap": mc.softcap, "alibi_slopes": slopes}

    def call():
        out, lse = flashcore.attention(
            q,
            k,
            v,
            causal=mc.causal,
            return_lse=True,
            sinks=sinks,
            **options,
            deterministic=deterministic,
        )
        return out, lse, *torch.autograd.grad((out, lse), leaves, (dout, dlse))

    graph, static = capture(call)
    exact = deterministic or tiers[-1] == "portable"
    assert deterministic or tiers[-1] == ("sm90" if sm90_tier_runs(q.device) else "portable")
    for _ in range(REPLAYS):
        refill(q, k, v, sinks, dout, dlse)
        slopes.copy_(torch.rand_like(slopes))
        graph.replay()
        with no_sync():
            want = call()
        assert_equal(("out", "lse"), static[:2], want[:2])
        assert_equal(("dk", "dv", "dsinks"), static[3:], want[3:])
        masks = {**options, "sinks": sinks.detach()}
        assert_dq(exact, static[2], want[2], q, k, v, dout, causal=mc.causal, dlse=dlse, **masks)


class Block(torch.nn.Module):
    """A module whose forward is one attention call (``make_graphed_callables`` takes modules)."""

    def __init__(self, causal: bool, return_lse: bool) -> None:
        super().__init__()
        self.causal, self.return_lse = causal, return_lse

    def forward(self, q, k, v):
        return flashcore.attention(q, k, v, causal=self.causal, return_lse=self.return_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_graphed_callables_backward(case, dtype, causal, return_lse):
    block = Block(causal, return_lse)
    sample = tuple(t.requires_grad_() for t in make_qkv(case, dtype, "cuda"))
    graphed = torch.cuda.make_graphed_callables(block, sample)
    for _ in range(REPLAYS):
        inputs = [t.requires_grad_() for t in make_qkv(case, dtype, "cuda")]
        outputs = as_tuple(graphed(*inputs))
        seeds = [torch.randn_like(o) for o in outputs]
        grads = torch.autograd.grad(outputs, inputs, seeds)
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        with no_sync():
            want = as_tuple(block(*leaves))
            want_grads = torch.autograd.grad(want, leaves, seeds)
        assert_equal(("out", "lse"), outputs, want)
        assert_equal(("dq", "dk", "dv"), grads, want_grads)


def _pages(batch: int, per_seq: int, num_blocks: int) -> torch.Tensor:
    """A block table of distinct pages drawn at random from the cache's ``num_blocks``."""
    pages = torch.randperm(num_blocks, device="cuda")[: batch * per_seq]
    return pages.view(batch, per_seq).to(torch.int32)


def _kvcache(batch: int, seqlen_q: int, block_size: int, capacity: int = 4096):
    """``(q, k_cache, v_cache, cache_seqlens, block_table)``: Llama-style GQA, bf16, D = 128."""
    heads, kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16
    q = torch.randn(batch, heads, seqlen_q, head_dim, device="cuda", dtype=dtype)
    lens = torch.full((batch,), capacity, dtype=torch.int32, device="cuda")
    if not block_size:
        shape = (batch, kv_heads, capacity, head_dim)
        table = None
    else:
        per_seq = capacity // block_size
        shape = (batch * per_seq + 3, kv_heads, block_size, head_dim)  # 3 pages owned by nobody
        table = _pages(batch, per_seq, shape[0])
    k_cache, v_cache = (torch.randn(shape, device="cuda", dtype=dtype) for _ in "kv")
    return q, k_cache, v_cache, lens, table


def _new_lengths(lens: torch.Tensor, capacity: int, step: int) -> None:
    """Random lengths in place; the first sequence's is the capacity, 0 or 1 by turns."""
    new = torch.randint(0, capacity + 1, lens.shape, dtype=torch.int32, device="cuda")
    new[0] = (capacity, 0, 1)[step % 3]
    lens.copy_(new)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen_q", [1, 4, 1024], ids=["decode", "chunk4", "chunk1024"])
@pytest.mark.parametrize("block_size", [0, 16, 256], ids=["dense", "paged16", "paged256"])
@pytest.mark.parametrize("batch", [1, 8])
def test_kvcache_graph(batch, block_size, seqlen_q):
    capacity = 4096
    q, k_cache, v_cache, lens, table = _kvcache(batch, seqlen_q, block_size, capacity)

    def call():
        return flashcore.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, block_table=table, return_lse=True
        )

    graph, static = capture(call)
    for step in range(REPLAYS):
        refill(q)
        _new_lengths(lens, capacity, step)
        if table is not None:
            table.copy_(_pages(batch, table.shape[1], k_cache.shape[0]))
        graph.replay()
        with no_sync():
            want = call()
        assert_equal(("out", "lse"), static, want)


@pytest.mark.gpu
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwdbwd"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", VARLEN_GPU, ids=[c.id for c in VARLEN_GPU])
def test_varlen_graph(case, causal, backward, monkeypatch):
    # New cu_seqlens between replays: the same sequences in another order, so the totals and
    # the maxima (Python ints, fixed in the graph) stay the same. With the Hopper backward
    # ("auto" takes it for these lengths on an H100) dq is checked per sequence against the
    # float64 reference (its reduce-adds' order varies), dk and dv exactly.
    tiers = record_backward_tiers(monkeypatch)
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    leaves = tuple(t.requires_grad_(backward) for t in (q, k, v))
    maxima = max(case.seqlens_q), max(case.seqlens_k)
    dout = torch.randn(q.shape[0], case.heads, case.head_dim, device="cuda", dtype=q.dtype)
    dlse = torch.randn(case.heads, q.shape[0], device="cuda")

    def call():
        out, lse = flashcore.attention_varlen(
            *leaves, cu_q, cu_k, *maxima, causal=causal, return_lse=True
        )
        if not backward:
            return out, lse
        return out, lse, *torch.autograd.grad((out, lse), leaves, (dout, dlse))

    graph, static = capture(call)
    exact = not backward or tiers[-1] == "portable"
    gen = torch.Generator().manual_seed(0)
    for _ in range(REPLAYS):
        order = torch.randperm(len(case.seqlens_q), generator=gen).tolist()
        cu_q.copy_(cu_seqlens(tuple(case.seqlens_q[i] for i in order), "cuda"))
        cu_k.copy_(cu_seqlens(tuple(case.seqlens_k[i] for i in order), "cuda"))
        refill(*leaves, dout, dlse)
        graph.replay()
        with no_sync():
            want = call()
        if exact:
            assert_equal(("out", "lse", "dq", "dk", "dv"), static, want)
            continue
        assert_equal(("out", "lse", "dk", "dv"), static[:2] + static[3:], want[:2] + want[3:])
        _assert_varlen_dq(static[2], leaves, cu_q, cu_k, causal, dout, dlse)


def _assert_varlen_dq(dq, leaves, cu_q, cu_k, causal, dout, dlse) -> None:
    """A packed batch's dq against the per-sequence reference with FlashAttention's rule."""

    def grad(dtype):
        xs = [t.detach().to(dtype).requires_grad_() for t in leaves]
        ref = reference.attention_varlen(*xs, cu_q, cu_k, causal=causal, dtype=dtype)
        return torch.autograd.grad((ref.out, ref.lse), xs[0], (dout.to(dtype), dlse.to(dtype)))[0]

    assert_fa_rule("dq", dq, grad(leaves[0].dtype), grad(torch.float64))


@pytest.fixture
def _fresh_dynamo():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield counters
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reduce_overhead(causal, _fresh_dynamo, monkeypatch):
    # A block as a model holds its tensors, (B, S, H, D), forward and backward under CUDA graph
    # trees: the first step warms up, the second records, the others replay. dq exact unless the
    # eager call took the Hopper backward (non-causal on an H100), then by FlashAttention's rule.
    tiers = record_backward_tiers(monkeypatch)

    def block(q, k, v):
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return flashcore.attention(q, k, v, causal=causal).transpose(1, 2).flatten(2)

    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    case = CASES[0]
    for _ in range(REPLAYS + 2):
        inputs = [
            t.transpose(1, 2).detach().requires_grad_()
            for t in make_qkv(case, torch.bfloat16, "cuda", layout="bshd")
        ]
        dout = torch.randn(case.batch, case.seqlen_q, case.heads * case.head_dim, device="cuda")
        dout = dout.to(torch.bfloat16)
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(*inputs)
        grads = torch.autograd.grad(out, inputs, dout)
        # Graph outputs live in the graph's memory, overwritten by the next replay: copy them.
        out, grads = out.clone(), [g.clone() for g in grads]
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        with no_sync():
            want = block(*leaves)
            want_grads = torch.autograd.grad(want, leaves, dout)
        assert_equal(("out",), out, want)
        assert_equal(("dk", "dv"), grads[1:], want_grads[1:])
        # check_grads takes (B, H, S, D); the block's tensors are (B, S, H, D).
        bhsd = [t.transpose(1, 2) for t in (*grads[:1], *want_grads[:1], *inputs)]
        dout_bhsd = dout.view(*out.shape[:2], case.heads, case.head_dim).transpose(1, 2)
        assert_dq(tiers[-1] == "portable", *bhsd, dout_bhsd, causal=causal)
    # Inductor counts every graph it runs without CUDA graphs (a CPU tensor, a sync, a mutation).
    assert _fresh_dynamo["inductor"]["cudagraph_skips"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [0, 256], ids=["dense", "paged256"])
def test_reduce_overhead_kvcache(block_size, _fresh_dynamo):
    capacity = 4096
    q, k_cache, v_cache, lens, table = _kvcache(4, 1, block_size, capacity)

    def decode(q, k_cache, v_cache, lens, table):
        return flashcore.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, block_table=table, return_lse=True
        )

    compiled = torch.compile(decode, mode="reduce-overhead", fullgraph=True)
    for step in range(REPLAYS + 2):
        refill(q)
        _new_lengths(lens, capacity, step)
        if table is not None:
            table.copy_(_pages(4, table.shape[1], k_cache.shape[0]))
        torch.compiler.cudagraph_mark_step_begin()
        got = [t.clone() for t in compiled(q, k_cache, v_cache, lens, table)]
        with no_sync():
            want = decode(q, k_cache, v_cache, lens, table)
        assert_equal(("out", "lse"), got, want)
    assert _fresh_dynamo["inductor"]["cudagraph_skips"] == 0


@pytest.mark.gpu
def test_checked_mode_refuses_capture():
    case = VARLEN_GPU[1]
    q, k, v, cu_q, cu_k = make_varlen(case, torch.bfloat16, "cuda")
    maxima = max(case.seqlens_q), max(case.seqlens_k)

    def call():
        return flashcore.attention_varlen(q, k, v, cu_q, cu_k, *maxima, causal=True)

    call()
    torch.cuda.synchronize()
    refused = pytest.raises(RuntimeError, match=r"checked\(\) reads the offsets")
    with flashcore.checked(), refused, torch.cuda.graph(torch.cuda.CUDAGraph()):
        call()
    qd, k_cache, v_cache, lens, table = _kvcache(2, 1, 256)
    refused = pytest.raises(RuntimeError, match=r"checked\(\) reads the offsets")
    with flashcore.checked(), refused, torch.cuda.graph(torch.cuda.CUDAGraph()):
        flashcore.attention_with_kvcache(
            qd, k_cache, v_cache, cache_seqlens=lens, block_table=table
        )
    # The refusal came before any work was captured: the unchecked call still captures.
    graph, static = capture(call)
    graph.replay()
    assert torch.equal(static, call())


def test_checked_mode_in_capture_message(monkeypatch):
    # CPU unit test of the refusal (the GPU test above raises it from a real capture).
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    on_gpu = types.SimpleNamespace(is_cuda=True)
    assert not api._checked_mode(on_gpu)  # checked mode off: capturable, nothing read back
    with flashcore.checked():
        with pytest.raises(RuntimeError, match=r"^flashcore\.checked\(\) reads the offsets"):
            api._checked_mode(on_gpu)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        assert api._checked_mode(on_gpu)


def test_first_launch_in_capture_message(monkeypatch):
    # CPU unit test of the launcher's miss path with a stand-in for a compiled-mode JITFunction
    # whose launch fails as Triton's does when it loads a module during a capture.
    failure = RuntimeError("Triton Error [CUDA]: operation not permitted when stream is capturing")

    class Kernel:
        __name__ = "attn_fwd_kernel"
        device_caches = types.MappingProxyType({})  # what marks a compiled-mode JITFunction
        arg_names = ("x", "BLOCK")

        def __getitem__(self, grid):
            def run(*args, **meta):
                raise failure

            return run

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launcher = launch.Launcher(Kernel(), num_pointers=0)
    assert not launcher.interpreted
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="attn_fwd_kernel was launched with sizes") as info:
        launcher((1,), (7,), {"BLOCK": 16})
    assert info.value.__cause__ is failure
    assert "once eagerly before capturing" in str(info.value)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(RuntimeError) as info:
        launcher((1,), (7,), {"BLOCK": 16})
    assert info.value is failure


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_graph_sm90_forward(causal, monkeypatch):
    # The Gluon forward (the default at D=128 from 1024 tokens on an H100) through its Launcher,
    # with the backward, captured and replayed on new inputs. Forward and dk, dv exact; dq by
    # FlashAttention's rule where the Hopper backward reduce-adds it.

    require_sm90()
    forwards = record_sm90_forwards(monkeypatch)
    tiers = record_backward_tiers(monkeypatch)
    # 1.4e11 FLOPs (6.9e10 causal): above tuning.SM90_FWD_MIN_FLOPS, so "auto" takes the tier.
    case = Case(4, 16, 4, 2048, 2048, 128)
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.bfloat16, "cuda"))
    dout = torch.randn_like(q)

    def call():
        out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
        return out, lse, *torch.autograd.grad(out, (q, k, v), dout)

    graph, static = capture(call)
    assert forwards, "the Gluon forward did not run"
    exact = tiers[-1] == "portable"
    for _ in range(REPLAYS):
        refill(q, k, v, dout)
        graph.replay()
        with no_sync():
            want = call()
        assert_equal(("out", "lse"), static[:2], want[:2])
        assert_equal(("dk", "dv"), static[3:], want[3:])
        assert_dq(exact, static[2], want[2], q, k, v, dout, causal=causal)


def _gluon_forwards_at_the_real_floors(monkeypatch) -> list:
    """For the tests of the capture's own choice: skip without the sm90 tier, undo the module
    fixture (the real floors, tier choices made afresh), and return a list that gains an entry
    per Gluon forward launch."""
    from flashcore.ops import fwd

    require_sm90()
    monkeypatch.undo()
    monkeypatch.setattr(fwd, "_SM90_PLANS", {})
    forwards = record_sm90_forwards(monkeypatch)
    return forwards


def _misses_in_capture(monkeypatch) -> list:
    """A list that gains a kernel's name for each launch-cache miss (``launch.Launcher.miss``:
    a first launch, which may compile and load) made while the stream is being captured."""
    misses = []
    real = launch.Launcher.miss

    def miss(self, *args):
        if torch.cuda.is_current_stream_capturing():
            misses.append(getattr(self.fn, "__name__", str(self.fn)))
        return real(self, *args)

    monkeypatch.setattr(launch.Launcher, "miss", miss)
    return misses


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_capture_takes_sm90_forward_below_the_eager_floor(causal, monkeypatch):
    # (2, 8, 2048, 64): 1.7e10 FLOPs (8.6e9 causal), under tuning.SM90_FWD_MIN_FLOPS, so an eager
    # call takes the portable forward (cheaper on the host); a captured one takes the Gluon
    # forward (faster on the GPU; SM90_FWD_MIN_FLOPS_GRAPH) once a call that chose as a capture
    # does has loaded it (runtime.in_capture). Until then the capture launches what its warm-up
    # did, and neither capture loads anything. A replay equals an eager call on the same tier
    # bit for bit.
    forwards = _gluon_forwards_at_the_real_floors(monkeypatch)
    misses = _misses_in_capture(monkeypatch)
    q, k, v = make_qkv(Case(2, 8, 8, 2048, 2048, 64), torch.bfloat16, "cuda")

    def call():
        return flashcore.attention(q, k, v, causal=causal, return_lse=True)

    call()
    assert not forwards, "an eager call of this size took the Gluon forward"
    for tier in ("portable", "sm90"):
        if tier == "sm90":
            with runtime.as_captured():  # as flashcore.warmup(..., graphs=True) runs it
                call()
            assert forwards, "a call made as captured did not take the Gluon forward"
        forwards.clear()
        graph, static = capture(call)
        assert bool(forwards) == (tier == "sm90"), tier
        assert not misses, f"the capture loaded {misses}"
        for _ in range(REPLAYS):
            refill(q, k, v)
            graph.replay()
            with no_sync(), flashcore.use_tier(tier):
                want = call()
            assert_equal(("out", "lse"), static, want)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_capture_takes_sm90_backward_below_the_eager_floor(causal, monkeypatch):
    # (2, 8, 2048, 64): 1.7e10 FLOPs (8.6e9 causal), under tuning.SM90_BWD_MIN_FLOPS, so an
    # eager backward takes the portable kernels (half the Hopper backward's host cost); a
    # captured one the Hopper backward (faster on the GPU; SM90_BWD_MIN_FLOPS_GRAPH) once a call
    # made as captured has loaded it, and until then what its warm-up ran. dk and dv of a replay
    # equal an eager call's on the same tier bit for bit; the Hopper dq (reduce-added in
    # whatever order the key blocks finish) by FlashAttention's rule.
    from flashcore.ops import bwd

    require_sm90()
    monkeypatch.undo()
    monkeypatch.setattr(bwd, "_SM90", {})
    tiers = record_backward_tiers(monkeypatch)
    misses = _misses_in_capture(monkeypatch)
    q, k, v = (
        t.requires_grad_() for t in make_qkv(Case(2, 8, 8, 2048, 2048, 64), torch.bfloat16, "cuda")
    )
    dout = torch.randn_like(q)

    def call():
        out = flashcore.attention(q, k, v, causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)

    call()
    assert tiers == ["portable"], tiers
    for tier in ("portable", "sm90"):
        if tier == "sm90":
            with runtime.as_captured():  # as flashcore.warmup(..., graphs=True) runs it
                call()
            assert tiers[-1] == "sm90", tiers
        graph, static = capture(call)
        assert tiers[-1] == tier, tiers
        assert not misses, f"the capture loaded {misses}"
        for _ in range(REPLAYS):
            refill(q, k, v, dout)
            graph.replay()
            with no_sync(), flashcore.use_tier(tier):
                want = call()
            assert_equal(("dk", "dv"), static[1:], want[1:])
            assert_dq(tier == "portable", static[0], want[0], q, k, v, dout, causal=causal)


@pytest.mark.gpu
def test_reduce_overhead_takes_sm90_forward_below_the_eager_floor(_fresh_dynamo, monkeypatch):
    # The same choice under torch.compile's CUDA graph trees: the warm-up step runs eagerly (the
    # portable forward at this size), the recording step captures the Gluon forward, which
    # flashcore.warmup(graphs=True) loaded beforehand, and the replays run it; nothing is loaded
    # inside the capture. Forward only; each replay against an eager call on that tier.
    forwards = _gluon_forwards_at_the_real_floors(monkeypatch)
    sizes = dict(head_dims=(64,), heads=(8, 8), seqlens=(2048,), batch_sizes=(2,))
    flashcore.warmup("cuda", dtypes=(torch.bfloat16,), **sizes, graphs=True)
    forwards.clear()
    misses = _misses_in_capture(monkeypatch)

    def block(q, k, v):
        return flashcore.attention(q, k, v, causal=True)

    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    q, k, v = make_qkv(Case(2, 8, 8, 2048, 2048, 64), torch.bfloat16, "cuda")
    for step in range(REPLAYS + 2):
        refill(q, k, v)
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(q, k, v).clone()
        assert bool(forwards) == (step > 0), (step, len(forwards))
        with no_sync(), flashcore.use_tier("sm90" if step > 0 else "auto"):
            want = block(q, k, v)
        assert_equal(("out",), out, want)
    assert not misses, f"the capture loaded {misses}"
    assert _fresh_dynamo["inductor"]["cudagraph_skips"] == 0
