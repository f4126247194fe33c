"""Backward launcher: allocates ``dq``, ``dk``, ``dv`` and delta, picks the config, launches the
dQ kernel (which also writes delta) and then the dK/dV kernel.

Quick backwards: a backward without options (no LSE gradient, window, softcap, ALiBi, sinks,
packing or ``deterministic``) depends on nothing but its signature (each tensor's shape,
strides and dtype, the device, ``causal``, ``scale``, the tier in effect): its first call keeps
what it launched (``_QUICK``), and a later call of the signature allocates the gradients and
calls the kernels' native launchers with its own addresses (``ops.launch.Bound``), skipping the
stride normalisation, the tier's choice, both plan keys and the per-launch checks of
``Launcher``. What the key leaves out is checked per call: capture, the current device, launch
hooks, 16-byte aligned addresses. Measured on the H200 machine's host:
docs/performance_host.md, "Quick backwards".
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from flashcore import tuning
from flashcore.ops import bwd256, runtime
from flashcore.ops import problem as pb
from flashcore.ops.launch import (
    Bound,
    Launcher,
    cached,
    current_stream,
    keep,
    kept,
    no_launch_hooks,
)
from flashcore.tuning import BwdConfig, bwd_config, head_block, sm90_backward, sm90_backward_work


def d_panels(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(BLOCK_D, BLOCK_D2)``: the column panels the backward kernels tile Q, K, dQ and dK with
    (``kernels/bwd.py``, "BLOCK_D2"). Head dim 192 with 16-bit inputs (MLA's query/key head dim)
    takes 128 + 64 columns instead of one 256-wide tile padded by a quarter; everything else one
    tile (``BLOCK_D2 = 0``). fp32 inputs keep one tile: their score product is one fp64 product
    rounded once, which two panels would round twice."""
    if head_dim == 192 and dtype in (torch.float16, torch.bfloat16):
        return 128, 64
    return head_block(head_dim), 0


@functools.cache
def kernels() -> tuple[Launcher, Launcher]:
    """Launchers of the dQ and dK/dV kernels."""
    return (
        runtime.kernel("bwd", "attn_bwd_dq_kernel", 12),
        runtime.kernel("bwd", "attn_bwd_dkdv_kernel", 11),
    )


