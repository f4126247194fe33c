"""Host launcher of the head-dim-256 backward on Hopper (``kernels/hopper/bwd256*.py``, Gluon),
which runs MLA's head dims (q and k 192, v 128) too.

``ops.bwd.launch`` runs it instead of the portable kernels where ``takes`` says so: an sm_90 GPU
under a tier that may run Gluon (``runtime.backward_tier``), head dim 256 (or 136-248 in steps
of 8, run as 256) for q, k and v, or MLA's (192, 128) (causal, non-causal at any length where
the 128-key kernel runs, otherwise from 2048 keys); fp16/bf16,
tensors the copy engine can address, dense or packed (causal, a window, softcap, ALiBi, GQA/MQA,
an LSE gradient and sinks are all fine). Three launches: the Hopper backward's prep kernel
(delta and lse2), the dQ kernel and the dK/dV kernel, each gradient written once per program, so
the backward is bit-identical over runs (``deterministic=True`` takes it too). MLA's head dims,
unless ``deterministic``: the prep kernel, a zeroed fp32 dQ accumulator, the dK/dV kernel with
dQ reduce-added (``FUSED_MLA``) and the conversion into dq; without a window, softcap or ALiBi
the dK/dV kernel is ``kernels/hopper/bwd_mla.py``'s, 128 keys a program (``WIDE_MLA``; packed
batches too, ``WIDE_MLA_VARLEN``), with the same arguments.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from flashcore.ops import bwd_sm90, runtime
from flashcore.ops import problem as pb
from flashcore.ops.fwd_sm90 import MLA_HEAD_DIMS, box_layout, packed_view, tma_ok
from flashcore.ops.fwd_sm90_configs import lpt_group
from flashcore.ops.launch import Descriptor, Launcher, cached

ROWS = 64  # keys a program and query rows a step (kernels/hopper/bwd256.py)
HEAD_DIM = 256
# On since the kernels ran right on a GPU (an H200, Triton 3.6: the `d256` GPU tests of
# tests/test_backward_d256.py and tests/test_sinks.py, softcap, ALiBi and head dims 136-248 among
# them; compute-sanitizer memcheck and synccheck clean). Everywhere it was timed the backward beat
# the portable one (1.6-2.0x at S 1024-8192, 32k tokens, with softcap too; head dim 192 1.9x;
# docs/performance_backward.md, "Head dim 256"), so it is taken wherever it applies; tests force
# it either way.
VERIFIED = True
# MLA's head dims (192, 128) with dQ in the dK/dV kernel (FUSED_MLA below), against the portable
# backward (H200, bf16, 16 heads; docs/performance_backward.md, "MLA's dQ in the dK/dV kernel"):
# causal 1.14-1.18x at 4096-8192 keys, 1.04-1.05x at 2048; non-causal 1.05-1.11x at 4096-8192,
# 1.01-1.02x at 2048 and 0.91-0.94x at 1024 (an earlier build). Non-causal runs here from
# MLA_NON_CAUSAL_MIN_SEQLEN keys, or at every length where the 128-key kernel (WIDE_MLA below)
# takes it: 1.04-1.05x the portable backward at 512 keys, 1.15-1.16x at 1024, 1.23x at 2048
# (H200, bf16, 16 heads, scripts/mla_bwd_ab.py --short). Tests set MLA_NON_CAUSAL to run these
# kernels at every length.
MLA_NON_CAUSAL = False
MLA_NON_CAUSAL_MIN_SEQLEN = 2048
# Two ring slots (64 KB each: Q and dO for the dK/dV kernel, K and V for the dQ kernel) beside
# the resident pair (32 KB each) and the P (and, dQ kernel, dS) tiles: 213,376 B (dK/dV) and
# 229,840-229,856 B (dQ) of the 232,448 a block may use; 240 registers for each consumer, 24
# for the producer, 168 at entry (12 warps).
NUM_STAGES = 2
# MLA's (192, 128): a ring slot is 40 KB (Q or K at 24, dO or V at 16), and three fit (176 KB in
# the dK/dV kernel, 192 KB in the dQ kernel).
MLA_STAGES = 3
# MLA's dQ in the dK/dV kernel (FUSED_DQ: dQ = dS K on both consumers, reduce-added by the copy
# engine into an fp32 accumulator, then scaled and cast by the Hopper backward's conversion
# kernel), instead of the dQ kernel: the dS^T tiles (16 KB) and the fp32 staging tiles (48 KB)
# leave room for two ring slots (204,864 B). Its dQ is summed by atomic reduce-adds, so its
# last bits may vary between runs: ``deterministic`` keeps the dQ kernel.
FUSED_MLA = True
FUSED_STAGES = 2
# MLA's fused backward at 128 keys a program (kernels/hopper/bwd_mla.py: half the L2 traffic a
# key of the 64-key kernel's; 1.12-1.22x its speed at 2048-8192 keys, H200,
# docs/performance_backward.md, "MLA's backward at 128 keys a program") where it applies: no
# window, softcap or ALiBi (packed batches with WIDE_MLA_VARLEN). Tests set it either way.
WIDE_MLA = True
# Packed batches through it too (H200, bf16, 16 heads, packed 4 x 2048, 3000/1000/2500/1692 and
# one 8192: 1.11-1.28x the 64-key kernel non-causal, 1.01-1.11x causal).
WIDE_MLA_VARLEN = True
# Causal: consumer 1 of the 128-key kernel skips the products of a step that sees none of its
# keys (a block's first; its dS^T tile written as zeros), 10 of the step's 26 units of 64^3:
# 1.02-1.04x at 512-2048 keys, 0.99-1.01x at 4096-8192 (H200, bf16, 16 heads,
# scripts/mla_bwd_ab.py --paths wide-noskip,wide-skip). Tests set it either way.
WIDE_SKIP_MASKED = True
# The 128-key kernel's exponent S^T qk_scale - lse2 formed before the masks' run-time branches
# (causal, or Sk not a multiple of 128), so that its unmasked steps take one FFMA an element as
# the unbranched build does, not an FMUL and an FADD either side of the branch: causal 1.01-1.02x
# at 2048-8192 keys (H200, bf16, 16 heads, scripts/mla_bwd_ab.py --paths wide,wide-nomexp
# --rotate 7; docs/performance_backward.md). Tests set it either way.
WIDE_MASK_EXPONENT = True
# The 128-key kernel's fixed tiles' wgmma descriptors formed in its step loop instead of before it
# (``kernels/hopper/bwd_mla.py``, FRESH_DESC; sm_90a: no local accesses left in the non-causal
# step loops, 10% fewer instructions a step). H200, bf16, 16 heads, scripts/mla_bwd_ab.py
# --rotate 5, against the path without it ("wide-nofresh" now): non-causal 1.04-1.05x, causal
# 1.09-1.10x at 2048-8192 keys (docs/performance_backward.md). Tests set it either way.
WIDE_FRESH_DESC = True
# Causal: the 128-key kernel's steps that the diagonal crosses in a loop of their own, the others
# in one built as the non-causal step (``kernels/hopper/bwd_mla.py``, SPLIT_DIAG; sm_90a: 565 / 516
# instructions a step there against 635 / 613). H200, bf16, 16 heads, kernel time by
# torch.profiler: 1.02x at 512 keys, 1.04x at 1024, 1.05x at 2048, 1.07x at 4096; scripts/
# mla_bwd_ab.py --rotate 5 at 2048-8192 keys 1.02-1.05x (docs/performance_backward.md). Tests set
# it either way.
WIDE_SPLIT_DIAG = True
# dK and dV through the K and V tiles and TMA stores (as bwd.py's) instead of 4-byte stores
# from registers, which cost the 128-key kernel 43-64 us at 1024 programs (H200,
# docs/performance_backward.md, "MLA's backward: packed batches, every length, ..."), in the
# 128-key kernel (WIDE_TMA_EPILOGUE) and the 64-key dK/dV kernel (DKDV_TMA_EPILOGUE). H200,
# bf16, 16 heads, scripts/mla_bwd_ab.py, each path bracketed by its register-store twin: 128-key
# 1.05-1.11x non-causal at 1024-8192 keys, causal 0.96-1.03x; 64-key 1.02-1.08x at 1024-8192
# keys; head dim 256 1.00-1.09x at 512-8192 (docs/performance_backward.md). Tests set them either
# way.
WIDE_TMA_EPILOGUE = True
DKDV_TMA_EPILOGUE = True
CONSUMER_REGS = 240
MAXNREG = 168


def fused(head_dim: int, head_dim_v: int, deterministic: bool) -> bool:
    """Whether MLA's dQ is computed in the dK/dV kernel (``FUSED_MLA``, not ``deterministic``)."""
    return FUSED_MLA and not deterministic and (head_dim, head_dim_v) == MLA_HEAD_DIMS


