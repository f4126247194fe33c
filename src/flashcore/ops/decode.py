"""Decode launcher: picks the config and split count, allocates the workspace, launches.

The split-KV kernel and its combine live in ``flashcore.kernels.decode``. With one split the
first kernel writes ``out``/``lse`` directly (its split stride is 0) and the combine is skipped.
"""

from __future__ import annotations

import functools

import torch

from flashcore.ops import problem as pb
from flashcore.ops import runtime
from flashcore.ops.launch import Launcher
from flashcore.tuning import (
    INTERPRETER_SMS,
    MAX_SPLITS,
    decode_block_m,
    decode_config,
    decode_num_splits,
)


@functools.cache
def kernels() -> tuple[Launcher, Launcher]:
    """Launchers of the split-KV kernel and of its combine."""
    return (
        runtime.kernel("decode", "attn_decode_kernel", 9),
        runtime.kernel("decode", "attn_decode_combine_kernel", 4),
    )


def choose_num_splits(
    batch: int,
    kv_heads: int,
    capacity: int,
    head_dim: int,
    elem_size: int,
    device: torch.device,
    *,
    paged: bool = False,
    rows: int = 16,
) -> int:
    """The split count ``num_splits=None`` resolves to (see ``tuning.decode_num_splits``);
    ``batch`` counts row tiles too (a prefill chunk of several), ``rows`` is a tile's."""
    cfg = decode_config(
        head_dim, elem_size, interpreted=runtime.is_interpreted(), paged=paged, rows=rows,
        capacity=capacity,
    )  # fmt: skip
    return decode_num_splits(batch * kv_heads, capacity, cfg.block_n, _sms(device), paged=paged)


def _sms(device: torch.device) -> int:
    """The SM count the split count aims at (a fixed small count under the interpreter)."""
    if runtime.is_interpreted() or device.type != "cuda":
        return INTERPRETER_SMS
    return runtime.num_sms(device)


def launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    scale: float,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the decode kernels on validated inputs; returns ``(out, lse)``.

    ``window_left``/``window_right``: -1 is unbounded; ``softcap`` 0 is off; ``num_splits`` 0
    chooses. ``alibi_slopes`` is None or fp32 ``(H,)`` or ``(B, H)``; ``sinks`` None or fp32
    ``(H,)``. ``out`` is contiguous
    ``(B, H, Sq, Dv)`` in q's dtype (Dv: v_cache's head dim), ``lse`` fp32 ``(B, H, Sq)``.
    """
    q, k_cache, v_cache = (pb.unit_stride_last_dim(t) for t in (q, k_cache, v_cache))
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, head_dim_v = k_cache.shape[1], v_cache.shape[-1]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    out = torch.empty((batch, heads, seqlen_q, head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if capacity == 0 or k_cache.shape[0] == 0:
        # No key anywhere; the cache has no storage to launch on.
        if sinks is not None:
            return out.zero_(), lse.copy_(sinks[:, None].expand_as(lse))
        return out.zero_(), lse.fill_(float("-inf"))

    interpreted = runtime.is_interpreted()
    # Tiles sized for the wider of the two head dims.
    width = max(head_dim, head_dim_v)
    kv_group = heads // kv_heads
    # Row tiles of the packed (query, head) rows: one for decoding, more for a prefill chunk.
    block_m = decode_block_m(kv_group, seqlen_q)
    row_tiles = pb.cdiv(kv_group * seqlen_q, block_m)
    cfg = decode_config(
        width, q.element_size(), interpreted=interpreted, paged=paged, rows=block_m,
        capacity=capacity,
    )  # fmt: skip
    if num_splits == 0:
        num_splits = decode_num_splits(
            batch * row_tiles * kv_heads, capacity, cfg.block_n, _sms(q.device), paged=paged
        )
    # Splits past the longest possible sequence would only write empty partials; more than
    # MAX_SPLITS would make the combine's (splits, D) tile spill.
    num_splits = max(1, min(num_splits, pb.cdiv(capacity, cfg.block_n), MAX_SPLITS))
    exp_e = pb.uses_exp_e(q.dtype, interpreted)
    # Sequence lengths live on the device; the capacity bounds them all (problem.window_bounds).
    sc = pb.scores(
        causal, (window_left, window_right), softcap, scale, alibi_slopes is not None,
        seqlen_q, capacity, exp_e=exp_e,
    )  # fmt: skip

    if num_splits == 1:
        o_part, lse_part = out, lse
        part_strides = (0, *out.stride()[:3]), (0, *lse.stride())
    else:
        o_part = torch.empty(
            (num_splits, batch, heads, seqlen_q, head_dim_v), dtype=torch.float32, device=q.device
        )
        lse_part = torch.empty(
            (num_splits, batch, heads, seqlen_q), dtype=torch.float32, device=q.device
        )
        part_strides = o_part.stride()[:4], lse_part.stride()
    # Unused pointer arguments get a real tensor: the flags compile their loads away.
    table = block_table if paged else cache_seqlens
    if paged and k_cache.shape[2] % cfg.block_n:
        # PAGED 1 reads the entries as they are: clamp them to the cache's pages here.
        table = block_table.clamp(0, k_cache.shape[0] - 1)
    slopes, stride_ab = pb.alibi_arg(alibi_slopes, lse)
    flags = pb.type_flags(q.dtype, head_dim, interpreted, head_dim_v)
    split_kernel, combine_kernel = kernels()
    with runtime.launch_on(q):
        split_kernel(
            (batch * kv_heads, num_splits, row_tiles),
            (
                q, k_cache, v_cache, o_part, lse_part, cache_seqlens, table, slopes, sinks,
                *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
                *part_strides[0], *part_strides[1], table.stride(0), stride_ab,
                kv_heads, kv_group, seqlen_q, capacity, k_cache.shape[2] if paged else 1,
                k_cache.shape[0] if paged else 1, num_splits, *sc.scalars(),
            ),
            dict(
                **flags,
                **sc.flags(),
                BLOCK_M=block_m,
                BLOCK_N=cfg.block_n,
                EVEN_M=kv_group * seqlen_q % block_m == 0,
                # 2: every key tile lies in one page (kernels/decode.py).
                PAGED=0 if not paged else 2 if k_cache.shape[2] % cfg.block_n == 0 else 1,
                EXP_E=exp_e,
                HAS_SINKS=sinks is not None,
                num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            ),
        )  # fmt: skip
        if num_splits > 1:
            combine_kernel(
                (batch * heads * seqlen_q,),
                (
                    o_part, lse_part, out, lse,
                    *o_part.stride()[:4], *lse_part.stride(), *out.stride()[:3], *lse.stride(),
                    heads, seqlen_q, num_splits,
                ),
                dict(
                    HEAD_DIM=head_dim_v,
                    BLOCK_D=flags["BLOCK_DV"],
                    BLOCK_S=max(2, pb.next_pow2(num_splits)),
                    num_warps=4,
                ),
            )  # fmt: skip
    return out, lse