def launch(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    scale: float,
    varlen: pb.Varlen | None = None,
    config: BwdConfig | None = None,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients ``(dq, dk, dv, dsinks)`` of the forward ``(out, lse) = ops.fwd.launch(q, k, v,
    causal, scale, window=..., softcap=..., alibi_slopes=..., sinks=...)`` (same options);
    ``dsinks`` is None without sinks.

    ``dout`` is the gradient of ``out`` (any strides with a unit-stride last dim), ``dlse`` that of
    ``lse`` or None. Each gradient has its input's memory layout when the input is dense. With
    ``varlen`` the tensors are packed as in the forward. ``config`` overrides the tuned launch
    config (for tuning scripts). The slopes get no gradient. The kernels need nothing for the
    sinks (their probabilities come from the LSE, which includes them); ``dsinks`` follows from
    the LSE and delta (``sink_grad``).

    On an sm_90 GPU the Hopper backward (``ops/bwd_sm90.py``) runs instead where it covers the
    problem and ``runtime.backward_tier`` and ``tuning.sm90_backward`` choose it (or
    ``use_tier("sm90")`` forces it), unless ``deterministic``: its dQ is summed by atomic
    reduce-adds, so the last bits may vary between runs. These kernels write every gradient from
    one program (bit-identical over runs).
    """
    quick = None
    if (
        dlse is None and sinks is None and alibi_slopes is None and varlen is None
        and config is None and not deterministic and softcap == 0.0 and window == (-1, -1)
    ):  # fmt: skip
        # A quick backward (module docstring): this signature's kept launches, if any.
        quick = (
            q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(),
            dout.stride(), lse.shape, lse.stride(), q.dtype, out.dtype, dout.dtype, lse.dtype,
            q.device, dout.device, causal, scale, runtime.current_tier(),
            torch.are_deterministic_algorithms_enabled(),
        )  # fmt: skip
        run = _quick(quick)
        if run is not None and _plain_call(q):
            grads = run(dout, q, k, v, out, lse)
            if grads is not None:
                return grads
    given = (q, k, v, out, dout, lse)
    # The kernels address the head dim with unit stride (see kernels/fwd.py, Invariants).
    q = pb.unit_stride_last_dim(q)
    k = pb.unit_stride_last_dim(k)
    v = pb.unit_stride_last_dim(v)
    out = pb.unit_stride_last_dim(out)
    dout = pb.unit_stride_last_dim(dout)
    if varlen is None:
        seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    else:
        seqlen_q, seqlen_k = varlen.max_seqlen_q, varlen.max_seqlen_k
    if window != (-1, -1):
        # As the forward: a window that hides no key is none (the tier, split and plan see it).
        causal, window = pb.effective_window(causal, window, seqlen_q, seqlen_k)
    if q.numel() == 0 or k.numel() == 0 or seqlen_q == 0 or seqlen_k == 0:
        # No query or no key: nothing depends on the other inputs. A row with no key has out = 0,
        # so its delta is -dlse.
        dsinks = None
        if sinks is not None:
            delta = torch.zeros_like(lse) if dlse is None else -dlse.float()
            dsinks = sink_grad(sinks, lse, delta)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsinks
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if (
        config is None
        and not deterministic
        and runtime.backward_tier(q.device) == "sm90"
        and not torch.are_deterministic_algorithms_enabled()
    ):
        # Whether the Hopper backward runs, per problem signature (its tuning choice and the
        # tier's checks ran on every call before; docs/performance_host.md, "The Hopper
        # backward's launcher"): dq, dk, dv are fresh ``empty_like`` tensors, so their strides
        # follow from the inputs' and their addresses are aligned; the inputs' alignment is part
        # of the key.
        aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16 == 0
        capturing = runtime.capturing(q)
        key = (
            q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device,
            causal, window, None if alibi_slopes is None else alibi_slopes.dtype, aligned,
            runtime.tier_forced(), None if varlen is None else pb.problem_dims(q, k, varlen),
            capturing,
        )  # fmt: skip
        if capturing and runtime.in_capture(q):
            key = runtime.warmed_key(_SM90, key)
        hopper = _SM90.get(key)
        if hopper is None:
            hopper = cached(_SM90, key, lambda: _takes_sm90(
                q, k, v, dq, dk, dv, causal, window, alibi_slopes, varlen, key[-1]
            ))  # fmt: skip
        if hopper:
            from flashcore.ops import bwd_sm90

            kept = [] if quick is not None and not capturing else None
            delta = bwd_sm90.attn_bwd_sm90(
                dout, q, k, v, out, lse, causal, scale, dlse, dq, dk, dv,
                window=window, softcap=softcap, alibi=alibi_slopes, varlen=varlen, quick=kept,
            )[3]  # fmt: skip
            if (
                kept and kept[0] is not None and lse.is_contiguous()
                and pb.used_as_given(given, (q, k, v, out, dout, lse))
            ):  # fmt: skip
                _keep(quick, kept[0])
            if sinks is None:
                return dq, dk, dv, None
            return dq, dk, dv, sink_grad(sinks, lse, delta)
    lse = lse.contiguous()
    deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
    if (
        bwd256.takes_head_dims(q.shape[-1], v.shape[-1])
        and config is None
        and bwd256.takes(
            q, k, v, dout, causal, alibi_slopes, varlen, window, softcap, deterministic
        )
    ):
        # Head dim 256 on Hopper: the Gluon kernels of ops/bwd256.py (taken with
        # ``deterministic`` too: then without atomics).
        dlse = None if dlse is None else dlse.contiguous()
        delta = bwd256.backward(
            dout, q, k, v, out, lse, dlse, dq, dk, dv, causal, scale, window, softcap, alibi_slopes,
            varlen, deterministic,
        )  # fmt: skip
        return dq, dk, dv, None if sinks is None else sink_grad(sinks, lse, delta)
    delta = torch.empty_like(lse)
    alibi, stride_ab = pb.alibi_arg(alibi_slopes, lse)
    # Everything but the pointers follows from this key (the gradients' and delta's strides from
    # their inputs' shapes and strides): the grids, scalars and constexprs are built once per
    # problem signature (about 40 us of Python a call on the H100 machine's host otherwise).
    key = (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(), dout.stride(),
        None if dlse is None else dlse.stride(), q.dtype, q.device, causal, scale, window,
        softcap, None if alibi_slopes is None else stride_ab,
        None if varlen is None else pb.problem_dims(q, k, varlen),
        config,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = cached(_PLANS, key, lambda: _plan(
            q, k, v, out, dout, lse, dlse, dq, dk, dv, causal, scale, varlen, config,
            window, softcap, alibi_slopes, stride_ab, pb.problem_dims(q, k, varlen),
        ))  # fmt: skip
    (q_grid, q_tail, q_meta), (kv_grid, kv_tail, kv_meta) = plan
    dq_kernel, dkdv_kernel = kernels()
    cu_q, cu_k = (None, None) if varlen is None else varlen[:2]
    # Without an LSE gradient its pointer is never read: the LSE stands in.
    dlse_arg = lse if dlse is None else dlse
    # The dQ kernel writes delta, which the dK/dV kernel (same stream, launched after it) reads.
    with runtime.launch_on(q):
        dq_kernel(
            q_grid,
            (q, k, v, out, dout, dlse_arg, lse, delta, dq, cu_q, cu_k, alibi, *q_tail),
            q_meta,
            planned=True,
        )
        dkdv_kernel(
            kv_grid,
            (q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k, alibi, *kv_tail),
            kv_meta,
            planned=True,
        )
    if (
        quick is not None
        and pb.used_as_given(given, (q, k, v, out, dout, lse))
        and q.is_cuda  # under the interpreter nothing is compiled to keep
        and not runtime.capturing(q)
    ):
        _keep(quick, _portable_quick(plan, q.get_device(), dq_kernel, dkdv_kernel))
    return dq, dk, dv, None if sinks is None else sink_grad(sinks, lse, delta)


# Quick backwards (module docstring): key -> (run, the plan maps and floors it was chosen
# under). A run takes (dout, q, k, v, out, lse) of the key's signature and returns (dq, dk, dv,
# None), or None where the addresses are not 16-byte aligned.
_QUICK: dict[tuple, tuple] = {}


def _quick(key: tuple) -> Callable | None:
    """The run kept for this key, or None: also where the plan maps it was chosen from were
    replaced since or the Hopper backward's eager floor changed (tests do either; ``forget``)."""
    return kept(_QUICK, key, _PLANS, _SM90, tuning.SM90_BWD_MIN_FLOPS)


def _keep(key: tuple, run: Callable | None) -> None:
    if run is not None:
        keep(_QUICK, key, run, _PLANS, _SM90, tuning.SM90_BWD_MIN_FLOPS)


def forget() -> None:
    """Drop every plan, choice and quick backward: the next call of each signature plans
    again."""
    _PLANS.clear()
    _SM90.clear()
    _QUICK.clear()


def _plain_call(q: torch.Tensor) -> bool:
    """What a quick backward needs of the call beyond its key: not captured, q's device the
    current one, no launch hook registered."""
    return (
        not runtime.capturing(q)
        and q.get_device() == torch.cuda.current_device()
        and no_launch_hooks()
    )


def _portable_quick(
    plan: tuple, device: int, dq_kernel: Launcher, dkdv_kernel: Launcher
) -> Callable | None:
    """The quick run of this portable plan's launches by these launchers (both made below
    ``Launcher``), or None."""
    (q_grid, _, q_meta), (kv_grid, _, kv_meta) = plan
    dq_launch = Bound.of(dq_kernel, q_grid, q_meta)
    dkdv_launch = Bound.of(dkdv_kernel, kv_grid, kv_meta)
    if dq_launch is None or dkdv_launch is None:
        return None
    return functools.partial(_run_portable, dq_launch, dkdv_launch, device)


def _run_portable(
    dq_launch: Bound, dkdv_launch: Bound, device: int, dout, q, k, v, out, lse
) -> tuple | None:
    """``launch``'s portable launches of a kept plan on these tensors (``_portable_quick``)."""
    a_q, a_k, a_v, a_out, a_dout, a_lse = (
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(), lse.data_ptr()
    )  # fmt: skip
    if (a_q | a_k | a_v | a_out | a_dout | a_lse) % 16:
        return None
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    delta = torch.empty_like(lse)
    a_delta = delta.data_ptr()
    stream = current_stream(device)
    # As ``launch`` passes them: the LSE stands in for dlse and the ALiBi slopes; no offsets.
    dq_launch(
        stream, (a_q, a_k, a_v, a_out, a_dout, a_lse, a_lse, a_delta, dq.data_ptr(), None, None,
                 a_lse),
    )  # fmt: skip
    dkdv_launch(
        stream, (a_q, a_k, a_v, a_dout, a_lse, a_delta, dk.data_ptr(), dv.data_ptr(), None, None,
                 a_lse),
    )  # fmt: skip
    return dq, dk, dv, None


def sink_grad(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient, fp32 ``(H,)``, from the LSE and delta (``rowsum(dO * O) - dlse``).

    The sink is a key with no value: its probability in row i is ``p_i = exp(sink - lse_i)``
    and its score gradient ``p_i * (0 - delta_i)`` (dP is 0 for a zero value), so
    ``dsinks[h] = -sum_i p_i delta_i`` over every row of head h. ``lse``/``delta`` are ``(B, H,
    Sq)`` or packed ``(H, total_q)``: heads are the second-to-last dim either way. A row with
    ``lse = -inf`` (no key and a sink of -inf) contributes 0.
    """
    p = torch.exp(sinks[:, None] - lse)
    p = torch.where(lse == float("-inf"), 0.0, p)
    heads_dim = lse.dim() - 2
    return -(p * delta).sum(dim=[d for d in range(lse.dim()) if d != heads_dim])


# Launch plans by problem signature (see launch; bounded by ops.launch.cached), and whether the
# Hopper backward runs.
_PLANS: dict[tuple, tuple] = {}
_SM90: dict[tuple, bool] = {}


def _takes_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    window: tuple[int, int],
    alibi_slopes: torch.Tensor | None,
    varlen: pb.Varlen | None,
    capturing: bool = False,
) -> bool:
    """Whether ``launch`` runs the Hopper backward on a device where it may (``use_tier("sm90")``
    or ``tuning.sm90_backward``'s choice, and ``bwd_sm90.supports``). A packed batch is judged
    by its mean lengths, as the forward's choice (``ops/fwd.py: _sm90_plan``); ``capturing``:
    into a CUDA graph, where the host's cost of a call is paid once."""
    from flashcore.ops import bwd_sm90, fwd_sm90

    head_dim = fwd_sm90.kernel_head_dim(q.shape[-1])  # 128 for fwd_sm90.PADDED_HEAD_DIMS
    dims = pb.problem_dims(q, k, varlen)
    if varlen is None:
        lengths = q.shape[2], k.shape[2]
    else:
        lengths = q.shape[0] / dims.batch, k.shape[0] / dims.batch
    work = sm90_backward_work(
        dims.batch, dims.heads, dims.kv_heads, *lengths, head_dim, causal,
        bwd_sm90.ROWS, bwd_sm90.BLOCK_N,
    )  # fmt: skip
    wanted = runtime.tier_forced() or sm90_backward(
        *lengths, head_dim, work, causal, capturing, varlen=varlen is not None
    )
    return wanted and bwd_sm90.supports(
        q, k, v, dq, dk, dv, window=window, alibi=alibi_slopes, varlen=varlen is not None
    )


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    scale: float,
    varlen: pb.Varlen | None,
    config: BwdConfig | None,
    window: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    stride_ab: int,
    dims: pb.Dims,
) -> tuple:
    """``(grid, arguments after the pointers, constexprs)`` of the dQ and dK/dV launches of
    ``launch``."""
    batch, heads, kv_heads, seqlen_q, seqlen_k = dims
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    interpreted = runtime.is_interpreted()
    block_d, block_d2 = d_panels(head_dim, q.dtype)
    # Tiles sized for the wider of the two head dims.
    cfg = config or bwd_config(
        max(head_dim, head_dim_v),
        q.element_size(),
        interpreted=interpreted,
        causal=causal,
        seqlen_q=seqlen_q,
        capability=runtime.capability(q.device),
        head_dim_v=head_dim_v if head_dim_v != head_dim else None,
        panels=block_d2 > 0,
    )
    # The backward recomputes the forward's scores in the forward's units (kernels/bwd.py, "LSE
    # base"): base 2, natural for fp32.
    exp_e = pb.uses_exp_e(q.dtype, interpreted)
    sc = pb.scores(
        causal, window, softcap, scale, alibi_slopes is not None, seqlen_q, seqlen_k, exp_e=exp_e
    )
    flags = dict(
        **pb.type_flags(q.dtype, head_dim, interpreted, head_dim_v), **sc.flags(), EXP_E=exp_e
    )
    flags["BLOCK_D"], flags["BLOCK_D2"] = block_d, block_d2

    def even(seqlen: int, block: int) -> bool:
        # Packed sequences have lengths of their own: every edge may be ragged.
        return varlen is None and seqlen % block == 0

    def meta(block_m: int, block_n: int, warps: int, stages: int) -> dict:
        """Constexprs of the dK/dV or dQ kernel."""
        return dict(
            **flags,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            EVEN_M=even(seqlen_q, block_m),
            EVEN_N=even(seqlen_k, block_n),
            IS_VARLEN=varlen is not None,
            ALIGN=align,
            num_warps=warps,
            num_stages=stages,
        )

    strides = functools.partial(pb.row_strides, varlen=varlen)
    # Row strides that are 16-byte multiples without being multiples of 16 elements (head dims
    # such as 56): declared to the kernels, which otherwise read such rows an element at a time.
    align = pb.stride_align(
        tuple(x for t in (q, k, v, out, dout, dq, dk, dv) for x in strides(t)), q.element_size()
    )
    if dlse is None:
        dlse_strides = (0, 0, 0)
    else:
        dlse_strides = dlse.stride() if varlen is None else (0, *dlse.stride())
    common = (*pb.stats_strides(lse, varlen), stride_ab)
    scalars = (
        heads // kv_heads, seqlen_q, seqlen_k, *pb.packed_totals(q, k, varlen), *sc.scalars(),
        float(scale),
    )  # fmt: skip
    dkdv = (
        (pb.cdiv(seqlen_k, cfg.block_n1) * batch * kv_heads,),
        (
            *strides(q), *strides(k), *strides(v), *strides(dout), *strides(dk), *strides(dv),
            *common, kv_heads, *scalars,
        ),
        meta(cfg.block_m1, cfg.block_n1, cfg.num_warps, cfg.num_stages),
    )  # fmt: skip
    dq_launch = (
        (pb.cdiv(seqlen_q, cfg.block_m2) * batch * heads,),
        (
            *strides(q), *strides(k), *strides(v), *strides(out), *strides(dout),
            *dlse_strides, *strides(dq), *common, heads, *scalars,
        ),
        dict(
            meta(cfg.block_m2, cfg.block_n2, cfg.dq_warps, cfg.dq_stages),
            HAS_DLSE=dlse is not None,
        ),
    )  # fmt: skip
    return dq_launch, dkdv