@functools.cache
def kernels() -> tuple[Launcher, Launcher, Launcher]:
    """Launchers of the row-stats kernel (the Hopper backward's own launcher of it), the dQ and
    the dK/dV kernels."""
    from flashcore.kernels.hopper import bwd256, bwd256_dq

    return (
        bwd_sm90.kernels()[0],
        Launcher(bwd256_dq.attn_bwd_dq_sm90_d256_kernel, 10),
        Launcher(bwd256.attn_bwd_dkdv_sm90_d256_kernel, 16),
    )


@functools.cache
def wide_kernel() -> Launcher:
    """Launcher of MLA's 128-key kernel (``kernels/hopper/bwd_mla.py``)."""
    from flashcore.kernels.hopper import bwd_mla

    return Launcher(bwd_mla.attn_bwd_mla_sm90_kernel, 16)


def wide(fused_dq: bool, sc: pb.Scores, has_alibi: bool, varlen: pb.Varlen | None) -> bool:
    """Whether MLA's fused backward runs at 128 keys a program (``WIDE_MLA``): the options that
    kernel covers only (packed batches with ``WIDE_MLA_VARLEN``)."""
    return (
        WIDE_MLA and fused_dq and not (sc.has_window or sc.has_softcap or has_alibi)
        and (varlen is None or WIDE_MLA_VARLEN)
    )  # fmt: skip


