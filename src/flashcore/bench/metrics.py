"""FLOP counts, timing and the matmul ceiling.

FLOPs follow the FlashAttention papers so that TFLOP/s compare with theirs: the forward is the two
matmuls, ``4 * B * H * Sq * Sk * D``, halved for causal; the backward counts 2.5x the forward (five
matmuls instead of two), forward+backward 3.5x. Softmax work is not counted. For causal with
Sq != Sk, where "halved" has no meaning (Sq = 1 sees every key), the exact number of visible
(query, key) pairs replaces ``Sq * Sk / 2``. A varlen case counts its real tokens only: the sum
over sequences of the same count (``4 * H * S_b * S_b * D``, halved for causal), never the padding.
A local window (``--window``) counts the pairs it leaves visible, row by row, in place of either.
With a value head dim Dv != D each matmul counts its own inner or outer dim, ``2 * pairs * D`` for
the products with q or k (QK^T; backward: QK^T again, dS K, dS^T Q) and ``2 * pairs * Dv`` for
those with v or dout (PV; backward: dout V^T, P^T dout): forward ``2 * pairs * (D + Dv)``,
backward ``2 * pairs * (3 D + 2 Dv)``, which are the factors above when Dv = D. (FlashAttention-3's
benchmark scales its forward ``2 * pairs * (D + Dv)`` by 2.5 for the backward: 4% less than this
count at D=192, Dv=128.)

Bytes are the least traffic a forward must move: q and out once, K and V once per kv head
(``elem * (B * H * Sq * (D + Dv) + B * Hkv * Sk * (D + Dv))``; varlen: of the real tokens).
Decoding is bound by them, not by FLOPs, so each row also reports GB/s and its share of the
device-to-device copy bandwidth measured in the same run (``torch.Tensor.copy_`` of 1 GiB,
counted as read plus write).

Timing on a GPU is ``triton.testing.do_bench`` (L2 flushed between calls, CUDA events), reported as
the 20th, 50th and 80th percentiles in milliseconds. Its flush (a memset of the L2's size before
each call) also gives the host a head start on every call, so do_bench hides up to that much host
cost per call. ``time_graph`` (``--cuda-graph``) shows it instead: the same ``calls`` back-to-back
calls timed eagerly (the pace of whichever is slower, host or GPU) and replayed from one CUDA graph
(the GPU's pace with no host in between), neither flushing L2; the difference of the medians is
the host's cost per call beyond the GPU's. Under Triton's interpreter nothing runs on a
GPU and do_bench cannot time; there the wall time of a few calls (``time.perf_counter``) is kept
only to show how long the interpreter took, labelled ``interpreter-wall``, and never turned into
TFLOP/s.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from flashcore.bench.cases import Case
from flashcore.ops import runtime

MATMULS = {"fwd": (1, 1), "bwd": (3, 2), "fwdbwd": (4, 3)}
"""Per mode, the matmuls over D (with q or k) and over Dv (with v or dout); see the docstring."""
QUANTILES = (0.2, 0.5, 0.8)
TIMER_GPU = "do_bench"
TIMER_INTERPRETER = "interpreter-wall"
TIMER_LOOP = "eager-loop"
TIMER_GRAPH = "cuda-graph"
GRAPH_CALLS = 20
GRAPH_REPEATS = 10
GRAPH_WARMUP = 3
PEAK_N = 8192
COPY_BYTES = 1 << 30


def visible_pairs(
    seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int] | None = None
) -> float:
    """(query, key) pairs the FLOP rule counts; see the module docstring. With a window, those
    it leaves visible (``cases`` module docstring), counted row by row."""
    if window is None and not causal:
        return float(seqlen_q * seqlen_k)
    if window is None and seqlen_q == seqlen_k:
        return seqlen_q * seqlen_k / 2
    # Bottom-right: query i sees keys i + d - left to i + d + right (d = Sk - Sq; -1 unbounded;
    # right 0 when causal), clipped to [0, Sk).
    diag = seqlen_k - seqlen_q
    left, right = window or (-1, -1)
    right = 0 if causal else right
    total = 0
    for i in range(seqlen_q):
        lo = 0 if left < 0 else max(0, i + diag - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, i + diag + right)
        total += max(0, hi - lo + 1)
    return float(total)


def attention_flops(case: Case, mode: str) -> float:
    s = case.shape
    if case.seqlens is None:
        pairs = s.batch * visible_pairs(s.seqlen_q, s.seqlen_k, case.causal, case.window)
    else:
        pairs = sum(visible_pairs(n, n, case.causal, case.window) for n in case.seqlens)
    over_d, over_dv = MATMULS[mode]
    return 2 * s.heads * pairs * (over_d * s.head_dim + over_dv * s.value_dim)


def tflops(flops: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else flops / ms / 1e9


def attention_bytes(case: Case, elem_size: int) -> float:
    """Least bytes a forward moves (fwd only): q, out, and K, V once; see the module docstring."""
    s = case.shape
    if case.seqlens is None:
        rows = s.batch * s.heads * s.seqlen_q + s.batch * s.kv_heads * s.seqlen_k
    else:
        rows = sum(case.seqlens) * (s.heads + s.kv_heads)
    return float(elem_size * rows * (s.head_dim + s.value_dim))


def gbps(nbytes: float, ms: float | None) -> float | None:
    return None if ms is None or ms <= 0 else nbytes / ms / 1e6


class Timing(NamedTuple):
    p20: float
    p50: float
    p80: float
    timer: str


def time_gpu(
    fn: Callable[[], object],
    *,
    warmup: int,
    rep: int,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> Timing:
    """do_bench quantiles (ms) of ``fn`` on the current CUDA device."""
    from triton.testing import do_bench

    p20, p50, p80 = do_bench(
        fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=list(QUANTILES)
    )
    return Timing(p20, p50, p80, TIMER_GPU)


class GraphTiming(NamedTuple):
    """``time_graph``'s result: milliseconds per call, eager and from a CUDA graph."""

    loop: Timing
    """``calls`` back-to-back eager calls, per call: the host's pace or the GPU's, the slower."""
    graph: Timing
    """The same calls captured in one CUDA graph and replayed, per call: the GPU's pace."""
    calls: int

    @property
    def host_ms(self) -> float:
        """What the host adds per call beyond the GPU's time: loop minus graph medians (about 0,
        within the spread, when the GPU sets the pace)."""
        return self.loop.p50 - self.graph.p50


