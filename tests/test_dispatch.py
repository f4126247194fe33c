"""The lean eager path (ops.registry.direct) and the launch cache (ops.launch).

Eager calls on plain tensors run the launchers without the torch.library dispatch; everything
else must still see the registered ops. Both paths run the same kernels, so they must agree bit
for bit. The launch cache must pick exactly the kernel Triton would pick: a repeated launch reuses
one entry, a change in anything Triton specialises on (alignment, sizes) makes a new one.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flashcore
from flashcore.ops import registry as ops
from helpers import check_backward, check_forward, make_qkv
from shapes import Case


def _qkv(device, dtype=torch.float32, b=1, h=2, s=37, d=16, grad=False):
    return [
        torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(3)
    ]


def _boom(*args, **kwargs):
    raise AssertionError("the registered op was dispatched on a plain eager call")


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_eager_call_skips_op_dispatch(grad, device, monkeypatch):
    monkeypatch.setattr(ops, "attn_fwd", _boom)
    monkeypatch.setattr(ops, "attn_bwd", _boom)
    q, k, v = _qkv(device, grad=grad)
    out = flashcore.attention(q, k, v, causal=True)
    if grad:
        out.sum().backward()
        assert all(t.grad is not None for t in (q, k, v))


def test_dispatch_mode_sees_the_op(device):
    q, k, v = _qkv(device)
    with _Recorder() as rec:
        flashcore.attention(q, k, v)
    assert any("flashcore.attn_fwd" in op for op in rec.ops), rec.ops


def _assert_paths_agree(monkeypatch, q, k, v, wrt, options) -> None:
    """The eager path and the registered op give the same out, LSE and gradients, bit for bit."""
    dout, dlse = torch.randn_like(q), torch.randn(q.shape[:3], device=q.device)

    def run():
        out, lse = flashcore.attention(q, k, v, return_lse=True, **options)
        grads = torch.autograd.grad((out, lse), wrt, (dout, dlse))
        return out, lse, *grads

    direct = run()
    monkeypatch.setattr(ops, "direct", lambda *tensors: False)
    via_op = run()
    for a, b in zip(direct, via_op, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_direct_and_op_paths_agree(causal, device, monkeypatch):
    q, k, v = _qkv(device, grad=True)
    _assert_paths_agree(monkeypatch, q, k, v, (q, k, v), dict(causal=causal))


def test_direct_and_op_paths_agree_with_options(device, monkeypatch):
    # GQA, a window, a softcap, (B, H) ALiBi slopes and sinks with a gradient: the eager
    # Function carries the options outside its inputs and must still match the op bit for bit.
    case = Case(2, 4, 2, 29, 41, 16)
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.float32, device))
    slopes = torch.rand(2, 4, device=device)
    sinks = torch.randn(4, device=device, requires_grad=True)
    options = dict(window=(9, 4), softcap=6.0, alibi_slopes=slopes, sinks=sinks, causal=True)
    _assert_paths_agree(monkeypatch, q, k, v, (q, k, v, sinks), options)


def test_double_backward_raises(device):
    q, k, v = _qkv(device, grad=True)
    out = flashcore.attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError):
        dq.sum().backward()


def test_kvcache_eager_skips_op_dispatch(device, monkeypatch):
    monkeypatch.setattr(ops, "attn_kvcache", _boom)
    q = torch.randn(2, 4, 1, 16, device=device)
    k_cache, v_cache = (torch.randn(2, 2, 40, 16, device=device) for _ in range(2))
    seqlens = torch.tensor([40, 17], dtype=torch.int32, device=device)
    out = flashcore.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    assert out.shape == q.shape


@pytest.mark.gpu
def test_launch_cache_reuses_and_respecialises():
    from flashcore.ops import fwd

    launcher = fwd.kernel()
    q, k, v = _qkv("cuda", torch.float16, b=2, h=4, s=200, d=64)
    first = flashcore.attention(q, k, v)
    entries = len(launcher.compiled)
    again = flashcore.attention(q, k, v)
    assert len(launcher.compiled) == entries
    assert torch.equal(first, again)

    # The same sizes and strides from a base that is not 16-byte aligned: Triton specialises
    # pointers on alignment (and this layout also rules out tensor descriptors).
    flat = torch.randn(q.numel() + 1, device="cuda", dtype=torch.float16)
    q_off = flat[1:].view_as(q).copy_(q)
    assert q_off.data_ptr() % 16 != 0
    shifted, lse = flashcore.attention(q_off, k, v, return_lse=True)
    assert len(launcher.compiled) == entries + 1
    check_forward(shifted, lse, q_off, k, v, causal=False)

    # Another sequence length: new sizes in the key, and the kernel is right for them.
    q2, k2, v2 = (t[:, :, :113] for t in (q, k, v))
    out2, lse2 = flashcore.attention(q2, k2, v2, return_lse=True)
    assert len(launcher.compiled) >= entries + 2
    check_forward(out2, lse2, q2, k2, v2, causal=False)


@pytest.mark.gpu
def test_launch_hit_with_a_host_tensor_raises():
    """A hit passes tensors to Triton's native launcher as bare addresses (``ops.launch``,
    "Addresses"); a host tensor in place of a device one must still raise, not launch a kernel
    on a host address: it misses (the key holds each tensor's device kind), and Triton's own
    launch raises."""
    import triton
    import triton.language as tl

    from flashcore.ops import launch

    @triton.jit
    def copy(X, Y, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(Y + i, tl.load(X + i, mask=i < n), mask=i < n)

    launcher = launch.Launcher(copy, num_pointers=2)
    x = torch.arange(16, device="cuda", dtype=torch.float32)
    y = torch.zeros_like(x)
    for _ in range(2):  # a miss, then a hit
        launcher((1,), (x, y, 16), {"BLOCK": 16})
    assert torch.equal(y, x) and len(launcher.compiled) == 1
    with pytest.raises(ValueError, match="cpu tensor"):
        launcher((1,), (x.cpu(), y, 16), {"BLOCK": 16})
    y.zero_()
    launcher((1,), (x, y, 16), {"BLOCK": 16})
    assert torch.equal(y, x)  # the context is intact


@pytest.mark.gpu
def test_launch_cache_backward_and_decode():
    q, k, v = _qkv("cuda", torch.bfloat16, b=2, h=4, s=150, d=64, grad=True)
    dout = torch.randn_like(q)
    grads = [torch.autograd.grad(flashcore.attention(q, k, v, causal=True), (q, k, v), dout)]
    grads.append(torch.autograd.grad(flashcore.attention(q, k, v, causal=True), (q, k, v), dout))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    check_backward(q, k, v, causal=True, dout=dout)

    qd = torch.randn(3, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = (
        torch.randn(3, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv"
    )
    seqlens = torch.tensor([300, 17, 129], dtype=torch.int32, device="cuda")
    outs = [flashcore.attention_with_kvcache(qd, k_cache, v_cache, cache_seqlens=seqlens)]
    outs.append(flashcore.attention_with_kvcache(qd, k_cache, v_cache, cache_seqlens=seqlens))
    assert torch.equal(outs[0], outs[1])


def stand_in_launch(monkeypatch, run, arg_names, device=3):
    """A launcher over a stand-in compiled kernel (loaded handles, ``run`` as its native
    launcher) and a stand-in driver (``device``; its stream is ``f"stream of {device}"``), for
    the CPU tests of the direct launch. Returns ``(kernel, Launcher class's module)``."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.driver import driver

    kernel = object.__new__(CompiledKernel)
    kernel.function, kernel.packed_metadata = "function", "packed"
    # "Loaded" for the test, None again after it: 3.8's __del__ unloads a loaded module.
    kernel.module = None
    monkeypatch.setattr(kernel, "module", "module")
    kernel._run = run
    kernel.name, kernel.src = "attn_fwd_kernel", None

    class Driver:
        @staticmethod
        def get_current_device():
            return device

        @staticmethod
        def get_current_stream(dev):
            return f"stream of {dev}"

    class Jit:  # a compiled-mode JITFunction that returns the kernel above
        __name__ = "attn_fwd_kernel"
        device_caches = types.MappingProxyType({})  # what marks a compiled-mode JITFunction

        def __getitem__(self, grid):
            return lambda *args, **meta: kernel

    Jit.arg_names = arg_names
    monkeypatch.setattr(driver, "_active", Driver())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device)
    return kernel, Jit()


def stand_in_cuda_launcher(nvidia, native, signature, metas, coop=False, pdl=False):
    """Triton's own ``CudaLauncher`` (not constructed: its fields set) around ``native``, a
    stand-in native launcher, with this Triton's descriptor unpacking for ``signature`` and
    ``metas``; from 3.7 on with stand-in argument annotations and C signature."""
    run = object.__new__(nvidia.CudaLauncher)
    run.launch = nvidia.wrap_handle_tensordesc(native, signature, metas)
    run.num_ctas = 1
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid, run.launch_pdl = coop, pdl
    if not hasattr(nvidia, "_BASE_ARGS_FORMAT"):
        run.arg_annotations, run.kernel_signature, run.gsan_enabled = "annotations", b"sig", False
    return run


def native_head(nvidia, coop, pdl) -> tuple[tuple, slice, bool]:
    """What ``CudaLauncher.__call__`` passes the native launcher before the kernel's arguments
    for a launch on grid (5, 1, 1) of device 0 without scratch, launch metadata or hooks; where
    the launch metadata and the two hooks are in it (a launch through ``[grid]`` passes its
    own); and whether the arguments follow one by one (3.6) rather than as one tuple (3.7 on)."""
    grid = (5, 1, 1, "stream of 0", "function", coop, pdl)
    if hasattr(nvidia, "_BASE_ARGS_FORMAT"):
        return (*grid, None, None, "packed", None, None, None), slice(10, 13), True
    head = (*grid, "packed", None, None, None, None, None, "annotations", b"sig")
    return head, slice(8, 11), False


def same_but_hooks(launched: tuple, head: tuple, hooks: slice) -> bool:
    """Whether ``launched`` begins with ``head`` but for the launch metadata and hooks."""
    n = len(head)
    return (
        launched[: hooks.start] + launched[hooks.stop : n]
        == head[: hooks.start] + head[hooks.stop :]
    )


def test_launch_miss_asks_for_fp_contraction(monkeypatch):
    """A miss compiles with ``enable_fp_fusion=True`` given (``ops.launch``, "Floating-point
    contraction"): Triton 3.9 warns when it is left unset and 3.10 turns it off by default. The
    option reaches Triton's launch beside the constexprs, not among them."""
    import types

    from flashcore.ops import launch

    seen = []

    class Jit:  # a compiled-mode JITFunction (it has device caches)
        __name__ = "attn_fwd_kernel"
        device_caches = types.MappingProxyType({})
        arg_names = ("X", "n", "BLOCK")

        def __getitem__(self, grid):
            def run(*args, **meta):
                seen.append(meta)
                return object()  # not a CompiledKernel: later hits launch through [grid]

            return run

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launcher = launch.Launcher(Jit(), num_pointers=1)
    launcher((1,), (None, 7), {"BLOCK": 16, "num_warps": 4})
    assert seen == [{"BLOCK": 16, "num_warps": 4, "enable_fp_fusion": True}]
    ((_, constexprs, direct),) = launcher.compiled.values()
    assert constexprs == (16,) and not direct


def test_launch_hit_calls_the_native_launcher(monkeypatch):
    """A launch-cache hit calls ``CompiledKernel.run`` itself with what ``CompiledKernel[grid]``
    passes it (Triton 3.6), less the launch metadata and the hooks, which do nothing while no
    hook is registered; with a hook registered it launches through ``[grid]``, so the hook runs.
    On the CPU: a stand-in for the compiled kernel's loaded handles and native launcher, and for
    the driver's stream lookup."""
    import triton
    from triton import knobs

    from flashcore.ops import launch

    if not triton.__version__.startswith(launch.DIRECT_TRITON):
        pytest.skip("the direct launch is taken only on the Triton versions it was read from")
    native = []
    kernel, jit = stand_in_launch(
        monkeypatch, lambda *args: native.append(args), ("X", "n", "BLOCK")
    )
    launcher = launch.Launcher(jit, num_pointers=1)
    x = torch.zeros(4)
    launcher((5,), (x, 7), {"BLOCK": 16})  # a miss: through the JITFunction
    assert native == []
    launcher((5,), (x, 7), {"BLOCK": 16})
    kernel[(5, 1, 1)](x, 7, 16)  # Triton's own path, for comparison
    direct, own = native
    assert direct[:6] == own[:6] == (5, 1, 1, "stream of 3", "function", "packed")
    # Tensors reach the native launcher as their addresses, which it takes as they are.
    assert direct[9:] == (x.data_ptr(), 7, 16) and own[9:] == (x, 7, 16)
    assert direct[6:9] == (None, None, None)
    assert own[7] is knobs.runtime.launch_enter_hook and not own[7].calls

    def hook(metadata):
        pass

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launcher((5,), (x, 7), {"BLOCK": 16})
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    hooked = native[-1]
    assert hooked[7] is knobs.runtime.launch_enter_hook
    assert hooked[6].get()["name"] == "attn_fwd_kernel"


def test_launch_hit_of_a_plain_kernel_calls_under_the_launcher_wrapper(monkeypatch):
    """A hit of a kernel without descriptor arguments calls Triton 3.6's native launcher under
    ``CudaLauncher.__call__`` (``ops.launch.TensorMaps``, ``plain``) with what that wrapper would
    pass it: the cooperative and PDL flags, no scratch, then what ``CompiledKernel.run`` gets.
    On the CPU: ``CudaLauncher`` around a stand-in native launcher (a callable without Python
    code, as the compiled one is)."""
    import triton
    from triton.backends.nvidia import driver as nvidia

    from flashcore.ops import launch

    if not triton.__version__.startswith(launch.DIRECT_TRITON):
        pytest.skip("the direct launch is taken only on the Triton versions it was read from")
    native = []

    class Native:  # no __code__: what wrap_handle_tensordesc returns for a plain signature
        def __call__(self, *args):
            native.append(args)

    signature = {"X": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    run = stand_in_cuda_launcher(nvidia, Native(), signature, None, pdl=True)
    kernel, jit = stand_in_launch(monkeypatch, run, ("X", "n", "BLOCK"), device=0)
    launcher = launch.Launcher(jit, num_pointers=1)
    x = torch.zeros(4)
    launcher((5,), (x, 7), {"BLOCK": 16})  # a miss: through the JITFunction
    ((_, _, direct),) = launcher.compiled.values()
    assert native == [] and type(direct) is launch.TensorMaps and direct.plain
    launcher((5,), (x, 7), {"BLOCK": 16})
    kernel[(5, 1, 1)](x, 7, 16)  # Triton's own path, through CudaLauncher.__call__
    hit, own = native
    head, hooks, flat = native_head(nvidia, False, True)
    n = len(head)
    # Triton's own launch passes its hook chains (empty) where the hit passes None.
    assert hit[:n] == head and same_but_hooks(own, head, hooks)
    hit_args, own_args = (hit[n:], own[n:]) if flat else (tuple(hit[n]), tuple(own[n]))
    assert hit_args == (x.data_ptr(), 7, 16) and own_args == (x, 7, 16)
    assert flat or len(hit) == len(own) == n + 1


def test_planned_launch_finds_its_kernel_by_the_plan(monkeypatch):
    """A ``planned`` launch (``ops.launch.Launcher``: ``meta`` a plan's own dict) reuses the
    kernel of the plan's first aligned call by the dict's identity, and takes the full key again
    for a misaligned tensor, other scalars or another dict. On the CPU, as the test above."""
    import triton

    from flashcore.ops import launch

    if not triton.__version__.startswith(launch.DIRECT_TRITON):
        pytest.skip("the direct launch is taken only on the Triton versions it was read from")
    native = []
    _, jit = stand_in_launch(monkeypatch, lambda *args: native.append(args), ("X", "n", "BLOCK"))
    launcher = launch.Launcher(jit, num_pointers=1)
    meta = {"BLOCK": 16}
    x = torch.zeros(8)
    launcher((5,), (x, 7), meta, planned=True)  # a miss: through the JITFunction, remembered
    assert native == [] and list(launcher.planned) == [id(meta)]
    compiled = dict(launcher.compiled)
    launcher((5,), (x, 7), meta, planned=True)  # by the plan: no key built, nothing compiled
    assert native[-1][9:] == (x.data_ptr(), 7, 16) and launcher.compiled == compiled
    misaligned = x[1:]  # 4 bytes past a 16-byte boundary: Triton specialises on alignment
    launcher((5,), (misaligned, 7), meta, planned=True)
    assert len(launcher.compiled) == 2 and len(native) == 1  # a miss of the full key
    launcher((5,), (x, 9), meta, planned=True)  # other scalars: the full key (a miss)
    assert len(launcher.compiled) == 3 and len(native) == 1
    launcher((5,), (x, 7), {"BLOCK": 16}, planned=True)  # an equal dict: the full key's hit
    assert len(launcher.compiled) == 3 and native[-1][9:] == (x.data_ptr(), 7, 16)
    assert len(native) == 2


def test_launch_hit_keeps_the_tensor_maps(monkeypatch):
    """A hit of a kernel with tensor-descriptor arguments calls the native launcher under
    Triton's descriptor unpacking (``ops.launch.TensorMaps``) with exactly the arguments that
    unpacking would give it, and encodes each distinct descriptor once: again only for another
    base address or shape. On the CPU: Triton 3.6's own unpacking wrapper and ``CudaLauncher``
    around a stand-in native launcher, and a stand-in encoder."""
    import triton
    from triton.backends.nvidia import driver as nvidia

    from flashcore.ops import launch

    if not triton.__version__.startswith(launch.DIRECT_TRITON):
        pytest.skip("the direct launch is taken only on the Triton versions it was read from")
    encoded = []

    def encode(desc, meta, *base_args):  # 3.8 on pass the launch's other arguments too
        encoded.append((desc.base.data_ptr(), tuple(desc.shape), meta["swizzle"]))
        return [("map", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(nvidia, "make_tensordesc_arg", encode)
    native = []
    signature = {"A": "tensordesc<fp16[1, 64]>", "X": "*fp32", "C": "tensordesc<fp16[1, 64]>",
                 "n": "i32", "BLOCK": "constexpr"}  # fmt: skip
    metas = [{"swizzle": 128}, {"swizzle": 64}]
    run = stand_in_cuda_launcher(nvidia, lambda *a: native.append(a), signature, metas)
    kernel, jit = stand_in_launch(monkeypatch, run, ("A", "X", "C", "n", "BLOCK"), device=0)
    launcher = launch.Launcher(jit, num_pointers=3)
    a, c, c2 = torch.zeros(4, 64), torch.zeros(8, 64), torch.zeros(8, 64)
    x = torch.zeros(3)

    def args(c_tensor):
        return (launch.Descriptor(a, [1, 64]), x, launch.Descriptor(c_tensor, [1, 64]), 7)

    launcher((5,), args(c), {"BLOCK": 16})  # a miss: through the JITFunction
    assert native == [] and type(launcher.compiled[next(iter(launcher.compiled))][2]) is (
        launch.TensorMaps
    )
    launcher((5,), args(c), {"BLOCK": 16})
    assert len(encoded) == 2  # the first hit encodes both descriptors
    launcher((5,), args(c), {"BLOCK": 16})
    assert len(encoded) == 2  # the same tensors: nothing encoded again
    kernel[(5, 1, 1)](*args(c), 16)  # Triton's own path: its wrapper encodes both again
    assert len(encoded) == 4
    first, again, own = native
    assert first == again
    head, hooks, flat = native_head(nvidia, False, False)
    n = len(head)
    assert first[:n] == head and same_but_hooks(own, head, hooks)
    expanded = (("map", a.data_ptr(), 128), 4, 64, 64, 1, x, ("map", c.data_ptr(), 64), 8, 64,
                64, 1, 7, 16)  # fmt: skip
    first_args, own_args = (first[n:], own[n:]) if flat else (tuple(first[n]), tuple(own[n]))
    assert own_args == expanded
    # The plain pointer argument as its address (test_launch_hit_calls_the_native_launcher).
    assert first_args == (*expanded[:5], x.data_ptr(), *expanded[6:])
    launcher((5,), args(c2), {"BLOCK": 16})  # another base: that descriptor encoded again
    assert encoded[4:] == [(c2.data_ptr(), (8, 64), 64)]
    last_args = native[-1][n:] if flat else tuple(native[-1][n])
    assert last_args[6] == ("map", c2.data_ptr(), 64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_launch_plans_follow_the_layout(causal, device):
    # ops.fwd/ops.bwd build the launch arguments once per problem signature; the same shape in
    # another memory layout (so other strides) or another mask must get its own plan, and a
    # repeated call must reuse one and still be right.
    from flashcore.ops import bwd as bwd_mod
    from flashcore.ops import fwd as fwd_mod

    case = Case(1, 2, 1, 45, 61, 32)
    for i, layout in enumerate(("bhsd", "bshd", "sliced", "bhsd")):
        q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.float16, device, layout=layout))
        before = (len(fwd_mod._PLANS), len(bwd_mod._PLANS))
        out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
        check_forward(out, lse, q, k, v, causal=causal)
        check_backward(q, k, v, causal=causal)
        new = (len(fwd_mod._PLANS) - before[0], len(bwd_mod._PLANS) - before[1])
        if i == 3:  # the first layout again: both plans reused
            assert new == (0, 0)
        else:
            assert all(n in (0, 1) for n in new), (layout, new)


def test_launch_plan_sees_the_descriptor_threshold(monkeypatch):
    # The plan holds the pointers-or-descriptors choice, so the threshold is part of its key.
    from flashcore import tuning
    from flashcore.ops import fwd as fwd_mod

    fwd_mod._PLANS.clear()
    from flashcore.ops import runtime

    monkeypatch.setattr(runtime, "is_interpreted", lambda: False)
    monkeypatch.setattr(runtime, "has_tma", lambda device: True)
    monkeypatch.setattr(runtime, "capability", lambda device: (9, 0))
    launches = []
    monkeypatch.setattr(
        fwd_mod, "kernel", lambda: lambda grid, args, meta, planned=False: launches.append(meta)
    )
    q, k, v = _qkv("cpu", torch.float16)
    fwd_mod.launch(q, k, v, False, 0.25)
    monkeypatch.setattr(tuning, "TMA_MIN_FLOPS", 0)
    fwd_mod.launch(q, k, v, False, 0.25)
    fwd_mod._PLANS.clear()
    assert [m["USE_TMA"] for m in launches] == [False, True]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_light_descriptor_becomes_the_real_one(dtype):
    """The Hopper launchers pass ``ops.launch.Descriptor`` objects (the fields a compiled
    kernel's launcher reads); a launcher miss turns each into Gluon's ``TensorDescriptor`` with
    the same base, shape, strides, box and layout (and without a layout, Triton's own)."""
    from flashcore.ops import fwd_sm90, launch, runtime

    if not runtime.sm90_verified():
        pytest.skip("the Hopper tier runs only on the Triton versions it was verified on")
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.zeros(2, 3, 96, 64, dtype=dtype)[:, 1:]  # a strided view
    light = fwd_sm90.descriptor(t, [1, 1, 64, 64])
    assert isinstance(light, launch.Descriptor)
    full = light.full()
    assert isinstance(full, GluonDescriptor)
    assert full.base is t and list(full.shape) == list(t.shape)
    assert list(full.strides) == list(t.stride()) and list(full.block_shape) == [1, 1, 64, 64]
    assert full.layout == light.layout and full.padding == light.padding == "zero"
    rows = fwd_sm90.descriptor(torch.zeros(256), [64]).full()  # a 1-D run of fp32 row stats
    assert rows.layout.swizzle_byte_width == 0
    plain = launch.Descriptor(t, [1, 1, 64, 64]).full()
    assert isinstance(plain, TensorDescriptor) and not isinstance(plain, GluonDescriptor)


def test_light_descriptor_has_what_the_launcher_reads():
    """Every field the installed Triton's NVIDIA launcher reads off a host descriptor argument
    (``make_tensordesc_arg``, and ``decompose_descriptor`` where it exists; im2col's own fields
    aside) is one ``ops.launch.Descriptor`` has, with the value Triton's own descriptor has by
    default. Triton 3.7 added ``round_f32_to_tf32``: without it every launch with these
    descriptors but a kernel's first (a miss, through Triton's own) failed on a GPU (an H200
    with 3.8), which no CPU run had shown."""
    import inspect
    import re

    from flashcore.ops import launch

    driver = pytest.importorskip("triton.backends.nvidia.driver")
    from triton.tools.tensor_descriptor import TensorDescriptor

    names = set()
    for fn_name in ("make_tensordesc_arg", "decompose_descriptor"):
        fn = getattr(driver, fn_name, None)
        if fn is not None:
            source = re.sub(r"if is_im2col:.*?else:", "", inspect.getsource(fn), flags=re.S)
            names |= set(re.findall(r"\barg\.(\w+)", source))
    assert {"base", "shape", "strides"} <= names  # the reading above still finds the fields
    t = torch.zeros(2, 4, 64, 64, dtype=torch.float16)
    light = launch.Descriptor(t, [1, 1, 64, 64])
    real = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 64, 64])
    for name in sorted(names - {"base"}):
        assert hasattr(light, name), name
        mine, theirs = getattr(light, name), getattr(real, name)
        if name in ("shape", "strides"):
            mine, theirs = list(mine), list(theirs)
        assert mine == theirs, name
