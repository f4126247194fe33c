"""Forward launcher: allocates ``out`` and ``lse``, picks the config, launches the kernel."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from flashcore import tuning
from flashcore.ops import problem as pb
from flashcore.ops import runtime
from flashcore.ops.launch import (
    Bound,
    Descriptor,
    cached,
    current_stream,
    keep,
    kept,
    no_launch_hooks,
    remember,
)
from flashcore.tuning import FwdConfig, fwd_config


@functools.cache
def kernel():
    """The forward kernel's launcher: Q, K, V, O, LSE, CU_Q, CU_K, ALIBI, SINKS, BLOCK_TABLE
    first."""
    return runtime.kernel("fwd", "attn_fwd_kernel", 10)


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    config: FwdConfig | None = None,
    varlen: pb.Varlen | None = None,
    *,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    learn: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward kernel on validated inputs; returns ``(out, lse)``.

    ``out`` keeps q's memory layout when q is dense (so a ``(B, S, H, D)`` view in gives one out);
    ``lse`` is fp32 ``(B, H, Sq)``, contiguous. ``config`` overrides the tuned launch config
    (for tuning scripts). With ``varlen`` the inputs are packed, ``(total, heads, D)``, and
    ``lse`` is ``(H, total_q)``. ``window``, ``softcap`` and ``alibi_slopes`` as in
    ``flashcore.attention`` (validated; ``(-1, -1)``, 0.0 and None are off); ``sinks`` None or
    fp32 ``(H,)``. ``block_table`` (with ``varlen`` only): k and v are paged caches
    ``(num_blocks, Hkv, block_size, D)`` read through it, cu_seqlens_k giving each sequence's
    number of keys.

    ``learn``: a key of ``ops.express`` for this call (dense inputs, no option but ``causal``,
    ``scale`` and ``window``), under which the launch this call makes is kept for later calls of
    the same signature (``learned``), where it is one that depends on nothing but that signature.
    """
    given = (q, k, v)
    q = pb.unit_stride_last_dim(q)
    k = pb.unit_stride_last_dim(k)
    v = pb.unit_stride_last_dim(v)
    if block_table is not None:
        block_table = pb.unit_stride_last_dim(block_table)  # rows read as base + j
    lse = q.new_empty(pb.lse_shape(q, varlen is not None), dtype=torch.float32)
    # out has v's head dim (which may differ from q's and k's) and q's memory layout.
    out = pb.empty_rows_like(q, v.shape[-1])
    if out.numel() == 0 or (varlen is not None and varlen.max_seqlen_q == 0):
        return out, lse
    if k.numel() == 0:
        # Every row sees no key. Filled here rather than launched: k and v have no storage.
        if sinks is not None:
            # Only the sink: lse = sinks[h] (heads are the dim before the rows, dense or packed).
            return out.zero_(), lse.copy_(sinks[:, None].expand_as(lse))
        return out.zero_(), lse.fill_(float("-inf"))
    alibi, stride_ab = pb.alibi_arg(alibi_slopes, lse)
    # A window that hides no key is none (transformers' sliding window at its own length).
    if window != (-1, -1):
        lengths = (q.shape[2], k.shape[2]) if varlen is None else varlen[2:]
        causal, window = pb.effective_window(causal, window, *lengths)
    # All four 16-byte aligned: no low bit set in any address.
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | out.data_ptr()) % 16 == 0
    # What both plan keys below start with (an sm_90 GPU builds both for the problems the
    # Hopper forward leaves to the portable kernel).
    problem = (
        q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, causal,
        scale, window, softcap,
    )  # fmt: skip
    # A call captured into a CUDA graph has no host cost at replay: the Hopper forward from
    # smaller problems on, and descriptors for small portable ones too (tuning).
    capturing = runtime.capturing(q)
    # Whether this call's launch is kept for ops.express (``learn``): on the caller's own
    # tensors, aligned, not captured.
    keeps = learn is not None and aligned and not capturing and pb.used_as_given(given, (q, k, v))
    if config is None and runtime.forward_tier(q.device) == "sm90":
        # Whether the Hopper forward runs, and its launch, per problem signature (as the
        # portable plan below): the tier's checks and choice cost tens of microseconds of
        # Python a call otherwise (docs/performance_host.md, "The Hopper tier's host path").
        key = (
            *problem, out.stride(),
            None if alibi_slopes is None else (alibi_slopes.dtype, stride_ab), sinks is None,
            None if varlen is None else pb.problem_dims(q, k, varlen), aligned,
            None if block_table is None else (block_table.shape, block_table.stride(0)),
            runtime.tier_forced(), capturing,
        )  # fmt: skip
        if capturing and runtime.in_capture(q):
            key = runtime.warmed_key(_SM90_PLANS, key)
            capturing = key[-1]
        hopper = cached(_SM90_PLANS, key, lambda: _sm90_plan(
            q, k, v, out, lse, causal, scale, window, softcap, alibi_slopes, stride_ab,
            sinks is not None, varlen, capturing, block_table,
        ))  # fmt: skip
        if hopper:
            from flashcore.ops import fwd_sm90

            fwd_sm90.launch(hopper, q, k, v, out, lse, alibi if alibi_slopes is not None else None,
                            sinks, varlen, block_table)  # fmt: skip
            if keeps:
                run = functools.partial(_learned_sm90, hopper, v.shape[-1])
                _learn(learn, Quick.sm90(hopper, q.get_device(), v.shape[-1], run) or run)
            return out, lse
    # Everything but the pointers follows from this key (out's strides from q's shape and
    # strides, descriptor eligibility from strides and 16-byte alignment): the config, scalars
    # and constexprs are built once per problem signature.
    key = (
        *problem, None if alibi_slopes is None else stride_ab, sinks is None,
        None if block_table is None else block_table.stride(0),
        None if varlen is None else pb.problem_dims(q, k, varlen), config,
        aligned, tuning.TMA_MIN_FLOPS, capturing,
    )  # fmt: skip
    if capturing and runtime.in_capture(q):
        key = runtime.warmed_key(_PLANS, key)
        capturing = key[-1]
    plan = _PLANS.get(key)
    if plan is None:
        plan = cached(_PLANS, key, lambda: _plan(
            q, k, v, out, lse, causal, scale, config, varlen, window, softcap, alibi_slopes,
            stride_ab, sinks is not None, block_table, pb.problem_dims(q, k, varlen), capturing,
        ))  # fmt: skip
    cu = (None, None) if varlen is None else varlen[:2]
    with runtime.launch_on(q):
        # Without a block table the LSE stands in for its pointer (never read: PAGED is off).
        table = lse if block_table is None else block_table
        _launch(plan, q, k, v, out, lse, cu, alibi, sinks, table)
    if keeps:
        run = functools.partial(_learned_portable, plan, v.shape[-1])
        _learn(learn, Quick.portable(plan, q.get_device(), v.shape[-1], run) or run)
    return out, lse


