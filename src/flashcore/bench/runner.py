"""One measurement: prepare a provider, check it against the reference, then time it.

Modes (what is timed):
- ``fwd``: ``fn(q, k, v)`` on inputs that do not require grad.
- ``bwd``: the backward alone, ``out.backward(do, retain_graph=True)`` on one retained forward graph
  (FlashAttention's benchmarks do the same), gradients reset to None between calls.
- ``fwdbwd``: a fresh forward and its backward per call.

Backward goes through torch autograd only, so any differentiable provider works; one that cannot
differentiate (no autograd formula registered) is "refused" with PyTorch's message.

Varlen cases: a packed provider gets the packed tokens, every other provider the zero-padded batch
(``Inputs.tensors``); the reference is on the packed tokens, and a padded provider's results are
checked on the real tokens only (``Inputs.checked``).

With ``Settings.cuda_graph`` each measurement is also timed by ``metrics.time_graph``: the same
calls back to back, eagerly and replayed from a CUDA graph (``bwd`` makes its retained forward on
the capturing stream). A provider whose calls cannot be captured keeps its other numbers; the
reason goes into ``Measurement.graph_reason``.

A provider with sinks (``Provider.sinks``) gets ``Inputs.sinks`` as a fourth argument (a leaf
that requires grad in the backward modes, reset with the others) and is checked against
``Inputs.reference(provider)``, the reference with those sinks.

Every measurement is checked before it is timed: ``out`` for fwd, ``out`` and ``dq, dk, dv`` (and
``dsinks``) for the backward modes. A provider outside FlashAttention's error rule is still timed
and its status is "wrong". Only calls into the provider are guarded: an exception there makes the
row "refused" (the stage and message are kept); a bug in the benchmark itself still stops the run.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashcore.bench import check, metrics
from flashcore.bench.cases import Case
from flashcore.bench.providers import Provider, pack, unpack

MODES = ("fwd", "bwd", "fwdbwd")


@dataclass(frozen=True)
class Settings:
    device: torch.device
    on_gpu: bool
    warmup: int = 25
    rep: int = 100
    interpreter_reps: int = 1
    ref_budget_bytes: int = 1 << 30
    cuda_graph: bool = False
    graph_calls: int = metrics.GRAPH_CALLS

    @property
    def ref_dtype(self) -> torch.dtype:
        return torch.float32 if self.on_gpu else torch.float64


@dataclass
class Measurement:
    provider: str
    case: Case
    dtype: torch.dtype
    mode: str
    status: str
    """"ok", "wrong" (outside the error rule; still timed) or "refused" (raised)."""
    reason: str | None = None
    timing: metrics.Timing | None = None
    errors: dict[str, check.TensorError] | None = None
    warnings: tuple[str, ...] = ()
    graph: metrics.GraphTiming | None = None
    """Eager-loop and CUDA-graph times (``Settings.cuda_graph``), or None."""
    graph_reason: str | None = None
    """Why the CUDA-graph timing failed (the capture raised), or None."""

    @property
    def rel_err(self) -> float | None:
        return max(e.rel for e in self.errors.values()) if self.errors else None


class Inputs:
    """Random inputs of one (case, dtype), the same for every provider, and their reference.

    ``q, k, v, do`` are the ``(B, H, S, D)`` batch (v and do with Dv); for a varlen case,
    ``packed`` holds the real tokens ``(total, H, D)``, ``q, k, v, do`` are them zero-padded, and
    ``ref`` is packed. ``sinks`` are float32 ``(H,)`` drawn as ``ln(Sk) + N(0, 1)``: about the
    mass of all the keys of a row, so that the check sees them; their reference is computed at
    the first request (``reference``).
    """

    def __init__(self, case: Case, dtype: torch.dtype, modes: Sequence[str], settings: Settings):
        s = case.shape
        self.case = case
        gen = torch.Generator(device=settings.device).manual_seed(0)

        def randn(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(shape, generator=gen, dtype=dtype, device=settings.device)

        backward = any(m != "fwd" for m in modes)
        self._ref_options = {
            "causal": case.causal,
            "window": case.window,
            "ref_dtype": settings.ref_dtype,
            "budget_bytes": settings.ref_budget_bytes,
        }
        self._sinks_ref: check.Reference | None = None
        self.packed: tuple[torch.Tensor | None, ...] | None = None
        if case.seqlens is None:
            self.q = randn(s.batch, s.heads, s.seqlen_q, s.head_dim)
            self.k = randn(s.batch, s.kv_heads, s.seqlen_k, s.head_dim)
            self.v = randn(s.batch, s.kv_heads, s.seqlen_k, s.value_dim)
            self.do = randn(s.batch, s.heads, s.seqlen_q, s.value_dim) if backward else None
            self.ref = check.compute_reference(self.q, self.k, self.v, self.do, **self._ref_options)
        else:
            total = sum(case.seqlens)
            self.packed = (
                randn(total, s.heads, s.head_dim),
                randn(total, s.kv_heads, s.head_dim),
                randn(total, s.kv_heads, s.value_dim),
                randn(total, s.heads, s.value_dim) if backward else None,
            )
            # Zero padding, do included: padding rows then add nothing to the real rows' dk, dv.
            self.q, self.k, self.v, self.do = (
                None if t is None else unpack(t, case.seqlens, s.seqlen_q) for t in self.packed
            )
            self.ref = check.compute_reference_varlen(
                *self.packed, case.seqlens, **self._ref_options
            )
        self.sinks = randn(s.heads, dtype=torch.float32) + math.log(s.seqlen_k)

    def tensors(self, provider: Provider) -> tuple[torch.Tensor | None, ...]:
        """``q, k, v, do`` in the provider's layout."""
        if provider.packed and self.packed is not None:
            return self.packed
        return self.q, self.k, self.v, self.do

    def extras(self, provider: Provider) -> tuple[torch.Tensor, ...]:
        """The arguments after ``q, k, v``: ``(sinks,)`` for a provider with sinks, else none."""
        return (self.sinks,) if provider.sinks else ()

    def reference(self, provider: Provider) -> check.Reference:
        """The reference to check ``provider`` against: ``ref``, or the one with the sinks."""
        if not provider.sinks:
            return self.ref
        if self.packed is not None:
            raise ValueError("the reference with sinks is for dense cases only")
        if self._sinks_ref is None:
            self._sinks_ref = check.compute_reference(
                self.q, self.k, self.v, self.do, **self._ref_options, sinks=self.sinks
            )
        return self._sinks_ref

    def checked(self, x: torch.Tensor, provider: Provider) -> torch.Tensor:
        """A provider's result in the reference's layout: a padded batch loses its padding."""
        s = self.case.shape
        padded = x.dim() == 4 and (x.shape[0], x.shape[2]) == (s.batch, s.seqlen_q)
        if self.packed is None or provider.packed or not padded:
            return x  # (a wrong shape is reported by check.compare)
        return pack(x, self.case.seqlens)