def takes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    alibi: torch.Tensor | None,
    varlen: pb.Varlen | None,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
) -> bool:
    """Whether this backward runs here (module docstring; tests set ``VERIFIED`` and
    ``MLA_NON_CAUSAL``). ``causal`` and ``window`` as ``ops.problem.effective_window`` gives
    them; ``deterministic`` as the backward will run."""
    if not VERIFIED:
        return False
    if (q.shape[-1], v.shape[-1]) == MLA_HEAD_DIMS and not (causal or MLA_NON_CAUSAL):
        seqlen_q, seqlen_k = pb.problem_dims(q, k, varlen)[3:]
        if seqlen_k < MLA_NON_CAUSAL_MIN_SEQLEN:
            # Shorter, only where MLA's 128-key kernel runs (non-causal at every length).
            sc = pb.scores(causal, window, softcap, 1.0, alibi is not None, seqlen_q, seqlen_k)
            if not wide(fused(*MLA_HEAD_DIMS, deterministic), sc, alibi is not None, varlen):
                return False
    if alibi is not None and alibi.dtype != torch.float32:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.is_cuda:
        return False
    if not k.dtype == v.dtype == dout.dtype == q.dtype:
        return False
    if k.shape[-1] != q.shape[-1] or not takes_head_dims(q.shape[-1], v.shape[-1]):
        return False
    if runtime.backward_tier(q.device) != "sm90":
        return False
    if varlen is not None:
        # Packed (total, heads, D) tensors, addressed as (1, heads, total, D) views.
        return q.dim() == 3 and all(tma_ok(packed_view(t)) for t in (q, k, v, dout))
    return all(tma_ok(t) for t in (q, k, v, dout))


def takes_head_dims(head_dim: int, head_dim_v: int) -> bool:
    """Whether these kernels run head dims ``(head_dim, head_dim_v)`` (q and k's, v's): 256, and
    136-248 in steps of 8 (the forward's padded ones, over the same 256-column boxes: the columns
    past the tensors' load as zeros and are not stored), v's equal; or MLA's (192, 128)."""
    if (head_dim, head_dim_v) == MLA_HEAD_DIMS:
        return True
    return head_dim == head_dim_v and HEAD_DIM // 2 < head_dim <= HEAD_DIM and head_dim % 8 == 0


