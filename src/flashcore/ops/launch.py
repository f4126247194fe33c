"""Kernel launches that skip Triton's per-call argument binding once a kernel is compiled.

``JITFunction[grid](...)`` re-derives on every call what it specialises on (each integer's
type, divisibility by 16 and equality with 1, each pointer's dtype and 16-byte alignment, each
descriptor's dtype and block shape), builds its cache key from that and the options, and only then
launches: about 40 us per launch on the H100 machine's host, more than the whole kernel at small
shapes (docs/performance_host.md, "Host overhead"). ``Launcher`` keeps its own map to the compiled
kernels, keyed on a superset of that information:

- the exact value of every scalar argument (so divisibility, ``== 1`` and int32/int64 range are
  covered; the call sites pass float parameters as Python floats, ints as ints),
- per pointer argument: None, or the dtype and 16-byte alignment of the tensor, or the dtype of a
  tensor descriptor's base (its block shape is a function of the constexprs),
- the constexprs and launch options, and the CUDA device.

Equal keys therefore select the kernel Triton itself would have selected, which is then launched
through ``CompiledKernel[grid]`` (Triton's own launcher, with its stream and hook handling). A miss
launches through ``JITFunction`` (compiling if needed) and remembers what it returned. Under the
interpreter every launch goes through ``JITFunction``: there is nothing compiled to keep.

CUDA graphs: a hit reads nothing from the device and launches on the current stream, so it is
captured like any other kernel (the keys hold pointer alignment, never addresses). A miss may
make Triton compile and load a kernel variant, and CUDA forbids loading a module during a stream
capture: a launch that fails while the stream is capturing is re-raised with a message that says
to run the call once before capturing (``first_launch_in_capture``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Distinct shapes seen by one process; past this the map starts over (a miss costs only the
# ordinary Triton launch).
MAX_ENTRIES = 4096


class Launcher:
    """Launches one ``@triton.jit`` kernel whose pointer arguments come first (house style)."""

    def __init__(self, fn: Any, num_pointers: int) -> None:
        self.fn = fn
        self.num_pointers = num_pointers
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}
        self.interpreted = not hasattr(fn, "device_caches")

    def __call__(self, grid: tuple[int, ...], args: tuple, meta: dict[str, Any]) -> None:
        """``fn[grid](*args, **meta)``; ``args`` are the runtime arguments in order, ``meta`` the
        constexprs in the kernel's parameter order, then ``num_warps``/``num_stages``."""
        if self.interpreted:
            self.fn[grid](*full_descriptors(args), **meta)
            return
        pointers = args[: self.num_pointers]
        key = (
            args[self.num_pointers :],
            tuple(pointer_key(p) for p in pointers),
            tuple(meta.values()),
            torch.cuda.current_device(),
        )
        hit = self.compiled.get(key)
        if hit is None:
            try:
                kernel = self.fn[grid](*full_descriptors(args), **meta)
            except Exception as e:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(first_launch_in_capture(self.fn)) from e
                raise
            if len(self.compiled) >= MAX_ENTRIES:
                self.compiled.clear()
            names = self.fn.arg_names[len(args) :]
            self.compiled[key] = (kernel, tuple(meta[n] for n in names))
            return
        kernel, constexprs = hit
        kernel[grid + (1,) * (3 - len(grid))](*args, *constexprs)


def first_launch_in_capture(fn: Any) -> str:
    """The message for a launch that failed while a CUDA graph was being captured, before this
    launcher had seen its sizes (see ``Launcher``)."""
    name = getattr(fn, "__name__", str(fn))
    return (
        f"flashcore: {name} was launched with sizes this process had not run before while a CUDA "
        "graph was being captured, and the launch failed: Triton compiles and loads a kernel "
        "variant at its first launch, and CUDA does not allow loading one during a capture. "
        "Run the same call once eagerly before capturing (on the capture's side stream, as "
        "torch.cuda.graph's warm-up does; torch.cuda.make_graphed_callables and "
        "torch.compile(mode='reduce-overhead') warm up by themselves)"
    )


class Descriptor:
    """A host-side tensor descriptor for launches through a compiled kernel: the four fields
    Triton's launcher reads (base, shape, strides, padding) and nothing else.

    ``triton.tools.tensor_descriptor.TensorDescriptor`` checks alignment, rank and block shape
    each time one is built (about 4.5 us on the H100 machine's host, four per forward call), and
    Gluon's (``layout`` given: the Hopper tier) the same; the call sites check alignment once
    (``ops.fwd.tma_compatible``, ``ops.fwd_sm90.tma_ok``) and take block shapes from the config.
    A compiled kernel's launcher reads only these fields (the swizzle and box come from its
    metadata). A cache miss turns it into the real thing (``full``).
    """

    __slots__ = ("base", "block_shape", "layout", "shape", "strides")
    padding = "zero"

    def __init__(self, base: torch.Tensor, block_shape: list[int], layout: Any = None) -> None:
        self.base = base
        self.shape = base.shape
        self.strides = base.stride()
        self.block_shape = block_shape
        self.layout = layout

    def full(self) -> Any:
        if self.layout is not None:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

            return GluonDescriptor(
                self.base, list(self.shape), list(self.strides), self.block_shape, self.layout
            )
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(self.base, list(self.shape), list(self.strides), self.block_shape)


def cached(cache: dict, key: Any, build: Callable[[], Any]) -> Any:
    """``cache[key]``, built by ``build()`` on a miss; past MAX_ENTRIES keys the map starts over
    (a miss costs only the work ``build`` does)."""
    value = cache.get(key)
    if value is None:
        if len(cache) >= MAX_ENTRIES:
            cache.clear()
        value = cache[key] = build()
    return value


def full_descriptors(args: tuple) -> tuple:
    """``args`` with each ``Descriptor`` made a TensorDescriptor: Triton's own launch path (and
    its interpreter) specialises on the real class."""
    return tuple(a.full() if isinstance(a, Descriptor) else a for a in args)


def pointer_key(arg: Any) -> Any:
    """What Triton specialises a pointer-position argument on (see the module docstring)."""
    if arg is None:
        return None
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    # A TensorDescriptor: its block shape follows from the constexprs, which are in the key.
    return arg.base.dtype