def _quantiles(times: Sequence[float], timer: str) -> Timing:
    if len(times) == 1:
        return Timing(times[0], times[0], times[0], timer)
    p20, _, _, p80 = statistics.quantiles(times, n=5, method="inclusive")
    return Timing(p20, statistics.median(times), p80, timer)


def _per_call_ms(run: Callable[[], object], calls: int, repeats: int) -> list[float]:
    """CUDA-event time of ``run()`` (``calls`` calls), ``repeats`` times back to back, per call."""
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for start, end in events:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / calls for start, end in events]


def time_graph(
    make_fn: Callable[[], Callable[[], object]],
    *,
    calls: int = GRAPH_CALLS,
    repeats: int = GRAPH_REPEATS,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> GraphTiming:
    """Per-call time of ``calls`` back-to-back calls of ``fn = make_fn()``, eagerly and replayed
    from one CUDA graph holding the same calls, ``repeats`` times each (quantiles over the
    repeats).

    Runs on a side stream, as a capture must, and ``make_fn`` runs there too: autograd runs each
    backward op on the stream of its forward, so a backward timed alone needs its forward made on
    the capturing stream. Then ``GRAPH_WARMUP`` eager calls (every kernel variant compiled and
    loaded, the allocator primed), the eager loops, one call choosing as a capture does
    (``runtime.as_captured``: FlashCore's capture variants loaded, as ``flashcore.warmup(...,
    graphs=True)`` does), the capture and its replays.
    ``grad_to_none`` are reset before every call, inside the graph too (each captured backward
    then writes fresh gradients instead of accumulating).
    """

    def loop(fn: Callable[[], object], n: int = calls) -> None:
        for _ in range(n):
            for t in grad_to_none or ():
                t.grad = None
            fn()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn = make_fn()
        loop(fn, GRAPH_WARMUP)
        eager = _per_call_ms(functools.partial(loop, fn), calls, repeats)
        # One more call choosing as a capture does (flashcore.warmup(..., graphs=True)): a
        # capture takes its own variants only where they were loaded (runtime.in_capture).
        with runtime.as_captured():
            loop(fn, 1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            loop(fn)
        replayed = _per_call_ms(graph.replay, calls, repeats)
    torch.cuda.current_stream().wait_stream(stream)
    return GraphTiming(_quantiles(eager, TIMER_LOOP), _quantiles(replayed, TIMER_GRAPH), calls)


def time_interpreter(
    fn: Callable[[], object], *, reps: int, grad_to_none: Sequence[torch.Tensor] | None = None
) -> Timing:
    """Wall time (ms) of ``reps`` CPU calls: how long the interpreter took, NOT performance."""
    times = []
    for _ in range(reps):
        for t in grad_to_none or ():
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return _quantiles(times, TIMER_INTERPRETER)


def peak_matmul_tflops(*, warmup: int, rep: int) -> float:
    """The bf16 matmul rate this GPU reaches in this run: cuBLAS ``8192^3`` via torch.matmul."""
    a = torch.randn(PEAK_N, PEAK_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(PEAK_N, PEAK_N, device="cuda", dtype=torch.bfloat16)
    timing = time_gpu(lambda: torch.matmul(a, b), warmup=warmup, rep=rep)
    return 2 * PEAK_N**3 / timing.p50 / 1e9


def peak_copy_gbps(*, warmup: int, rep: int) -> float:
    """Device-to-device copy bandwidth this GPU reaches in this run (read + write bytes)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    timing = time_gpu(lambda: dst.copy_(src), warmup=warmup, rep=rep)
    return 2 * COPY_BYTES / timing.p50 / 1e6
