"""What the process runs on: kernel modules, Triton's interpreter, the device's capabilities.

Importing flashcore does not import triton: the kernel modules are imported at the first launch
(``kernel``), so ``TRITON_INTERPRET=1`` may be set any time before triton is first imported
(triton reads it when its own modules are defined). Every answer here is fixed for the process
once it is given, and cached.

The first launch of each compiled kernel variant (a specialisation new to the process) is logged
at INFO on the ``flashcore`` logger, one line with the kernel, device, constexprs and the time it
took, and kept in ``compile_events()``. Nothing is compiled, or logged, under the interpreter.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from flashcore.ops.launch import Launcher

log = logging.getLogger(__name__)


class CompileEvent(NamedTuple):
    """The first launch of a kernel variant in this process."""

    kernel: str
    device: str
    variant: str
    """The constexprs and launch options: ``NAME=value``, a flag's name alone when on (flags
    that are off are left out)."""
    seconds: float
    """Wall time of that launch: Triton's compile, or its load from Triton's on-disk cache when
    an earlier process compiled the same variant."""


_events: list[CompileEvent] = []


def compile_events() -> list[CompileEvent]:
    """Every kernel variant compiled (or loaded from Triton's cache) so far, oldest first."""
    return list(_events)


def _describe(meta: dict[str, Any]) -> str:
    parts = []
    for name, value in meta.items():
        if value is True:
            parts.append(name)
        elif value is not False and value is not None:
            parts.append(f"{name}={value}")
    return " ".join(parts)


class LoggingLauncher(Launcher):
    """A ``Launcher`` that logs the first launch of each compiled kernel it has not seen.

    A miss of the launch cache (``Launcher.miss``) runs Triton's own launch, which compiles only
    when Triton has no kernel for the specialisation: the kernel object it returned tells the two
    apart. Hits are not touched (the timing wraps the miss only).
    """

    def __init__(self, fn: Any, num_pointers: int) -> None:
        super().__init__(fn, num_pointers)
        self.seen: set[int] = set()

    def miss(self, key: tuple, grid: tuple[int, ...], args: tuple, meta: dict[str, Any]) -> Any:
        start = time.perf_counter()
        compiled = super().miss(key, grid, args, meta)
        self._new_entry(compiled, time.perf_counter() - start, meta)
        return compiled

    def _new_entry(self, compiled: Any, seconds: float, meta: dict[str, Any]) -> None:
        if id(compiled) in self.seen:
            return  # a specialisation Triton already had, reached with other scalar values
        self.seen.add(id(compiled))
        name = getattr(self.fn, "__name__", str(self.fn))
        event = CompileEvent(name, f"cuda:{torch.cuda.current_device()}", _describe(meta), seconds)
        _events.append(event)
        log.info(
            "compiled %s for %s in %.2f s (%s)",
            event.kernel, event.device, seconds, event.variant,
        )  # fmt: skip


@functools.cache
def kernel(module: str, name: str, num_pointers: int) -> Launcher:
    """The launcher (``ops.launch``) of kernel ``name`` of ``flashcore.kernels.<module>``, whose
    first ``num_pointers`` arguments are pointers; the module is imported (with triton) here.
    The first launch of each compiled variant is logged (``LoggingLauncher``)."""
    fn = getattr(importlib.import_module(f"flashcore.kernels.{module}"), name)
    return LoggingLauncher(fn, num_pointers)


@functools.cache
def is_interpreted() -> bool:
    """True when the kernels are defined under Triton's interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel("fwd", "attn_fwd_kernel", 8).fn, InterpretedFunction)


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device``; (0, 0) for the CPU (the interpreter)."""
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def has_tma(device: torch.device) -> bool:
    """Tensor descriptors need the bulk-copy engine of Hopper (sm_90) or newer."""
    return capability(device)[0] >= 9


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# launch_on's context where the device is already right (reusable: it holds no state).
_ON_DEVICE = contextlib.nullcontext()


def launch_on(t: torch.Tensor) -> Any:
    """Triton launches on the current CUDA device, not on the tensors': make it ``t``'s (a no-op
    context on the CPU, and where ``t`` is on the current device already: the usual case, in
    which ``torch.cuda.device_of``'s guard would set the device it has, a few microseconds of
    Python a launcher call)."""
    if not t.is_cuda or t.get_device() == torch.cuda.current_device():
        return _ON_DEVICE
    return torch.cuda.device_of(t)


# Set by ``as_captured``: calls choose their kernels as a capture would (``flashcore.warmup``).
_as_captured: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "flashcore_as_captured", default=False
)


def capturing(t: torch.Tensor) -> bool:
    """Whether a launch for ``t`` is being captured into a CUDA graph (on the current stream),
    where the host's cost of a call is paid once, not at every replay; or runs under
    ``as_captured``."""
    return t.is_cuda and (_as_captured.get() or torch.cuda.is_current_stream_capturing())


def transform_active(kind: str) -> bool:
    """Whether a ``torch.func`` transform of ``kind`` (a ``TransformType`` name: ``"Jvp"``,
    ``"Functionalize"``, ...) is in effect."""
    if not torch._C._are_functorch_transforms_active():
        return False
    key = getattr(torch._C._functorch.TransformType, kind)
    return any(i.key() == key for i in torch._C._functorch.get_interpreter_stack() or ())