def _sync(settings: Settings) -> None:
    if settings.on_gpu:
        torch.cuda.synchronize()


def _first_line(obj: object) -> str:
    lines = str(obj).strip().splitlines()
    return lines[0] if lines else ""


def _describe(stage: str, exc: BaseException) -> str:
    return f"{stage}: {type(exc).__name__}: {_first_line(exc)}"[:300]


def measure(
    provider: Provider, case: Case, mode: str, inputs: Inputs, settings: Settings
) -> Measurement:
    """Check, then time, one provider on one case in one mode. Never raises for the provider."""
    with warnings.catch_warnings(record=True) as caught, contextlib.ExitStack() as stack:
        warnings.simplefilter("always")
        try:
            stack.enter_context(provider.context())
        except Exception as e:  # e.g. a backend this torch does not have
            result = Measurement(
                provider.name, case, inputs.q.dtype, mode, "refused", _describe("backend", e)
            )
        else:
            result = _measure(provider, case, mode, inputs, settings)
    # Keep what providers say about themselves (SDPA explains refusals in UserWarnings); drop
    # library deprecation noise such as numpy's from Triton's interpreter.
    kept = [w for w in caught if not issubclass(w.category, DeprecationWarning | FutureWarning)]
    messages = tuple(dict.fromkeys(_first_line(w.message)[:200] for w in kept))
    result.warnings = messages
    if result.status == "refused" and messages:
        result.reason = f"{result.reason} [warnings: {'; '.join(messages[:3])}]"
    if result.status == "refused" and settings.on_gpu:
        torch.cuda.empty_cache()
    return result


