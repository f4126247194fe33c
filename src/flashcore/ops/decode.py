"""Decode launcher: picks the config and split count, allocates the workspace, launches.

The split-KV kernel and its combine live in ``flashcore.kernels.decode``. With one split the
first kernel writes ``out``/``lse`` directly (its split stride is 0) and the combine is skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from flashcore.ops import fwd, runtime
from flashcore.ops import problem as pb
from flashcore.ops.fwd import paged_mode
from flashcore.ops.launch import (
    Bound,
    Launcher,
    cached,
    current_stream,
    keep,
    kept,
    no_launch_hooks,
)
from flashcore.tuning import (
    INTERPRETER_SMS,
    KVCACHE_PACKED_MIN_SEQLEN_Q,
    MAX_SPLITS,
    decode_block_m,
    decode_combine_warps,
    decode_config,
    decode_num_splits,
    head_block,
)


@functools.cache
def kernels() -> tuple[Launcher, Launcher]:
    """Launchers of the split-KV kernel and of its combine."""
    return (
        runtime.kernel("decode", "attn_decode_kernel", 9),
        runtime.kernel("decode", "attn_decode_combine_kernel", 4),
    )


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
    learn: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the decode kernels on validated inputs; returns ``(out, lse)``.

    ``window_left``/``window_right``: -1 is unbounded; ``softcap`` 0 is off; ``num_splits`` 0
    chooses. ``alibi_slopes`` is None or fp32 ``(H,)`` or ``(B, H)``; ``sinks`` None or fp32
    ``(H,)``. ``out`` is contiguous
    ``(B, H, Sq, Dv)`` in q's dtype (Dv: v_cache's head dim), ``lse`` fp32 ``(B, H, Sq)``.
    Everything but the tensors (configs, split count, grids, strides, scalars, constexprs) is
    built once per problem signature (``_plan``): tens of microseconds of Python a call
    otherwise, more than the kernels at short caches (docs/performance_host.md).

    ``learn``: a key of ``ops.express`` for this call (no ALiBi or softcap),
    under which its launches are kept for later calls of the same signature (``learned``).
    """
    given = (q, k_cache, v_cache, cache_seqlens, block_table)
    q, k_cache, v_cache = (pb.unit_stride_last_dim(t) for t in (q, k_cache, v_cache))
    # The kernel reads length b at ``base + b`` and block-table rows as ``base + j``: strided
    # views of either are copied (tests/test_decode.py: test_decode_strided_index_tensors).
    cache_seqlens = pb.unit_stride_last_dim(cache_seqlens)
    if q.shape[2] >= KVCACHE_PACKED_MIN_SEQLEN_Q and packed_prefill_wanted(q, k_cache, block_table):
        return packed_prefill(
            q, k_cache, v_cache, cache_seqlens, block_table, causal, scale,
            window=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes,
            sinks=sinks,
        )  # fmt: skip
    paged = block_table is not None
    if paged:
        block_table = pb.unit_stride_last_dim(block_table)
    options = (causal, scale, window_left, window_right, softcap, num_splits, sinks is not None)
    key = (
        q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.shape, v_cache.stride(),
        q.dtype, q.device, (block_table.shape, block_table.stride(0)) if paged else None,
        None if alibi_slopes is None else (alibi_slopes.shape, alibi_slopes.stride()),
        options, runtime.is_interpreted(),
    )  # fmt: skip
    p = _PLANS.get(key)
    if p is None:
        p = cached(
            _PLANS, key, lambda: _plan(q, k_cache, v_cache, block_table, alibi_slopes, options)
        )
    if p.empty or p.no_keys:
        out = torch.empty(p.out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(p.out_shape[:3], dtype=torch.float32, device=q.device)
        if p.empty:
            return out, lse
        if sinks is not None:
            return out.zero_(), lse.copy_(sinks[:, None].expand_as(lse))
        return out.zero_(), lse.fill_(float("-inf"))
    with runtime.launch_on(q):
        out, lse = _run(p, q, k_cache, v_cache, cache_seqlens, block_table, alibi_slopes, sinks)
    if learn is not None and pb.used_as_given(
        given, (q, k_cache, v_cache, cache_seqlens, block_table)
    ):
        run = _quick(p, q.get_device()) if q.is_cuda else None
        keep(_LEARNED, learn, run or functools.partial(_run, p), _PLANS)
    return out, lse


def _run(
    p: Plan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    lse_wanted: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate ``(out, lse)`` and launch ``p`` on these tensors (on the current device).
    ``lse_wanted`` changes nothing here (``_run_quick`` takes it)."""
    # empty_like and new_empty parse fewer arguments than torch.empty: 2.1-4.2, 3.1-6.0 and
    # 4.0-7.0 us a call on the H200 machine's host (docs/performance_host.md).
    out = torch.empty_like(q) if p.out_like_q else q.new_empty(p.out_shape)
    lse = q.new_empty(p.out_shape[:3], dtype=torch.float32)
    if p.num_splits == 1:
        o_part, lse_part = out, lse
    else:
        o_part = q.new_empty(p.part_shape, dtype=torch.float32)
        lse_part = q.new_empty(p.part_shape[:4], dtype=torch.float32)
    # Unused pointer arguments get a real tensor: the flags compile their loads away.
    paged = block_table is not None
    table = block_table if paged else cache_seqlens
    slopes = lse if alibi_slopes is None else alibi_slopes.contiguous()
    split_kernel, combine_kernel = kernels()
    split_kernel(
        p.grid,
        (
            q, k_cache, v_cache, o_part, lse_part, cache_seqlens, table, slopes, sinks,
            *p.split_scalars[0], table.stride(0), *p.split_scalars[1],
        ),
        p.split_meta,
        planned=True,
    )  # fmt: skip
    if p.num_splits > 1:
        combine_kernel(
            p.combine_grid, (o_part, lse_part, out, lse, *p.combine_scalars), p.combine_meta,
            planned=True,
        )  # fmt: skip
    return out, lse


def _quick(p: Plan, device: int) -> Callable | None:
    """The quick run of plan ``p`` (``_run_quick``), whose launches were made below
    ``Launcher`` on CUDA device ``device``, or None (``ops.launch.Bound.of``). Its workspace: the
    splits' partial outputs, their LSEs and an LSE the caller does not want, in one fp32
    allocation, each part at a 16-byte boundary."""
    split_kernel, combine_kernel = kernels()
    split = Bound.of(split_kernel, p.grid, p.split_meta)
    if split is None:
        return None
    combine = None
    if p.num_splits > 1:
        combine = Bound.of(combine_kernel, p.combine_grid, p.combine_meta)
        if combine is None:
            return None
    # Rows (B * H * Sq) rounded up to 4: every part then starts at a multiple of 16 bytes.
    rows = pb.cdiv(p.out_shape[0] * p.out_shape[1] * p.out_shape[2], 4) * 4
    if p.num_splits == 1:
        parts = (0, 0, rows)
    else:
        parts = (p.num_splits * rows * p.out_shape[3], p.num_splits * rows, rows)
    return functools.partial(_run_quick, split, combine, device, p, parts)


def _run_quick(
    split: Bound,
    combine: Bound | None,
    device: int,
    p: Plan,
    parts: tuple[int, int, int],
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    lse_wanted: bool = True,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_run(p, ...)`` without ``Launcher``: both kernels' native launchers called with this
    call's addresses (the launches ``_quick`` bound; ``sinks``' too where given), the splits'
    partials (and the LSE, unless ``lse_wanted``) in one workspace. Returns ``(out, lse)``, lse
    None where not wanted. Takes ``_run`` where a launch hook is registered or an address is
    not 16-byte aligned (the bound kernels were compiled for aligned ones). Measured on the
    H200 machine's host:
    docs/performance_host.md, "Quick decode launches"."""
    a_q, a_k, a_v, a_len = (
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), cache_seqlens.data_ptr()
    )  # fmt: skip
    # As ``_run`` passes it: the lengths stand in for an absent table (PAGED is off).
    a_table = a_len if block_table is None else block_table.data_ptr()
    if (a_q | a_k | a_v | a_len | a_table) % 16 or not no_launch_hooks():
        return _run(p, q, k_cache, v_cache, cache_seqlens, block_table, sinks=sinks)
    out = torch.empty_like(q) if p.out_like_q else q.new_empty(p.out_shape)
    o_numel, lse_part_numel, lse_numel = parts
    lse = None
    if lse_wanted:
        lse = q.new_empty(p.out_shape[:3], dtype=torch.float32)
        work_numel = o_numel + lse_part_numel
    else:
        work_numel = o_numel + lse_part_numel + lse_numel
    work = q.new_empty(work_numel, dtype=torch.float32) if work_numel else None
    a_work = 0 if work is None else work.data_ptr()
    a_lse = lse.data_ptr() if lse_wanted else a_work + 4 * (o_numel + lse_part_numel)
    a_out = out.data_ptr()
    stream = current_stream(device)
    # As ``_run`` passes them: the LSE stands in for the ALiBi slopes; the sinks or None.
    a_sinks = None if sinks is None else sinks.data_ptr()
    if combine is None:
        split(stream, (a_q, a_k, a_v, a_out, a_lse, a_len, a_table, a_lse, a_sinks))
    else:
        a_lse_part = a_work + 4 * o_numel
        split(stream, (a_q, a_k, a_v, a_work, a_lse_part, a_len, a_table, a_lse, a_sinks))
        combine(stream, (a_work, a_lse_part, a_out, a_lse))
    return out, lse


# Launches learned by ``ops.express``'s keys (``ops.launch.keep``: the run and the plan map it
# was planned under).
# A run takes (q, k_cache, v_cache, cache_seqlens, block_table, lse_wanted, sinks) of the key's
# signature (the last two by keyword).
_LEARNED: dict[tuple, tuple] = {}


def learned(key: tuple) -> Callable | None:
    """The run ``launch(learn=key)`` kept, or None (also where ``_PLANS`` was replaced since:
    tests do that to plan again; ``forget``)."""
    return kept(_LEARNED, key, _PLANS)


def forget() -> None:
    """Drop every plan and learned launch: the next call of each signature plans again."""
    _PLANS.clear()
    _LEARNED.clear()


def packed_prefill_wanted(
    q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None
) -> bool:
    """Whether a chunk of ``KVCACHE_PACKED_MIN_SEQLEN_Q`` or more new queries runs as a packed
    batch through the forward kernels (``packed_prefill``) rather than the decode kernel: on an
    sm_90 GPU (``runtime.forward_tier``; ``use_tier("portable")`` keeps the decode kernel, which
    is what was measured against), 16-bit inputs (as measured; fp32 keeps the decode kernel), a
    paged cache, or a dense one whose capacity is a multiple of 128 (a sequence's cache is then
    one page of whole key tiles)."""
    if runtime.is_interpreted() or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if runtime.forward_tier(q.device) != "sm90":
        return False
    return block_table is not None or k_cache.shape[2] % 128 == 0


def packed_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    causal: bool,
    scale: float,
    **scores,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``launch``'s ``(out, lse)`` for a chunk of new queries (``scores``: ``window`` as a pair,
    ``softcap``, ``alibi_slopes`` and ``sinks``, as ``ops.fwd.launch`` takes them), computed as
    the packed batch ``attention_varlen(block_table=)`` computes it (``ops.fwd.launch``, which
    takes the Hopper forward where "auto" does): sequence b's Sq queries are rows ``b Sq ..``
    of a packed q, its keys the first ``cache_seqlens[b]`` (clamped to the capacity, as the
    decode kernel clamps them) of its pages, or of its dense cache seen as one page of the
    capacity's rows (table ``[[0], [1], ...]``). The semantics are the same: bottom-right
    causal per sequence, the window, softcap, ALiBi (``(H,)`` or ``(B, H)``) and sinks alike.
    Costs a copy of q into the packed layout and of out and the LSE back, and three small
    launches for the offsets, all on the device (no sync; capturable)."""
    batch, heads, seqlen_q, head_dim = q.shape
    device = q.device
    if block_table is None:
        capacity = k_cache.shape[2]
        block_table = torch.arange(batch, dtype=torch.int32, device=device)[:, None]
    else:
        capacity = block_table.shape[1] * k_cache.shape[2]
    cu_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=device)
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    torch.cumsum(cache_seqlens.clamp(0, capacity), 0, dtype=torch.int32, out=cu_k[1:])
    packed_q = q.transpose(1, 2).reshape(batch * seqlen_q, heads, head_dim)
    out, lse = fwd.launch(
        packed_q, k_cache, v_cache, causal, scale, None,
        pb.Varlen(cu_q, cu_k, seqlen_q, capacity), block_table=block_table, **scores,
    )  # fmt: skip
    out = out.view(batch, seqlen_q, heads, -1).transpose(1, 2).contiguous()
    return out, lse.view(heads, batch, seqlen_q).transpose(0, 1).contiguous()


class Plan(NamedTuple):
    """A decode launch but its tensors (``_plan``)."""

    out_shape: tuple[int, ...]
    empty: bool  # nothing to compute (no query rows)
    no_keys: bool  # no key in any cache: out 0 and the LSE of the sinks (or -inf)
    num_splits: int
    part_shape: tuple[int, ...]  # the fp32 partial outputs of the splits (num_splits > 1)
    grid: tuple[int, ...]
    split_scalars: tuple[tuple, tuple]  # before and after the table's row stride
    split_meta: dict
    combine_grid: tuple[int, ...]
    combine_scalars: tuple
    combine_meta: dict
    out_like_q: bool = False  # out allocated by empty_like(q): q contiguous, of out's shape


# Plans by problem signature (bounded by ops.launch.cached).
_PLANS: dict[tuple, Plan] = {}


def _plan(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    options: tuple,
) -> Plan:
    """``options``: ``(causal, scale, window_left, window_right, softcap, num_splits,
    has_sinks)`` as ``launch`` takes them (``num_splits`` 0 chooses)."""
    causal, scale, window_left, window_right, softcap, num_splits, has_sinks = options
    batch, heads, seqlen_q, head_dim = q.shape
    kv_heads, head_dim_v = k_cache.shape[1], v_cache.shape[-1]
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    out_shape = (batch, heads, seqlen_q, head_dim_v)
    empty = batch * heads * seqlen_q * head_dim_v == 0
    no_keys = capacity == 0 or k_cache.shape[0] == 0
    if empty or no_keys:
        return Plan(out_shape, empty, no_keys, 1, (), (), ((), ()), {}, (), (), {})
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
            batch * row_tiles * kv_heads, capacity, cfg.block_n, _sms(q.device), paged=paged,
            head_dim=head_block(width),
        )  # fmt: skip
    # Splits past the longest possible sequence would only write empty partials; more than
    # MAX_SPLITS would make the combine's (splits, D) tile spill.
    num_splits = max(1, min(num_splits, pb.cdiv(capacity, cfg.block_n), MAX_SPLITS))
    if not paged and cfg.block_n < 128:
        # Few splits of a dense cache each stream enough keys for the longer tile.
        cfg = decode_config(
            width, q.element_size(), interpreted=interpreted, rows=block_m, capacity=capacity,
            keys_per_split=capacity // num_splits,
        )  # fmt: skip
    exp_e = pb.uses_exp_e(q.dtype, interpreted)
    # Sequence lengths live on the device; the capacity bounds them all (problem.window_bounds).
    sc = pb.scores(
        causal, (window_left, window_right), softcap, scale, alibi_slopes is not None,
        seqlen_q, capacity, exp_e=exp_e,
    )  # fmt: skip
    # Contiguous out (B, H, Sq, Dv), LSE (B, H, Sq) and partials (splits, B, H, Sq[, Dv]).
    out_strides = (heads * seqlen_q * head_dim_v, seqlen_q * head_dim_v, head_dim_v)
    lse_strides = (heads * seqlen_q, seqlen_q, 1)
    part_shape = (num_splits, *out_shape)
    part_strides = (batch * heads * seqlen_q * head_dim_v, *out_strides)
    lse_part_strides = (batch * heads * seqlen_q, *lse_strides)
    if num_splits == 1:
        # The split kernel writes out and the LSE directly (split stride 0).
        strides = ((0, *out_strides), (0, *lse_strides))
    else:
        strides = (part_strides, lse_part_strides)
    stride_ab = 0 if alibi_slopes is None else pb.alibi_arg(alibi_slopes, q)[1]
    flags = pb.type_flags(q.dtype, head_dim, interpreted, head_dim_v)
    before = (*q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3], *strides[0],
              *strides[1])  # fmt: skip
    after = (
        stride_ab, kv_heads, kv_group, seqlen_q, capacity, k_cache.shape[2] if paged else 1,
        k_cache.shape[0] if paged else 1, num_splits, *sc.scalars(),
    )  # fmt: skip
    split_meta = dict(
        **flags,
        **sc.flags(),
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        EVEN_M=kv_group * seqlen_q % block_m == 0,
        # 2: one page a tile; 3 and 1: a page a key row (common.page_lookup clamps each).
        PAGED=paged_mode(k_cache, v_cache, cfg.block_n, int32_offsets=False) if paged else 0,
        EXP_E=exp_e,
        HAS_SINKS=has_sinks,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    combine_scalars = (
        *part_strides, *lse_part_strides, *out_strides, *lse_strides, heads, seqlen_q, num_splits,
    )  # fmt: skip
    block_s = max(2, pb.next_pow2(num_splits))
    combine_meta = dict(
        HEAD_DIM=head_dim_v,
        BLOCK_D=flags["BLOCK_DV"],
        BLOCK_S=block_s,
        num_warps=decode_combine_warps(block_s, flags["BLOCK_DV"]),
    )
    return Plan(
        out_shape, False, False, num_splits, part_shape, (batch * kv_heads, num_splits, row_tiles),
        (before, after), split_meta, (batch * heads * seqlen_q,), combine_scalars, combine_meta,
        q.is_contiguous() and head_dim_v == head_dim,
    )  # fmt: skip