def _tiles(head_dim: int, head_dim_v: int) -> tuple[int, int, int, int]:
    """``(QK_A, QK_B, Q/K box width, V tile and box width)`` for ``takes_head_dims``' head dims:
    MLA's Q and K in a 128- and a 64-column tile, by 64-column boxes (a box and a tile are a
    power of two wide), V at 128; the others in one 256-column tile and box each."""
    if (head_dim, head_dim_v) == MLA_HEAD_DIMS:
        return 128, 64, 64, head_dim_v
    return HEAD_DIM, 0, HEAD_DIM, HEAD_DIM


class Plan(NamedTuple):
    rows: int  # B * H * Sq_pad: each row-stat buffer's length
    prep: tuple  # (grid, scalars, meta) of bwd_prep_kernel
    dq: tuple  # (grid, scalars, meta) of the dQ kernel, or with ``acc`` of the conversion
    dkdv: tuple  # (grid, scalars, meta) of the dK/dV kernel
    boxes: tuple[list[int], list[int]]  # Q and K's, V and dO's
    layouts: tuple[object, object]
    acc: tuple | None  # FUSED_DQ: the fp32 dQ accumulator's shape, its two boxes, their layout
    wide: bool  # MLA's 128-key kernel in place of the dK/dV kernel (``wide``)


_PLANS: dict[tuple, Plan] = {}


