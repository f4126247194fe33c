"""Host launcher of dK and dV at head dim 256 on Hopper (``kernels/hopper/bwd256.py``, Gluon).

``ops.bwd.launch`` runs the portable dQ kernel (which writes delta) and then, where ``takes``
says so, this kernel instead of the portable dK/dV kernel: an sm_90 GPU under a tier that may
run Gluon (``runtime.backward_tier``), head dim 256 for q, k and v, fp16/bf16, dense tensors
the copy engine can address, without softcap or ALiBi (causal, a window, GQA/MQA and sinks
are fine). The kernel writes dK and dV once per program, so the backward stays bit-identical
over runs (``deterministic=True`` takes it too).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from flashcore.ops import problem as pb
from flashcore.ops import runtime
from flashcore.ops.fwd_sm90 import box_layout, lpt_group, tma_ok
from flashcore.ops.launch import Descriptor, Launcher, cached

ROWS = 64  # keys a program and query rows a step (kernels/hopper/bwd256.py)
HEAD_DIM = 256
# On since the kernel ran right on a GPU (an H200, Triton 3.6: the `d256` GPU tests of
# tests/test_backward.py and tests/test_sinks.py, compute-sanitizer memcheck and synccheck
# clean). Everywhere it was timed it beat the portable dK/dV kernel (the whole backward
# 1.68-1.79x at 16k-32k tokens, S 1024-8192; docs/performance_backward.md, "Head dim 256"), so
# it is taken wherever it applies; tests force it either way.
VERIFIED = True
# Two Q/dO slots (64 KB each) beside K and V (32 KB each) and the P^T / dS^T tiles: 229856 B
# of the 232448 a block may use; 240 registers for each consumer, 24 for the producer, 168 at
# entry (12 warps).
NUM_STAGES = 2
CONSUMER_REGS = 240
MAXNREG = 168


@functools.cache
def kernel() -> Launcher:
    from flashcore.kernels.hopper import bwd256

    return Launcher(bwd256.attn_bwd_dkdv_sm90_d256_kernel, 8)


def takes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    softcap: float,
    alibi: torch.Tensor | None,
    varlen: pb.Varlen | None,
    verified: bool | None = None,
) -> bool:
    """Whether the dK/dV of this backward run here (module docstring). ``verified`` overrides
    ``VERIFIED`` (tests)."""
    if not (VERIFIED if verified is None else verified):
        return False
    if varlen is not None or softcap != 0.0 or alibi is not None:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.is_cuda:
        return False
    if not k.dtype == v.dtype == dout.dtype == q.dtype:
        return False
    if q.shape[-1] != HEAD_DIM or k.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return False
    if runtime.backward_tier(q.device) != "sm90":
        return False
    return all(tma_ok(t) for t in (q, k, v, dout))


class Plan(NamedTuple):
    grid: tuple[int]
    box: list[int]
    layout: object
    scalars: tuple
    meta: dict


_PLANS: dict[tuple, Plan] = {}


def _plan(q, k, lse, dk, dv, causal, scale, window) -> Plan:
    batch, heads, seqlen_q, _ = q.shape
    kv_heads, seqlen_k = k.shape[1], k.shape[2]
    sc = pb.scores(causal, window, 0.0, scale, False, seqlen_q, seqlen_k)
    lpt_heads = 1
    if sc.is_causal and not sc.has_window:
        # Heaviest key blocks first across heads, as the Hopper backward orders them.
        q_bytes = seqlen_q * 2 * HEAD_DIM * q.element_size()
        lpt_heads = lpt_group(batch * kv_heads, q_bytes)
    box = [1, 1, ROWS, HEAD_DIM]
    scalars = (
        *pb.stats_strides(lse, None), *dk.stride()[:3], *dv.stride()[:3], kv_heads,
        heads // kv_heads, seqlen_q, seqlen_k, lpt_heads, sc.qk_scale, float(scale),
        sc.window_left, sc.window_right,
    )  # fmt: skip
    meta = {
        "NUM_STAGES": NUM_STAGES,
        "CONSUMER_REGS": CONSUMER_REGS,
        "IS_CAUSAL": sc.is_causal,
        "HAS_WINDOW": sc.has_window,
        "EVEN_N": seqlen_k % ROWS == 0,
        "num_warps": 4,
        "maxnreg": MAXNREG,
    }
    grid = (math.ceil(seqlen_k / ROWS) * batch * kv_heads,)
    return Plan(grid, box, box_layout(tuple(box), q.dtype), scalars, meta)


def dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    scale: float,
    window: tuple[int, int],
) -> None:
    """dK and dV into ``dk``, ``dv`` (shaped like k, v; unit stride on the head dim) for a problem
    ``takes`` accepted: ``q``, ``dout`` ``(B, H, Sq, 256)``, ``k``, ``v`` ``(B, Hkv, Sk, 256)``,
    ``lse`` the forward's natural-log fp32 ``(B, H, Sq)`` and ``delta`` (``rowsum(dO * O) -
    dlse``, as the portable dQ kernel writes it) with its strides; ``window`` in
    ``ops.problem.effective_window``'s form."""
    key = (
        q.shape, k.shape, q.dtype, q.device, lse.stride(), delta.stride(), dk.stride(),
        dv.stride(), causal, scale, window,
    )  # fmt: skip
    p = _PLANS.get(key)
    if p is None:
        p = cached(_PLANS, key, lambda: _plan(q, k, lse, dk, dv, causal, scale, window))
    if delta.stride() != lse.stride():
        raise ValueError("delta must have lse's strides")
    descs = tuple(Descriptor(t, p.box, p.layout) for t in (q, k, v, dout))
    with runtime.launch_on(q):
        kernel()(p.grid, (*descs, lse, delta, dk, dv, *p.scalars), p.meta, planned=True)
