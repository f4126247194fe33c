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

Equal keys therefore select the kernel Triton itself would have selected. A miss launches through
``JITFunction`` (compiling if needed) and remembers what it returned. Under the interpreter every
launch goes through ``JITFunction``: there is nothing compiled to keep.

A hit calls the compiled kernel's native launcher (``CompiledKernel.run``) itself, with the
arguments ``CompiledKernel[grid](*args)`` passes it in Triton 3.6 (``triton/compiler/compiler.py``):
the grid padded to three dims, the current stream of the current device (the active driver's
``get_current_stream``, ``torch._C._cuda_getCurrentRawStream`` for CUDA), the function handle, the
packed metadata, the launch metadata and the two launch hooks, then the arguments and constexprs.
``[grid]`` builds a closure per launch, looks the driver, device and stream up again and, since
Triton 3.6's hooks are ``HookChain`` objects (never None), builds a ``LazyDict`` of launch
metadata and has the native launcher call both chains, empty unless something registered a hook.
With both chains empty (or None) those steps have no effect, so the hit passes None for the
metadata and both hooks; while a hook is registered (a profiler such as proton) it launches
through ``[grid]``, so every hook sees every launch. Kernels of another class than
``CompiledKernel`` and Triton versions other than those read for this (``DIRECT_TRITON``) always
launch through ``[grid]``. A hit of the forward's ``LoggingLauncher`` costs 3.8 us instead of
6.7 us with ``[grid]``, the key built through a function per pointer and the log's timing around
every launch (2-core CPU machine, 10 pointers and 30 scalars, a Python no-op standing in for the
native launcher, best of 9 x 20000); all of ``CompiledKernel[grid](...)`` measured 28 us a launch
on the H100 machine's host (docs/performance_host.md, "Host overhead").