def _plan(
    q, k, out, dout, lse, dlse, dq, dk, dv, causal, scale, window, softcap, stride_ab, has_alibi,
    varlen, fused_dq,
) -> Plan:  # fmt: skip
    batch, heads, kv_heads, seqlen_q, seqlen_k = pb.problem_dims(q, k, varlen)
    head_dim, head_dim_v = q.shape[-1], dout.shape[-1]
    qk_a, qk_b, qk_box, v_tile = _tiles(head_dim, head_dim_v)
    total_q, total_k = pb.packed_totals(q, k, varlen)
    # The prep kernel and the row stats see one sequence of total_q rows when packed.
    rows_b, rows_q = (batch, seqlen_q) if varlen is None else (1, total_q)
    seqlen_pad = math.ceil(rows_q / ROWS) * ROWS
    sc = pb.scores(causal, window, softcap, scale, has_alibi, seqlen_q, seqlen_k)
    wide_mla = wide(fused_dq, sc, has_alibi, varlen)
    keys = bwd_sm90.BLOCK_N if wide_mla else ROWS  # the 128-key kernel walks bwd.py's blocks
    dlse_strides = (0, 0) if dlse is None else pb.stats_strides(dlse, varlen)
    prep = (
        (seqlen_pad // ROWS * rows_b * heads,),
        (
            *pb.row_strides(out, varlen), *pb.row_strides(dout, varlen), *dlse_strides,
            *pb.stats_strides(lse, varlen), heads, rows_q, seqlen_pad, 0,
        ),
        {
            "HEAD_DIM": head_dim_v, "BLOCK_D": v_tile, "BLOCK_M": ROWS,
            "HAS_DLSE": dlse is not None, "PDL": False, "num_warps": 4,
        },
    )  # fmt: skip
    # The row stats' batch and head strides (packed: batch 0, one sequence of all rows).
    stats = (0 if varlen is not None else heads * seqlen_pad, seqlen_pad)
    common = {
        "QK_A": qk_a,
        "QK_B": qk_b,
        "NUM_STAGES": (FUSED_STAGES if fused_dq else MLA_STAGES) if qk_b else NUM_STAGES,
        "CONSUMER_REGS": CONSUMER_REGS,
        "IS_CAUSAL": sc.is_causal,
        "HAS_WINDOW": sc.has_window,
    }
    flags = {"SOFTCAP": sc.has_softcap, "HAS_ALIBI": has_alibi, "VARLEN": varlen is not None}
    tail = (
        sc.qk_scale, float(scale), sc.softcap, sc.window_left, sc.window_right, head_dim, total_q,
        total_k,
    )  # fmt: skip
    q_lpt = kv_lpt = 1
    if sc.is_causal and not sc.has_window and varlen is None:
        # Heaviest blocks first across heads, as the Hopper kernels order them.
        tile_bytes = (qk_a + qk_b + v_tile) * k.element_size()
        q_lpt = lpt_group(batch * heads, seqlen_k * tile_bytes)
        kv_lpt = lpt_group(batch * kv_heads, seqlen_q * tile_bytes)
    meta = {"num_warps": 4, "maxnreg": MAXNREG}
    dq_launch = (
        (math.ceil(seqlen_q / ROWS) * batch * heads,),
        (
            stride_ab, *stats, *pb.row_strides(dq, varlen), heads, heads // kv_heads, seqlen_q,
            seqlen_k, q_lpt, *tail,
        ),
        {**common, **flags, **meta},
    )  # fmt: skip
    # dK and dV by TMA stores where the copy engine can address them (``WIDE_TMA_EPILOGUE``,
    # ``DKDV_TMA_EPILOGUE``).
    tma_epilogue = (WIDE_TMA_EPILOGUE if wide_mla else DKDV_TMA_EPILOGUE) and all(
        tma_ok(t if varlen is None else packed_view(t)) for t in (dk, dv)
    )
    dkdv_launch = (
        (math.ceil(seqlen_k / keys) * batch * kv_heads,),
        (
            stride_ab, *stats, *pb.row_strides(dk, varlen), *pb.row_strides(dv, varlen), kv_heads,
            heads // kv_heads, seqlen_q, seqlen_k, kv_lpt, *tail,
        ),
        {
            **common, "EVEN_N": varlen is None and seqlen_k % keys == 0, **flags,
            "FUSED_DQ": fused_dq, "TMA_EPILOGUE": tma_epilogue, **meta,
            **(
                {"SKIP_MASKED": WIDE_SKIP_MASKED, "MASK_EXPONENT": WIDE_MASK_EXPONENT,
                 "FRESH_DESC": WIDE_FRESH_DESC, "SPLIT_DIAG": WIDE_SPLIT_DIAG}
                if wide_mla
                else {}
            ),
        },
    )  # fmt: skip
    boxes = ([1, 1, ROWS, qk_box], [1, 1, ROWS, v_tile])
    acc = None
    if fused_dq:
        # (B, H, Sq, D) or, packed, (1, H, total_q, D): the conversion's rows a head as the
        # Hopper backward's (ops/bwd_sm90.py); the staging tiles' layout is its too.
        acc = (
            (rows_b, heads, rows_q, head_dim), [1, 1, ROWS, qk_a], [1, 1, ROWS, qk_b],
            bwd_sm90.dq_layout(HEAD_DIM),
        )  # fmt: skip
        dq_launch = (
            (math.ceil(rows_q / bwd_sm90.DQ_ROWS) * rows_b * heads,),
            (heads, rows_q, rows_q),
            {
                "HEAD_DIM": head_dim, "BLOCK_D": HEAD_DIM, "BLOCK_M": bwd_sm90.DQ_ROWS,
                "PDL": False, "num_warps": 4,
            },
        )  # fmt: skip
    return Plan(
        rows_b * heads * seqlen_pad, prep, dq_launch, dkdv_launch, boxes,
        tuple(box_layout(tuple(box), q.dtype) for box in boxes), acc, wide_mla,
    )  # fmt: skip


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    scale: float,
    window: tuple[int, int],
    softcap: float = 0.0,
    alibi: torch.Tensor | None = None,
    varlen: pb.Varlen | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Write the gradients of a problem ``takes`` accepted into ``dq``, ``dk``, ``dv`` (shaped
    like q, k, v; unit stride on the head dim) and return delta (``rowsum(dO * O) - dlse``,
    fp32, shaped like ``lse``: for the sinks' gradient). ``q`` ``(B, H, Sq, D)``, ``k``
    ``(B, Hkv, Sk, D)``, ``v`` ``(B, Hkv, Sk, Dv)``, ``out`` and ``dout`` ``(B, H, Sq, Dv)``
    (``takes_head_dims(D, Dv)``); ``lse`` the forward's natural-log fp32 ``(B, H, Sq)``, ``dlse``
    its gradient or None; ``window`` in ``ops.problem.effective_window``'s form; ``softcap`` (0:
    off) and ``alibi`` (fp32 ``(H,)`` or ``(B, H)`` slopes, or None) as ``flashcore.attention``
    takes them; ``varlen`` a packed batch (each tensor's batch and length dims as one of total
    rows: ``(total, heads, D)``; lse and dlse ``(H, total_q)``) or None. Three launches: the
    Hopper backward's prep kernel (delta and lse2 into padded fp32 row buffers), the dQ kernel,
    the dK/dV kernel; for MLA's head dims (``fused``, not ``deterministic``) the dK/dV kernel
    with dQ reduce-added into a zeroed fp32 accumulator, then the conversion into ``dq``."""
    fused_dq = fused(q.shape[-1], v.shape[-1], deterministic)
    key = (
        q.shape, k.shape, v.shape, q.dtype, q.device, out.stride(), dout.stride(), lse.stride(),
        None if dlse is None else dlse.stride(), dq.stride(), dk.stride(), dv.stride(), causal,
        scale, window, softcap, None if alibi is None else alibi.shape,
        None if varlen is None else pb.problem_dims(q, k, varlen), fused_dq,
    )  # fmt: skip
    alibi, stride_ab = pb.alibi_arg(alibi, lse)
    p = _PLANS.get(key)
    if p is None:
        p = cached(_PLANS, key, lambda: _plan(
            q, k, out, dout, lse, dlse, dq, dk, dv, causal, scale, window, softcap, stride_ab,
            key[-3] is not None, varlen, fused_dq,
        ))  # fmt: skip
    stats = torch.empty(2 * p.rows, device=q.device, dtype=torch.float32)
    delta, lse2 = stats.split_with_sizes((p.rows, p.rows))
    cu_q = cu_k = lse  # never read without varlen
    view = (lambda t: t) if varlen is None else packed_view
    if varlen is not None:
        cu_q, cu_k = varlen[:2]
    descs = tuple(
        Descriptor(view(t), p.boxes[i // 2], p.layouts[i // 2])
        for i, t in enumerate((q, k, v, dout))
    )
    prep, dq_kernel, dkdv_kernel = kernels()
    with runtime.launch_on(q):
        grid, scalars, meta = p.prep
        # The dQ accumulator's rows (0 of them) are never written; delta stands in.
        args = (out, dout, lse if dlse is None else dlse, lse, delta, lse2, delta, *scalars)
        prep(grid, args, meta, planned=True)
        if p.acc is None:
            grid, scalars, meta = p.dq
            dq_kernel(
                grid, (*descs, lse2, delta, dq, alibi, cu_q, cu_k, *scalars), meta, planned=True
            )
            # Stand-ins for the dQ accumulator's descriptors (never touched without FUSED_DQ).
            acc_descs = descs[:2]
        else:
            acc_shape, box_a, box_b, acc_layout = p.acc
            dq_acc = torch.zeros(acc_shape, device=q.device, dtype=torch.float32)
            acc_descs = (
                Descriptor(dq_acc, box_a, acc_layout),
                Descriptor(dq_acc, box_b, acc_layout),
            )
        grid, scalars, meta = p.dkdv
        # The TMA epilogue's descriptors: dK's first QK_A columns in a box of V's shape (MLA:
        # 128 wide; head dim 256: K's too), its last QK_B in K's, dV in V's. Without it V's,
        # K's and V's stand in (never touched).
        grad_descs = (descs[2], descs[1], descs[2])
        if meta["TMA_EPILOGUE"]:
            grad_descs = tuple(
                Descriptor(view(t), p.boxes[i], p.layouts[i])
                for t, i in ((dk, 1), (dk, 0), (dv, 1))
            )
        (wide_kernel() if p.wide else dkdv_kernel)(
            grid, (*descs, *acc_descs, lse2, delta, dk, dv, alibi, cu_q, cu_k, *grad_descs,
                   *scalars), meta, planned=True,
        )  # fmt: skip
        if p.acc is not None:
            # The dK/dV kernel accumulates dQ unscaled; the conversion scales and casts it.
            grid, scalars, meta = p.dq
            strides = bwd_sm90.dq_strides(dq, varlen is not None)
            bwd_sm90.dq_kernel()(grid, (dq_acc, dq, scale, *strides, *scalars), meta, planned=True)
    # Shaped like lse: (B, H, Sq) or, packed, (H, total_q).
    return delta.view(*lse.shape[:-1], -1)[..., : lse.shape[-1]]