def in_capture(t: torch.Tensor) -> bool:
    """Whether a launch for ``t`` is being captured into a CUDA graph now (not ``as_captured``).

    A capture takes the variants a capture chooses (``capturing``) only where this process has
    launched them before (``flashcore.warmup(..., graphs=True)``, an earlier capture); otherwise
    it takes those of the same call made eagerly, which the capture's warm-up loaded. Loading a
    kernel inside a capture can void it (on the H100 machine a Triton module loaded inside a
    ``make_graphed_callables`` capture did so in a process that had loaded many others, and not
    in a fresh one), so a warmed-up capture never loads one."""
    return t.is_cuda and not _as_captured.get() and torch.cuda.is_current_stream_capturing()


def warmed_key(plans: dict, key: tuple) -> tuple:
    """In a capture (``in_capture``): the plan key to launch, ``key`` being a launch plan's key
    whose last element is ``capturing``. ``key`` itself where its plan exists (plans are built at
    a signature's first launch, so its kernels are loaded), else the same call's eager key where
    that one's plan exists (the warm-up's kernels), else ``key`` (nothing of this signature ran:
    the capture loads what it chooses)."""
    if key in plans:
        return key
    eager = (*key[:-1], False)
    return eager if eager in plans else key


@contextlib.contextmanager
def as_captured() -> Iterator[None]:
    """Within the block, CUDA calls choose their tiers and launch variants as if they were being
    captured into a CUDA graph (``capturing``), and run eagerly: ``flashcore.warmup(...,
    graphs=True)`` compiles and loads so the variants that a capture of the same calls takes.
    Scoped to the current thread or task; the autograd engine's device threads would not see the
    block, so within it backwards run on the calling thread (autograd multithreading off)."""
    token = _as_captured.set(True)
    try:
        with torch.autograd.set_multithreading_enabled(False):
            yield
    finally:
        _as_captured.reset(token)


# Kernel tiers: "portable" (the tl kernels, every device and the interpreter) and "sm90" (the
# Gluon kernels of kernels/hopper, Hopper only). "auto" is the default choice.
TIERS = ("auto", "portable", "sm90")
# The Triton versions whose Gluon API the sm90 tier was verified on with a GPU: 3.6.0 (H100,
# H200), 3.7.0, 3.7.1, 3.8.0 and 3.9.0 (H200: the tier's GPU tests, scripts/gpu_other_triton.sh
# with SM90_GATE=1, and with 3.7 DIRECT_GATE=1 for its direct launches; docs/maintainers.md,
# "Other Tritons").
SM90_TRITON = ("3.6.", "3.7.", "3.8.", "3.9.")
_tier: contextvars.ContextVar[str] = contextvars.ContextVar("flashcore_tier", default="auto")


@contextlib.contextmanager
def use_tier(name: str) -> Iterator[None]:
    """Within the block, forwards run on tier ``name`` (see ``forward_tier``); scoped to the
    current thread or task, never global."""
    if name not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {name!r}")
    token = _tier.set(name)
    try:
        yield
    finally:
        _tier.reset(token)


@functools.cache
def sm90_verified() -> bool:
    """Whether this Triton is one the sm90 tier was verified on (and has Gluon at all)."""
    import triton

    if not triton.__version__.startswith(SM90_TRITON):
        return False
    try:
        import triton.experimental.gluon
    except ImportError:
        return False
    return True


def backward_tier(device: torch.device) -> str:
    """The tier a backward on ``device`` may run: "sm90" under ``use_tier("sm90")`` and under
    "auto" on an sm_90 GPU with a verified Triton (the launcher then still takes it only for the
    problems ``tuning.sm90_backward`` names, unless it was asked for, and never for
    ``deterministic=True``: its dQ is a sum of atomic reduce-adds), else "portable"."""
    if _tier.get() == "portable" or capability(device) != (9, 0):
        return "portable"
    return "sm90" if sm90_verified() else _unverified()


def _unverified() -> str:
    """The tier of an sm_90 device whose Triton the sm90 tier was not verified on: the portable
    one, under ``use_tier("sm90")`` with a warning (once a process), since the block asked for
    the other."""
    if _tier.get() == "sm90":
        _warn_unverified()
    return "portable"


@functools.cache
def _warn_unverified() -> None:
    import warnings

    import triton

    warnings.warn(
        f"flashcore: use_tier('sm90') on an sm_90 GPU runs the portable kernels with Triton "
        f"{triton.__version__}: the sm90 tier is enabled only on the Triton versions it was "
        f"verified on with a GPU, {', '.join(v + 'x' for v in SM90_TRITON)}",
        stacklevel=2,
    )


def current_tier() -> str:
    """The tier ``use_tier`` set for this thread or task ("auto" outside any block)."""
    return _tier.get()


def tier_forced() -> bool:
    """Whether ``use_tier("sm90")`` is in effect (not merely "auto")."""
    return _tier.get() == "sm90"


def forward_tier(device: torch.device) -> str:
    """The tier a forward on ``device`` may run: "sm90" under ``use_tier("sm90")`` and under
    "auto" on an sm_90 GPU with a verified Triton, else "portable". Under "auto" the launcher
    then takes it only for the problems ``tuning.sm90_forward`` names (where it measured
    faster); under ``use_tier("sm90")`` for every problem it covers. Either way it falls back to
    the portable tier for what the sm90 kernel does not cover."""
    if _tier.get() == "portable" or capability(device) != (9, 0):
        return "portable"
    return "sm90" if sm90_verified() else _unverified()