def _launch(plan: tuple, q, k, v, out, lse, cu: tuple, alibi, sinks, table) -> None:
    """The portable forward's launch of ``plan`` (``_plan``) on these tensors."""
    grid, tail, meta, tiles = plan
    if tiles is None:
        pointers = (q, k, v, out)
    else:
        rows_q, rows_k, block_d, block_dv = tiles
        pointers = (
            pb.descriptor(q, rows_q, block_d), pb.descriptor(k, rows_k, block_d),
            pb.descriptor(v, rows_k, block_dv), pb.descriptor(out, rows_q, block_dv),
        )  # fmt: skip
    kernel()(grid, (*pointers, lse, *cu, alibi, sinks, table, *tail), meta, planned=True)


# Launches learned by ``ops.express``'s keys: key -> (run, the plan maps and the TMA floor it
# was planned under). A run takes (q, k, v) of the key's signature and returns (out, lse).
_LEARNED: dict[tuple, tuple] = {}


def learned(key: tuple) -> Callable | None:
    """The run ``launch(learn=key)`` kept, or None: also where the plan maps it came from were
    replaced since or the TMA floor changed (tests do either to plan again; ``forget``)."""
    return kept(_LEARNED, key, _PLANS, _SM90_PLANS, tuning.TMA_MIN_FLOPS)


def forget() -> None:
    """Drop every plan and learned launch: the next call of each signature plans again."""
    _PLANS.clear()
    _SM90_PLANS.clear()
    _LEARNED.clear()


def _learn(key: tuple, run: Callable) -> None:
    keep(_LEARNED, key, run, _PLANS, _SM90_PLANS, tuning.TMA_MIN_FLOPS)