Addresses: a hit passes each tensor argument as its address (``data_ptr()``, an int), which
Triton 3.6's native launcher takes as it is; given the tensor, it calls ``data_ptr()`` itself
and asks the driver whether the address is device memory (``cuPointerGetAttribute``), once per
pointer argument per launch. That query turns a host tensor's launch into a Python error rather
than a kernel reading host addresses, and the key keeps that: it holds whether each tensor is on
a GPU, so a host tensor never hits an entry of device ones, and a miss launches the tensors
through Triton, which raises its error (the API's checks name the argument before that).
A ``planned`` call (``Launcher.__call__``) skips that part of the key: its plan stands for
every tensor being on the plan's device, which the API's checks ensure for the user's tensors.

A kernel with tensor-descriptor arguments goes one level further down on a hit (``TensorMaps``):
Triton's launcher would encode every descriptor into a ``CUtensorMap`` on every launch; the
encoded maps are kept per base address, shape and strides and passed to the native launcher
directly (about 4 us a descriptor on the H100 machine's host; nine for the Hopper backward).
From Triton 3.7 on the native launcher takes its arguments in another order and the kernel's
as one tuple (``packed_abi``); ``TensorMaps`` and ``Bound`` pass either form, and
``DIRECT_TRITON`` names the versions whose direct launches ran on a GPU.

CUDA graphs: a hit reads nothing from the device and launches on the current stream, so it is
captured like any other kernel (the keys hold pointer alignment, never addresses). A miss may
make Triton compile and load a kernel variant, and CUDA forbids loading a module during a stream
capture: a launch that fails while the stream is capturing is re-raised with a message that says
to run the call once before capturing (``first_launch_in_capture``).

Floating-point contraction: a miss compiles with ``enable_fp_fusion=True`` given explicitly
(``FP_FUSION``), which is Triton's default up to 3.9, where a compile that leaves it unset warns
that the default turns to no contraction in 3.10. The kernels were measured and checked with
contraction (a multiply and an add into one FMA), so they ask for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# Distinct shapes seen by one process; past this the map starts over (a miss costs only the
# ordinary Triton launch).
MAX_ENTRIES = 4096
# What a miss compiles with (module docstring, "Floating-point contraction").
FP_FUSION = True


class Launcher:
    """Launches one ``@triton.jit`` kernel whose pointer arguments come first (house style)."""

    def __init__(self, fn: Any, num_pointers: int) -> None:
        self.fn = fn
        self.num_pointers = num_pointers
        # key -> (compiled kernel, constexprs in parameter order, whether ``run`` may be called
        # directly: see the module docstring).
        self.compiled: dict[tuple, tuple[Any, tuple, bool]] = {}
        # id(meta) -> (meta, device, scalars, hit) for calls with ``planned`` (``__call__``).
        self.planned: dict[int, tuple[dict, int, tuple, tuple[Any, tuple, bool]]] = {}
        self.interpreted = not hasattr(fn, "device_caches")

    def __call__(
        self, grid: tuple[int, ...], args: tuple, meta: dict[str, Any], planned: bool = False
    ) -> None:
        """``fn[grid](*args, **meta)``; ``args`` are the runtime arguments in order, ``meta`` the
        constexprs in the kernel's parameter order, then ``num_warps``/``num_stages``.

        ``planned``: ``meta`` is the dict of a launch plan that its caller keeps per problem
        signature and passes again for every call of that signature, and that signature fixes
        everything the key below holds but the tensors' addresses: each pointer argument's kind
        (None, a tensor's dtype on the plan's device, a descriptor's base dtype) and the scalars.
        Such a call finds its kernel by ``meta``'s identity, after checking what can still
        differ from the plan's first call: the scalars (equal), the device, and that every
        tensor address is 16-byte aligned (otherwise it takes the full key). About 3 us of the
        6 us of a cached launch's Python on the 2-core CPU machine is the full key's per-pointer
        part (docs/performance_host.md, "Launches by plan")."""
        if self.interpreted:
            self.fn[grid](*full_descriptors(args), **meta)
            return
        num_pointers = self.num_pointers
        device = torch.cuda.current_device()
        # Each tensor's address, read once: for the key and, on a direct hit, as the argument
        # itself (module docstring, "Addresses").
        pointers = [p.data_ptr() if isinstance(p, torch.Tensor) else p for p in args[:num_pointers]]
        aligned = False
        if planned:
            bits = 0
            for a in pointers:
                if type(a) is int:
                    bits |= a
            aligned = bits % 16 == 0
            memo = self.planned.get(id(meta))
            if (
                aligned and memo is not None and memo[0] is meta and memo[1] == device
                and memo[2] == args[num_pointers:]
            ):  # fmt: skip
                self._launch(memo[3], grid, device, pointers, args)
                return
        # Per pointer what Triton specialises it on (module docstring): None, a tensor's dtype and
        # 16-byte alignment (and whether it is on a GPU: "Addresses"), or a descriptor's base
        # dtype (its block shape follows from the constexprs). Inline: a function call per
        # pointer cost ~1 us a launch of 10 pointers on the 2-core CPU machine.
        key = (
            args[num_pointers:],
            tuple([
                None if a is None
                else (p.dtype, a % 16 == 0, p.is_cuda) if type(a) is int
                else p.base.dtype
                for p, a in zip(args[:num_pointers], pointers, strict=True)
            ]),
            tuple(meta.values()),
            device,
        )  # fmt: skip
        hit = self.compiled.get(key)
        if hit is None:
            self.miss(key, grid, args, meta)
            hit = self.compiled.get(key)
            if aligned and hit is not None:
                self._remember(meta, device, args[num_pointers:], hit)
            return
        if aligned:
            self._remember(meta, device, args[num_pointers:], hit)
        self._launch(hit, grid, device, pointers, args)

    def _remember(self, meta: dict, device: int, scalars: tuple, hit: tuple) -> None:
        """Keep ``hit`` for later ``planned`` calls with this ``meta`` (``__call__``)."""
        # The entry holds ``meta`` itself: while it is kept, no other dict can take its id.
        remember(self.planned, id(meta), (meta, device, scalars, hit))

    def _launch(self, hit: tuple, grid: tuple, device: int, pointers: list, args: tuple) -> None:
        """Launch a kept kernel (``compiled``'s entry ``hit``) with these arguments."""
        kernel, constexprs, direct = hit
        num_pointers = self.num_pointers
        grid = grid + (1,) * (3 - len(grid))
        if direct and no_launch_hooks():
            stream = _driver.active.get_current_stream(device)
            if type(direct) is TensorMaps:
                # Below CudaLauncher and its descriptor unpacking (``TensorMaps``).
                direct.launch(grid, stream, kernel, pointers, args[num_pointers:], constexprs)
                return
            # CompiledKernel[grid](*args, *constexprs) without its per-launch Python (module
            # docstring); the property ``run`` loads the module first if it was not.
            kernel.run(
                *grid, stream, kernel.function, kernel.packed_metadata, None, None, None,
                *pointers, *args[num_pointers:], *constexprs,
            )  # fmt: skip
        else:
            kernel[grid](*args, *constexprs)

    def miss(self, key: tuple, grid: tuple[int, ...], args: tuple, meta: dict[str, Any]) -> Any:
        """Launch through ``JITFunction`` (compiling if Triton has no kernel for this
        specialisation) and remember the kernel under ``key``; returns it."""
        try:
            kernel = self.fn[grid](*full_descriptors(args), **meta, enable_fp_fusion=FP_FUSION)
        except Exception as e:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(first_launch_in_capture(self.fn)) from e
            raise
        names = self.fn.arg_names[len(args) :]
        constexprs = tuple(meta[n] for n in names)
        direct = _runs_directly(kernel)
        if direct:
            direct = TensorMaps.of(kernel, self.num_pointers) or True
        remember(self.compiled, key, (kernel, constexprs, direct))
        return kernel


# The Triton versions whose CompiledKernel.__getitem__ the direct launch repeats (module
# docstring) and that ran it on a GPU: 3.6.0 (H100, H200), 3.7.0, 3.7.1, 3.8.0 and 3.9.0
# (H200). 3.7 launches the same way as 3.8 (the native launcher's arguments as ``packed_abi``
# says, which ``TensorMaps`` and ``Bound`` pass in that form).
DIRECT_TRITON = ("3.6.", "3.7.", "3.8.", "3.9.")
# Set by _runs_directly, on the first compiled launch (importing flashcore imports no triton).
_driver: Any = None
_knobs: Any = None
_hook_chain: Any = None


def _runs_directly(kernel: Any) -> bool:
    """Whether hits may call ``kernel.run`` themselves: a ``CompiledKernel`` of a Triton in
    DIRECT_TRITON (any other object, such as a test's stand-in, launches through ``[grid]``)."""
    global _driver, _knobs, _hook_chain
    import triton

    if not triton.__version__.startswith(DIRECT_TRITON):
        return False
    from triton import knobs
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.driver import driver

    if type(kernel) is not CompiledKernel:
        return False
    _driver, _knobs, _hook_chain = driver, knobs, knobs.HookChain
    return True


# Encoded tensor maps kept per compiled kernel; past this many the map starts over.
MAX_TENSOR_MAPS = 1024


class TensorMaps:
    """The direct launch of a kernel with tensor-descriptor arguments, below Triton's unpacking.

    In Triton 3.6 a compiled kernel's launcher (``CudaLauncher``) passes its arguments through
    ``wrap_handle_tensordesc``, which, on every launch, expands each descriptor with
    ``make_tensordesc_arg``: the 128-byte ``CUtensorMap`` encoded by the driver
    (``fill_tma_descriptor``: base address, shape, strides, the box and swizzle of the compiled
    metadata), then the shape and strides. That expansion depends on nothing but the
    descriptor's base address, shape, strides and padding and the compiled metadata of its
    position, so this class keeps it per (position, address, shape, strides, padding) and calls
    the native launcher under the wrapper with the kept expansion: the same arguments, encoded
    once per distinct tensor instead of once per launch (an eager training loop gets the same
    addresses back from PyTorch's caching allocator step after step). The Hopper backward passes
    nine descriptors a launch, its forward four.

    A kernel without descriptor arguments is launched the same way, its pointers passed through
    (``plain``): ``CudaLauncher.__call__``, the Python between ``CompiledKernel.run`` and the
    native launcher, only allocates the scratch such a kernel does not need and forwards.

    ``of`` returns None (launch through ``CompiledKernel.run`` as other kernels do) unless the
    launcher is the native one or that wrapper around it, every descriptor was lowered to a
    tensor map, all of them are among the pointer arguments, and the kernel needs no global or
    profile scratch (which ``CudaLauncher`` would allocate per launch)."""

    __slots__ = ("coop", "encode", "maps", "metas", "native", "packed", "pdl", "plain")

    def __init__(
        self,
        native: Any,
        metas: tuple,
        coop: bool,
        pdl: bool,
        encode: Any,
        packed: tuple | None = None,
    ) -> None:
        self.native = native
        self.metas = metas  # per pointer argument: its descriptor's compiled metadata, or None
        self.plain = all(m is None for m in metas)
        self.coop = coop
        self.pdl = pdl
        self.encode = encode
        # Triton 3.7 on (``packed_abi``): the kernel's argument annotations and C signature,
        # which the native launcher takes before the arguments, passed as one tuple; None: 3.6's
        # native launcher, the arguments one by one.
        self.packed = packed
        self.maps: dict[tuple, list] = {}

    @classmethod
    def of(cls, kernel: Any, num_pointers: int) -> TensorMaps | None:
        from triton.backends.nvidia import driver as nvidia

        run = kernel.run
        if type(run) is not nvidia.CudaLauncher:
            return None
        packed = None
        if getattr(nvidia, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO":
            pass  # 3.6: the arguments follow the scratch, metadata and hooks one by one
        elif packed_abi(nvidia, run):
            if getattr(run, "gsan_enabled", False):
                return None  # the sanitizer's state pointer is appended per launch
            packed = (run.arg_annotations, run.kernel_signature)
        else:
            return None  # not a launcher whose arguments ``launch`` knows how to pass
        if run.global_scratch_size or run.profile_scratch_size:
            return None
        coop, pdl = bool(run.launch_cooperative_grid), bool(run.launch_pdl)
        wrapper = run.launch
        code = getattr(wrapper, "__code__", None)
        if code is None:
            # No descriptor argument: wrap_handle_tensordesc returned the native launcher.
            return cls(
                wrapper, (None,) * num_pointers, coop, pdl, nvidia.make_tensordesc_arg, packed
            )
        if wrapper.__closure__ is None:
            return None
        cells = dict(zip(code.co_freevars, wrapper.__closure__, strict=True))
        encode = nvidia.make_tensordesc_arg
        if set(cells) == {"launcher", "tensordesc_indices", "tensordesc_meta"}:  # 3.6, 3.7
            indices = sorted(cells["tensordesc_indices"].cell_contents)
        elif packed is not None and set(cells) == {
            "launcher", "make_tensordesc_arg", "relevant_paths", "signature", "tensordesc_meta"
        }:  # fmt: skip
            # 3.8 on: the unpacking in C over the signature's descriptor paths; every one of
            # these kernels' descriptors is an argument of its own (a path of length one).
            paths = cells["relevant_paths"].cell_contents
            if any(paths.values()):
                return None
            indices = sorted(paths)
            three = cells["make_tensordesc_arg"].cell_contents
            encode = functools.partial(_encode_with_base_args, three)
        else:
            return None
        metas = cells["tensordesc_meta"].cell_contents
        if (
            not indices
            or indices[-1] >= num_pointers
            or metas is None
            or len(metas) != len(indices)
            or any(m is None for m in metas)
        ):
            return None
        by_position: list = [None] * num_pointers
        for i, meta in zip(indices, metas, strict=True):
            by_position[i] = meta
        return cls(cells["launcher"].cell_contents, tuple(by_position), coop, pdl, encode, packed)

    def launch(
        self,
        grid: tuple,
        stream: int,
        kernel: Any,
        pointers: list,
        scalars: tuple,
        constexprs: tuple,
    ) -> None:
        """``pointers``: the pointer arguments, tensors already as their addresses."""
        if self.plain:
            self.call(grid, stream, self.head(kernel), (*pointers, *scalars, *constexprs))
            return
        maps = self.maps
        front = []
        for i, a in enumerate(pointers):
            meta = self.metas[i]
            if meta is None:
                front.append(a)
                continue
            try:
                key = (i, a.base.data_ptr(), a.shape, a.strides, a.padding)
                expanded = maps.get(key)
            except TypeError:  # a descriptor with list fields (Triton's own): not kept
                key, expanded = None, None
            if expanded is None:
                expanded = self.encode(a, meta)
                if key is not None:
                    remember(maps, key, expanded, MAX_TENSOR_MAPS)
            front += expanded
        self.call(grid, stream, self.head(kernel), (*front, *scalars, *constexprs))

    def call(self, grid: tuple, stream: int, head: tuple, args: tuple) -> None:
        """The native launcher with ``head`` (what ``head`` gives) and the kernel's arguments
        ``args`` (descriptors expanded, constexprs last): one by one on 3.6, as one tuple from
        3.7 on."""
        if self.packed is None:
            self.native(*grid, stream, *head, *args)
        else:
            self.native(*grid, stream, *head, args)

    def head(self, kernel: Any) -> tuple:
        """The native launcher's arguments between the stream and the kernel's own, as
        ``CudaLauncher.__call__`` passes them. On 3.6: the function, the cooperative and PDL
        flags, the global and profile scratch (None: ``of`` takes only kernels without), the
        packed metadata, then the launch metadata and both hooks (None: ``no_launch_hooks``).
        From 3.7 on: the function, the flags, the packed metadata, the launch metadata, both
        hooks, both scratch buffers, then the argument annotations and the C signature."""
        if self.packed is None:
            return (
                kernel.function, self.coop, self.pdl, None, None, kernel.packed_metadata, None,
                None, None,
            )  # fmt: skip
        return (
            kernel.function, self.coop, self.pdl, kernel.packed_metadata, None, None, None, None,
            None, *self.packed,
        )  # fmt: skip


def _encode_with_base_args(encode: Any, descriptor: Any, meta: Any) -> list:
    """Triton 3.8's ``make_tensordesc_arg(arg, metadata, base_args)``, which reads only its first
    two (``TensorMaps.of``), as the two-argument encoder of 3.6 and 3.7."""
    return encode(descriptor, meta, None)


def packed_abi(nvidia: Any, run: Any) -> bool:
    """Whether this Triton's native launcher is that of 3.7 on (read from 3.7.1, 3.8.0 and
    3.9.0's ``backends/nvidia/driver.py`` and ``driver.c``): ``launch(gridX, gridY, gridZ,
    stream, function, cooperative, pdl, packed metadata, launch metadata, enter hook, exit hook,
    global scratch, profile scratch, argument annotations, C signature, arguments)``, the
    arguments one tuple (constexprs included: the annotations skip them), a pointer given as a
    tensor or as its address; its ``CudaLauncher`` keeps the annotations and signature."""
    return not hasattr(nvidia, "_BASE_ARGS_FORMAT") and all(
        hasattr(run, name) for name in ("arg_annotations", "kernel_signature")
    )


class Bound:
    """One planned launch of a kernel that ``TensorMaps`` launches, everything but its pointer
    arguments bound: ``bound(stream, front)`` calls the native launcher as ``TensorMaps.launch``
    does, ``front`` being the pointer arguments expanded (addresses; each descriptor as
    ``expand`` gives it). For launchers of one problem signature that compute their own
    addresses (``ops.bwd``, "Quick backwards"); ``of`` gives None where no such launch was
    made (the plan's first call went through Triton, a hook was registered, the kernel is not
    launched below ``CudaLauncher``). ``part`` keeps each descriptor's expansion by position and
    address (``parts``)."""

    __slots__ = ("grid", "head", "maps", "native", "packed", "parts", "tail")

    def __init__(self, maps: TensorMaps, kernel: Any, grid: tuple, scalars: tuple, constexprs):
        self.maps = maps
        self.native = maps.native
        self.packed = maps.packed is not None
        self.grid = grid + (1,) * (3 - len(grid))
        self.head = maps.head(kernel)
        self.tail = (*scalars, *constexprs)
        self.parts: dict[tuple, list] = {}

    @classmethod
    def of(cls, launcher: Launcher, grid: tuple, meta: dict) -> Bound | None:
        """The launch ``launcher(grid, args, meta, planned=True)`` made directly for this plan's
        ``meta`` (its scalars those of that call), or None."""
        memo = launcher.planned.get(id(meta))
        if memo is None or memo[0] is not meta:
            return None
        kernel, constexprs, direct = memo[3]
        if type(direct) is not TensorMaps:
            return None
        return cls(direct, kernel, grid, memo[2], constexprs)

    def expand(self, position: int, descriptor: Descriptor) -> list:
        """The arguments that descriptor ``descriptor`` at pointer ``position`` stands for."""
        return self.maps.encode(descriptor, self.maps.metas[position])

    def part(self, position: int, address: int, describe: Callable[[], Descriptor]) -> list:
        """``expand(position, describe())``, kept under ``(position, address)``: for the
        launches of one problem signature, whose descriptors' shapes and strides follow from
        their positions, so that a base address seen before encodes nothing (an eager loop gets
        its addresses back from the caching allocator)."""
        key = (position, address)
        part = self.parts.get(key)
        if part is None:
            part = remember(self.parts, key, self.expand(position, describe()), MAX_TENSOR_MAPS)
        return part

    def __call__(self, stream: int, front: tuple | list) -> None:
        if self.packed:
            self.native(*self.grid, stream, *self.head, (*front, *self.tail))
        else:
            self.native(*self.grid, stream, *self.head, *front, *self.tail)


def current_stream(device: int) -> int:
    """The current stream of CUDA device ``device``, as the launches above read it."""
    return _driver.active.get_current_stream(device)


def no_launch_hooks() -> bool:
    """Whether no launch hook would run: both of Triton's hooks None or chains without calls
    (a direct launch, ``Launcher``'s or a ``Bound`` one, may skip them then)."""
    runtime = _knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return (enter is None or (type(enter) is _hook_chain and not enter.calls)) and (
        leave is None or (type(leave) is _hook_chain and not leave.calls)
    )


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
    """A host-side tensor descriptor for launches through a compiled kernel: the fields Triton's
    launcher reads (base, shape, strides, padding; from triton 3.7 on ``round_f32_to_tf32``
    too, whose absence failed the launches after each kernel's first on an H200 with 3.8) and
    nothing else.

    ``triton.tools.tensor_descriptor.TensorDescriptor`` checks alignment, rank and block shape
    each time one is built (about 4.5 us on the H100 machine's host, four per forward call), and
    Gluon's (``layout`` given: the Hopper tier) the same; the call sites check alignment once
    (``ops.fwd.tma_compatible``, ``ops.fwd_sm90.tma_ok``) and take block shapes from the config.
    A compiled kernel's launcher reads only these fields (the swizzle and box come from its
    metadata). A cache miss turns it into the real thing (``full``).
    """

    __slots__ = ("base", "block_shape", "layout", "shape", "strides")
    padding = "zero"
    round_f32_to_tf32 = False

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
        value = remember(cache, key, build())
    return value


def remember(cache: dict, key: Any, value: Any, limit: int = MAX_ENTRIES) -> Any:
    """``cache[key] = value`` in a map that starts over past ``limit`` keys; returns value."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


def kept(
    cache: dict, key: Any, plans: dict, choices: dict | None = None, floor: float | None = None
) -> Any:
    """The run kept in ``cache`` under ``key`` (``keep``), or None: also where it was kept
    under other plan maps than ``plans`` and ``choices`` (tests replace them to plan again) or
    another ``floor`` (a tuning floor its choice read)."""
    entry = cache.get(key)
    if entry is None or entry[1] is not plans or entry[2] is not choices or entry[3] != floor:
        return None
    return entry[0]


def keep(
    cache: dict,
    key: Any,
    run: Any,
    plans: dict,
    choices: dict | None = None,
    floor: float | None = None,
) -> None:
    """Keep ``run`` under ``key`` with what ``kept`` checks it against."""
    remember(cache, key, (run, plans, choices, floor))


def full_descriptors(args: tuple) -> tuple:
    """``args`` with each ``Descriptor`` made a TensorDescriptor: Triton's own launch path (and
    its interpreter) specialises on the real class."""
    return tuple(a.full() if isinstance(a, Descriptor) else a for a in args)