def _measure(
    provider: Provider, case: Case, mode: str, inputs: Inputs, settings: Settings
) -> Measurement:
    def refuse(stage: str, exc: Exception, errors=None) -> Measurement:
        return Measurement(
            provider.name, case, inputs.q.dtype, mode, "refused", _describe(stage, exc),
            errors=errors,
        )  # fmt: skip

    try:
        fn = provider.prepare(case, settings.device)
    except Exception as e:
        return refuse("prepare", e)
    q, k, v, do = inputs.tensors(provider)
    extras = inputs.extras(provider)
    ref = inputs.reference(provider)

    if mode == "fwd":
        try:
            out = fn(q, k, v, *extras)
            _sync(settings)
        except Exception as e:
            return refuse("forward", e)
        errors = {"out": check.compare(inputs.checked(out, provider), ref.out, ref.pt_out)}
        del out

        def bench() -> object:
            return fn(q, k, v, *extras)

        def make_bench():
            return bench

        grad_to_none = None
    else:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *extras)]
        try:
            out = fn(*leaves)
            _sync(settings)
        except Exception as e:
            return refuse("forward", e)
        try:
            out.backward(do, retain_graph=mode == "bwd")
            _sync(settings)
        except Exception as e:
            return refuse("backward", e)
        errors = {"out": check.compare(inputs.checked(out, provider), ref.out, ref.pt_out)}
        names = (*check.GRAD_NAMES, check.SINKS_GRAD)[: len(leaves)]
        for name, leaf, r, pt in zip(names, leaves, ref.grads, ref.pt_grads, strict=True):
            grad = leaf.grad if leaf.grad is not None else torch.full_like(leaf, float("nan"))
            errors[name] = check.compare(inputs.checked(grad, provider), r, pt)
        for leaf in leaves:
            leaf.grad = None
        if mode == "bwd":
            retained = out
            del out

            def bench() -> object:
                return retained.backward(do, retain_graph=True)

            def make_bench():
                # A forward of its own on the calling (capturing) stream: see metrics.time_graph.
                # The retained graph goes first: while it lives, the leaves' gradient
                # accumulators stay on the stream it was made on, and the captured backward
                # would wait on that (uncaptured) stream, which voids the capture.
                nonlocal retained
                retained = None
                again = fn(*leaves)
                return lambda: again.backward(do, retain_graph=True)

        else:
            del out

            def bench() -> object:
                return fn(*leaves).backward(do)

            def make_bench():
                return bench

        grad_to_none = leaves

    try:
        if settings.on_gpu:
            timing = metrics.time_gpu(
                bench, warmup=settings.warmup, rep=settings.rep, grad_to_none=grad_to_none
            )
        else:
            timing = metrics.time_interpreter(
                bench, reps=settings.interpreter_reps, grad_to_none=grad_to_none
            )
    except Exception as e:
        return refuse("timing", e, errors)
    graph = graph_reason = None
    if settings.cuda_graph and settings.on_gpu:
        try:
            graph = metrics.time_graph(
                make_bench, calls=settings.graph_calls, grad_to_none=grad_to_none
            )
        except Exception as e:
            graph_reason = _describe("cuda graph", e)
    wrong = [f"{n}: err {e.err:.2e} > bound {e.bound:.2e}" for n, e in errors.items() if not e.ok]
    status, reason = ("wrong", "; ".join(wrong)) if wrong else ("ok", None)
    return Measurement(
        provider.name, case, q.dtype, mode, status, reason, timing, errors,
        graph=graph, graph_reason=graph_reason,
    )  # fmt: skip


def run_group(
    providers: Sequence[Provider], case: Case, mode: str, inputs: Inputs, settings: Settings
) -> list[Measurement]:
    """Every provider on one (case, dtype, mode), in order."""
    return [measure(provider, case, mode, inputs, settings) for provider in providers]