def _outputs(q: torch.Tensor, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` for dense q, allocated as ``launch`` allocates them."""
    return pb.empty_rows_like(q, head_dim_v), q.new_empty(q.shape[:3], dtype=torch.float32)


def _learned_portable(
    plan: tuple, head_dim_v: int, q, k, v, sinks=None
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _outputs(q, head_dim_v)
    # The LSE stands in for the ALiBi and block table pointers (``launch``).
    _launch(plan, q, k, v, out, lse, (None, None), lse, sinks, lse)
    return out, lse


def _learned_sm90(
    hopper, head_dim_v: int, q, k, v, sinks=None
) -> tuple[torch.Tensor, torch.Tensor]:
    from flashcore.ops import fwd_sm90

    out, lse = _outputs(q, head_dim_v)
    fwd_sm90.launch(hopper, q, k, v, out, lse, None, sinks)
    return out, lse


class Quick:
    """A kept forward of one dense signature below ``Launcher`` (``ops.express``'s runs): the
    launch its first call made, bound (``ops.launch.Bound``: grid, function, metadata, scalars
    and constexprs), called with this call's addresses. Descriptor arguments (the Hopper
    forward's four, the portable one's where its plan takes tiles) are expanded once per address
    and kept (``Bound.part``), and the whole pointer list once per set of addresses (``fronts``): an
    eager loop gets its addresses back from the caching allocator. ``run(q, k, v, sinks)`` returns
    ``(out, lse)`` as ``_learned_portable`` / ``_learned_sm90`` (``fallback``) do, and takes
    that path where a launch hook is registered. The caller (``ops.express.forward``) has checked
    q, k and v for 16-byte alignment; out and the LSE are fresh allocations."""

    __slots__ = (
        "counter", "describe", "device", "fallback", "fronts", "head_dim_v", "hopper", "launch",
    )  # fmt: skip

    # Sets of addresses whose pointer lists are kept; past this many the map starts over.
    MAX_FRONTS = 64

    def __init__(
        self,
        launch: Bound,
        device: int,
        head_dim_v: int,
        describe: Callable[[int, torch.Tensor], Descriptor] | None,
        hopper: bool,
        fallback: Callable,
    ) -> None:
        self.launch = launch
        self.device = device
        self.head_dim_v = head_dim_v
        self.describe = describe  # position, tensor -> its descriptor; None: plain pointers
        self.hopper = hopper  # the Hopper forward's pointer list (else the portable one's)
        self.fallback = fallback
        self.fronts: dict[tuple, list] = {}
        # The Hopper forward's dynamic deal: device -> its counter for the current stream.
        self.counter: Callable[[torch.device], torch.Tensor] | None = None

    @classmethod
    def portable(
        cls, plan: tuple, device: int, head_dim_v: int, fallback: Callable
    ) -> Quick | None:
        """The quick run of a portable plan launched directly on ``device``, or None."""
        grid, _, meta, tiles = plan
        launch = Bound.of(kernel(), grid, meta)
        if launch is None:
            return None
        describe = None
        if tiles is not None:
            rows_q, rows_k, block_d, block_dv = tiles
            shapes = ((rows_q, block_d), (rows_k, block_d), (rows_k, block_dv), (rows_q, block_dv))

            def describe(i: int, t: torch.Tensor) -> Descriptor:
                return pb.descriptor(t, *shapes[i])

        return cls(launch, device, head_dim_v, describe, False, fallback)

    @classmethod
    def sm90(cls, hopper, device: int, head_dim_v: int, fallback: Callable) -> Quick | None:
        """The quick run of a dense Hopper forward plan launched directly on ``device``, or
        None."""
        from flashcore.ops import fwd_sm90

        if hopper.work is not None:
            return None
        launch = Bound.of(fwd_sm90.launcher(), hopper.grid, hopper.meta)
        if launch is None:
            return None
        boxes = hopper.boxes

        def describe(i: int, t: torch.Tensor) -> Descriptor:
            return fwd_sm90.descriptor(t, boxes[i])

        quick = cls(launch, device, head_dim_v, describe, True, fallback)
        if hopper.meta.get("DYNAMIC"):
            quick.counter = fwd_sm90.work_counter
        return quick

    def __call__(self, q, k, v, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
        if not no_launch_hooks():
            return self.fallback(q, k, v, sinks)
        out, lse = _outputs(q, self.head_dim_v)
        a_q, a_k, a_v, a_out, a_lse = (
            q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr()
        )  # fmt: skip
        a_work = a_lse if self.counter is None else self.counter(q.device).data_ptr()
        a_sinks = None if sinks is None else sinks.data_ptr()
        if self.describe is None:
            front = (a_q, a_k, a_v, a_out, *self._tail(a_out, a_lse, a_work, a_sinks))
        else:
            addresses = (a_q, a_k, a_v, a_out, a_lse, a_work, a_sinks)
            front = self.fronts.get(addresses)
            if front is None:
                front = self._front(addresses, (q, k, v, out))
        self.launch(current_stream(self.device), front)
        return out, lse

    def _front(self, addresses: tuple, tensors: tuple) -> list:
        """The pointer arguments for these tensors (the four descriptors expanded, each kept
        under its position and address: ``Bound.part``), kept under ``addresses``."""
        front = []
        for i, t in enumerate(tensors):
            front += self.launch.part(i, addresses[i], functools.partial(self.describe, i, t))
        front += self._tail(*addresses[3:])
        return remember(self.fronts, addresses, front, self.MAX_FRONTS)

    def _tail(self, a_out: int, a_lse: int, a_work: int, a_sinks: int | None) -> tuple:
        """The pointer arguments after q, k, v and out, as the Launcher paths pass them for a
        dense problem (``a_work``: the dynamic deal's counter, else the LSE; ``a_sinks``: the
        sinks, or None)."""
        if self.hopper:
            # fwd_sm90.launch: the LSE, then the LSE for ALiBi, the sinks (or the LSE), out for
            # O, the LSE for both offsets, the work list (or counter) and the block table.
            sinks = a_lse if a_sinks is None else a_sinks
            return (a_lse, a_lse, sinks, a_out, a_lse, a_lse, a_work, a_lse)
        # _learned_portable: the LSE, no offsets, the LSE for ALiBi, the sinks (or None), the
        # LSE for the block table.
        return (a_lse, None, None, a_lse, a_sinks, a_lse)


# Launch plans by problem signature (see launch; bounded by ops.launch.cached); the Hopper
# forward's hold its launch, or False where the portable kernel runs.
_PLANS: dict[tuple, tuple] = {}
_SM90_PLANS: dict[tuple, object] = {}


def _sm90_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    window: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    stride_ab: int,
    has_sinks: bool,
    varlen: pb.Varlen | None,
    capturing: bool = False,
    block_table: torch.Tensor | None = None,
):
    """The Hopper forward's launch (``fwd_sm90.Plan``) where "auto" or ``use_tier("sm90")`` takes
    it for this problem and the tier covers it, else False (``capturing``: into a CUDA graph;
    ``block_table``: paged k and v, whose page size the tier may not take)."""
    from flashcore.ops import fwd_sm90, fwd_sm90_configs

    dims = pb.problem_dims(q, k, varlen)
    # The kernels' head dim: 128 for those between 64 and 128 (fwd_sm90.PADDED_HEAD_DIMS), 256
    # for those between 128 and 256 with V's equal (WIDE_PADDED_HEAD_DIMS).
    head_dim = fwd_sm90.kernel_head_dims(q.shape[-1], v.shape[-1])[0]
    # "auto" judges a packed batch by its mean lengths (the offsets stay on the device; the
    # totals may include rows past the last offset, so these are upper bounds).
    if varlen is None:
        seqlen_q, seqlen_k = dims[3:]
    elif block_table is None:
        seqlen_q, seqlen_k = q.shape[0] / dims.batch, k.shape[0] / dims.batch
    else:
        # A paged batch's keys: at most the longest, and at most the pool's pages shared out.
        seqlen_q = q.shape[0] / dims.batch
        seqlen_k = min(dims[4], k.shape[0] * k.shape[2] / dims.batch)
    flops = 4.0 * dims.batch * dims.heads * seqlen_q * seqlen_k * head_dim
    wanted = runtime.tier_forced() or tuning.sm90_forward(
        seqlen_q,
        seqlen_k,
        head_dim,
        flops / 2 if causal else flops,
        causal=causal,
        graph=capturing,
        window=window != (-1, -1),
        softcap=softcap > 0,
        alibi=alibi_slopes is not None,
        varlen=varlen is not None,
        short_window=fwd_sm90_configs.takes_window_one(head_dim, causal, window),
    )
    if not wanted or not fwd_sm90.supports(
        q, k, v, causal=causal, window=window, softcap=softcap, alibi=alibi_slopes,
        varlen=varlen is not None, block_table=block_table,
    ):  # fmt: skip
        return False
    if varlen is not None and not fwd_sm90.tma_ok(fwd_sm90.packed_view(out)):
        return False
    sc = pb.scores(causal, window, softcap, scale, alibi_slopes is not None, *dims[3:])
    hopper = fwd_sm90.plan(
        q, k, v, lse, causal=sc.is_causal, qk_scale=sc.qk_scale, window_left=sc.window_left,
        window_right=sc.window_right, has_window=sc.has_window, softcap=sc.softcap,
        alibi=alibi_slopes is not None, sinks=has_sinks, stride_ab=stride_ab, varlen=varlen,
        out_strides=(0, 0) if varlen is None else out.stride()[:2], block_table=block_table,
    )  # fmt: skip
    return hopper or False


def _plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    config: FwdConfig | None,
    varlen: pb.Varlen | None,
    window: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    stride_ab: int,
    has_sinks: bool,
    block_table: torch.Tensor | None,
    dims: pb.Dims,
    capturing: bool = False,
) -> tuple:
    """``(grid, arguments after the pointers, constexprs, descriptor tiles or None)`` of the
    forward launch of ``launch``."""
    batch, heads, kv_heads, seqlen_q, seqlen_k = dims
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    interpreted = runtime.is_interpreted()
    exp_e = pb.uses_exp_e(q.dtype, interpreted)
    flops = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim + head_dim_v)
    flops /= 2 if causal else 1
    # Tiles sized for the wider of the two head dims (registers hold a Q and an O tile).
    cfg = config or fwd_config(
        max(head_dim, head_dim_v),
        q.element_size(),
        interpreted=interpreted,
        seqlen_q=seqlen_q,
        causal=causal,
        flops=flops,
        capability=runtime.capability(q.device),
        graph=capturing,
    )
    sc = pb.scores(
        causal, window, softcap, scale, alibi_slopes is not None, seqlen_q, seqlen_k, exp_e=exp_e
    )
    flags = pb.type_flags(q.dtype, head_dim, interpreted, head_dim_v)
    paged = block_table is not None
    use_tma = (
        cfg.use_tma
        and varlen is None
        and (interpreted or runtime.has_tma(q.device))
        and all(pb.tma_compatible(t) for t in (q, k, v, out))
    )
    tiles = (cfg.block_m, cfg.block_n, flags["BLOCK_D"], flags["BLOCK_DV"]) if use_tma else None
    # A paged cache is addressed by (page, head, row): its own three strides.
    kv_strides = (k.stride()[:3], v.stride()[:3]) if paged else (
        pb.row_strides(k, varlen), pb.row_strides(v, varlen),
    )  # fmt: skip
    tile_strides = (
        *pb.row_strides(q, varlen), *kv_strides[0], *kv_strides[1], *pb.row_strides(out, varlen),
    )  # fmt: skip
    tail = (
        *tile_strides, *pb.stats_strides(lse, varlen), stride_ab,
        block_table.stride(0) if paged else 0, k.shape[2] if paged else 1,
        k.shape[0] if paged else 1, heads, heads // kv_heads, seqlen_q, seqlen_k,
        *pb.packed_totals(q, k, varlen, block_table), *sc.scalars(),
    )  # fmt: skip
    meta = dict(
        **flags,
        **sc.flags(),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        EVEN_M=varlen is None and seqlen_q % cfg.block_m == 0,
        EVEN_N=varlen is None and seqlen_k % cfg.block_n == 0,
        EXP_E=exp_e,
        USE_TMA=use_tma,
        IS_VARLEN=varlen is not None,
        HAS_SINKS=has_sinks,
        PAGED=paged_mode(k, v, cfg.block_n) if paged else 0,
        # Row strides of 16-byte multiples declared to the pointer path (kernels/common.py:
        # aligned); the descriptors of the TMA path carry their own.
        ALIGN=pb.stride_align(tile_strides, q.element_size()),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return (pb.cdiv(seqlen_q, cfg.block_m) * batch * heads,), tail, meta, tiles


def paged_mode(k: torch.Tensor, v: torch.Tensor, block_n: int, int32_offsets: bool = True) -> int:
    """The PAGED of a kernel reading paged caches k, v ``(num_blocks, Hkv, block_size, D)`` in
    tiles of ``block_n`` keys (``common.page_lookup``): 2 where every tile lies in one page; 3
    where block_size is a power of two (then smaller than the tile), a shift and a mask a key row,
    and, with ``int32_offsets`` (the forward, kernels/fwd.py, computes its offsets in int32 there),
    every offset into either cache fits in int32; else 1, a division a key row and 64-bit
    offsets (other block sizes, and caches of 2**31 elements or more). The decode kernel's
    offsets are 64-bit in every mode (``int32_offsets=False``)."""
    block_size = k.shape[2]
    if block_size % block_n == 0:
        return 2
    if not int32_offsets:
        return 3 if block_size & (block_size - 1) == 0 else 1
    # The largest element offset (+1) of either cache.
    extent = max(
        sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1 for t in (k, v)
    )
    return 3 if block_size & (block_size - 1) == 0 and extent <= 2**31 else 1
