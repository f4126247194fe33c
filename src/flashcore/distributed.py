"""Context parallelism: exact ring attention over ``torch.distributed``, forward and backward.

One long sequence is split over the ranks of a process group; each rank holds its shard of q, k
and v and gets back its shard of ``flashcore.attention`` over the whole sequence (and of the LSE),
exactly up to rounding. Nothing of size S x S is formed and every rank keeps O(S / P) memory.

Forward. The K/V shards travel around the ring (rank r sends to r + 1 and receives from r - 1,
``torch.distributed.batch_isend_irecv``), so at step i rank r holds the block of rank
``s = (r - i) mod P``. The transfer of the next block is posted before the kernel runs on the
block in hand, and waited for after it: communication overlaps computation (two K/V buffers
alternate). Each block gives a partial ``(out, lse)`` from FlashCore's forward kernel; the partials
merge through their LSEs in fp32 (``_merge``). Blocks a causal rank cannot see are skipped, and
blocks it sees whole run without a mask (``_block``).

Backward. A second trip around the ring with the same schedule. Each block runs FlashCore's
backward kernel with the GLOBAL out and LSE of the local rows: ``exp(S_block - lse)`` is exactly
that block's share of the softmax and ``delta = rowsum(dO * O) - dlse`` is the global one, so the
per-block dq, dk, dv are the exact shares of the gradients. dq accumulates locally (fp32). The
fp32 dK/dV accumulator of a block travels with it: the rank holding block s adds its share and
passes the accumulator on; it is sent after the block's kernel (it needs its share) and waited for
one step later, so it too overlaps the next block's computation. After P shifts every accumulator
is back at its owner, complete.

Communication is PyTorch's: NCCL for CUDA tensors, gloo for CPU ones (the kernels then run in
Triton's interpreter, for tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from flashcore.checks import (
    SUPPORTED_DTYPES,
    check_flag,
    check_inputs,
    check_scale,
    entry_inputs,
)
from flashcore.ops import bwd as _bwd
from flashcore.ops import fwd as _fwd
from flashcore.ops.registry import first_order

LAYOUTS = ("contiguous", "zigzag")
# Dtypes unshard tells apart when comparing ranks (others compare as -1).
_DTYPES = (*SUPPORTED_DTYPES, torch.float64, torch.int32, torch.int64, torch.bool)


# The two calls into FlashCore's launchers, one place each (their internal names may move).
def _block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of validated ``(B, H, Sq, D)`` / ``(B, Hkv, Sk, D)`` blocks."""
    return _fwd.launch(q, k, v, causal, scale)


def _block_backward(
    dout, q, k, v, out, lse, dlse, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one block, with the rows' global ``out``, ``lse`` (and ``dlse``)."""
    return _bwd.launch(dout, q, k, v, out, lse, dlse, causal, scale)[:3]


class _Block(NamedTuple):
    """The part of a K/V block a rank attends to: its query rows, the block's key rows, and
    whether the causal mask cuts through it (only on the diagonal block)."""

    rows: slice
    cols: slice
    causal: bool


def _block(rank: int, source: int, seqlen: int, zigzag: bool, causal: bool) -> _Block | None:
    """What rank ``rank`` computes with the K/V shard of rank ``source`` (None: nothing).

    ``seqlen`` is the shard length. Contiguous: the source's keys are all before (s < r: seen
    whole), the same (the diagonal), or all after (s > r: skipped). Zigzag: rank r holds chunks
    r and 2P-1-r of 2P; for s < r its queries all see chunk s and none of chunk 2P-1-s; for s > r
    only its second chunk sees anything, and it sees both of the source's chunks whole.
    """
    every, half = slice(0, seqlen), seqlen // 2
    if not causal:
        return _Block(every, every, False)
    if source == rank:
        return _Block(every, every, True)
    if not zigzag:
        return _Block(every, every, False) if source < rank else None
    if source < rank:
        return _Block(every, slice(0, half), False)
    return _Block(slice(half, seqlen), every, False)


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows of a ``(B, H, S, D)`` tensor or of ``(B, H, S)`` row stats."""
    return t[:, :, rows]


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor):
    """In place: fp32 ``(out, lse)`` become the attention over both key sets, given the partial
    result ``(block_out, block_lse)`` over the other set.

    ``out = w * out + w' * block_out`` with ``w = exp(lse - new)``, ``w' = exp(block_lse - new)``
    and ``new = logaddexp(lse, block_lse)``: both weights are at most 1, so nothing overflows. A row
    that has seen no key on either side keeps ``lse = -inf``; its weights are taken against 0
    instead of ``new`` (``exp(-inf - 0) = 0`` where ``exp(-inf + inf)`` would be NaN), so it stays
    ``out = 0``.
    """
    new = torch.logaddexp(lse, block_lse)
    base = new.masked_fill(new == float("-inf"), 0.0)
    out.mul_(torch.exp(lse - base).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - base).unsqueeze(-1))
    lse.copy_(new)


class _Ring:
    """Point-to-point shifts around the ring: send to rank + 1, receive from rank - 1."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def shift(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> list:
        """Post the transfer and return its requests (wait with ``_wait``). ``send`` must not be
        written and ``recv`` not read until then."""
        ops = [
            dist.P2POp(
                dist.isend, send, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag
            ),
            dist.P2POp(
                dist.irecv, recv, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag
            ),
        ]
        return dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    # NCCL: the current stream waits for the transfer, the host goes on. gloo: the host waits.
    for request in requests:
        request.wait()


_KV, _DKV = 0, 1  # message tags (gloo matches on them; NCCL ignores them)


def _ring_forward(q, k, v, causal: bool, scale: float, zigzag: bool, ring: _Ring):
    """``(out, lse)`` of the local rows over the whole sequence: out in q's dtype, lse fp32."""
    size, rank, seqlen = ring.size, ring.rank, q.shape[2]
    kv = torch.stack((k, v))  # one contiguous message per step
    spare = torch.empty_like(kv) if size > 1 else None
    out = lse = None
    for step in range(size):
        source = (rank - step) % size
        requests = ring.shift(kv, spare, _KV) if step + 1 < size else []
        block = _block(rank, source, seqlen, zigzag, causal)
        if block is not None:
            block_out, block_lse = _block_forward(
                _rows(q, block.rows), kv[0][:, :, block.cols], kv[1][:, :, block.cols],
                block.causal, scale,
            )  # fmt: skip
            if out is None:  # step 0: the diagonal block, every row
                out, lse = block_out.float(), block_lse
            else:
                _merge(_rows(out, block.rows), _rows(lse, block.rows), block_out, block_lse)
        _wait(requests)
        kv, spare = spare, kv
    return out.to(q.dtype), lse


def _ring_backward(dout, dlse, q, k, v, out, lse, causal: bool, scale: float, zigzag: bool, ring):
    """``(dq, dk, dv)`` of the local shards; see the module docstring for the routing."""
    size, rank, seqlen = ring.size, ring.rank, q.shape[2]
    kv = torch.stack((k, v))
    kv_spare = torch.empty_like(kv) if size > 1 else None
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    # dkv: the accumulator of the block in hand (dK, dV); dkv_spare: the one last sent.
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    dkv_spare = torch.empty_like(dkv) if size > 1 else None
    dkv_requests: list = []
    for step in range(size):
        source = (rank - step) % size
        kv_requests = ring.shift(kv, kv_spare, _KV) if step + 1 < size else []
        block = _block(rank, source, seqlen, zigzag, causal)
        grads = None
        if block is not None:
            rows = block.rows
            grads = _block_backward(
                _rows(dout, rows), _rows(q, rows), kv[0][:, :, block.cols],
                kv[1][:, :, block.cols], _rows(out, rows), _rows(lse, rows),
                None if dlse is None else _rows(dlse, rows), block.causal, scale,
            )  # fmt: skip
        # From step 1 on, the accumulator of this block arrives from the previous rank.
        _wait(dkv_requests)
        if grads is not None:
            _rows(dq, block.rows).add_(grads[0])
            dkv[0][:, :, block.cols].add_(grads[1])
            dkv[1][:, :, block.cols].add_(grads[2])
        if size > 1:
            dkv_requests = ring.shift(dkv, dkv_spare, _DKV)
            dkv, dkv_spare = dkv_spare, dkv
        _wait(kv_requests)
        kv, kv_spare = kv_spare, kv
    _wait(dkv_requests)  # the P-th shift brings each accumulator home
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, zigzag, ring):
        if q.numel() == 0:  # empty on every rank (the shapes were compared): nothing to send
            out = torch.zeros_like(q)
            lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        else:
            out, lse = _ring_forward(q, k, v, causal, scale, zigzag, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = causal, scale, zigzag, ring
        # A gradient that does not reach out or lse arrives as None, not as a tensor of zeros.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @first_order
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        none = (None,) * len(ctx.options)
        if q.numel() == 0:  # on every rank alike
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), *none
        # The other ranks wait for this one's blocks: the ring runs whatever arrived. Only the
        # LSE differentiated: dO = 0 (delta = -dlse, dV = 0).
        dout = torch.zeros_like(out) if dout is None else dout
        return *_ring_backward(dout, dlse, q, k, v, out, lse, *ctx.options), *none


def _check_group(group: object) -> dist.ProcessGroup:
    """The group to use (None: the world), or an error saying why it cannot be used."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "group: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (NCCL for CUDA tensors, gloo for CPU ones)"
        )
    if group is None:
        return dist.group.WORLD
    # What new_group returns on a process outside it (an int, -100, in torch 2.13).
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"group: this process (rank {dist.get_rank()}) is not a member of it")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if dist.get_rank(group) < 0:
        raise ValueError(f"group: this process (rank {dist.get_rank()}) is not a member of it")
    return group


def _check_layout(layout: object) -> bool:
    """True for zigzag."""
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a str, one of {LAYOUTS}, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout == "zigzag"


def _check_same_everywhere(fields: dict[str, int], device: torch.device, group) -> None:
    """All-gather a few ints and raise, on every rank alike, if any differs between ranks."""
    mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    table = torch.stack(everyone).cpu()
    for column, name in enumerate(fields):
        values = table[:, column].tolist()
        if len(set(values)) > 1:
            raise ValueError(
                f"{name} must be equal on every rank of the group, got {values} (by group rank)"
            )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    layout: str = "contiguous",
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over a sequence sharded across the ranks of ``group`` (ring attention).

    Every rank of the group calls this with its shard of one long sequence of length S (P ranks,
    each holding S / P positions) and gets back its rows of ``flashcore.attention(q, k, v,
    causal=causal, scale=scale)`` over the whole sequence, exactly up to rounding. Which positions
    a rank holds is the ``layout`` (``shard`` cuts a full tensor so)::

        S = 8 positions, P = 2 ranks, chunks of S / 2P = 2 for zigzag
        contiguous:  rank 0: 0 1 2 3      rank 1: 4 5 6 7
        zigzag:      rank 0: 0 1 | 6 7    rank 1: 2 3 | 4 5   (chunks r and 2P-1-r)

    With ``causal`` rank r of a contiguous layout computes r + 1 blocks and rank P - 1 all P;
    zigzag gives every rank the same causal work (one diagonal block and P - 1 half blocks), so it
    is the layout to use for causal training. The causal mask is the usual lower triangle over
    global positions (Sq = Sk, so bottom-right and top-left alignment agree).

    K/V shards travel around the ring by point-to-point transfers, each posted before the
    computation on the block in hand; partial results merge through their LSEs. The backward
    (autograd) makes the same trip, with each block's dK/dV accumulator (fp32) travelling along
    and arriving back at its owner. Memory per rank is O(S / P); nothing S x S is formed. The
    kernels write each block's partial out and dq, dk, dv in the inputs' dtype; they are merged
    and summed in fp32 and rounded once more at the end.

    Args:
        q: ``(B, H, S / P, D)`` this rank's queries.
        k: ``(B, Hkv, S / P, D)`` this rank's keys; GQA/MQA as in ``flashcore.attention``.
        v: ``(B, Hkv, S / P, D)`` this rank's values.
        causal: causal mask over global positions (query at position i sees keys j <= i).
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        group: the process group the sequence is sharded over; None is the default (world) group.
            Every rank of it must call with the same shapes, dtype and options.
        layout: ``"contiguous"`` (rank r holds positions ``[r S/P, (r+1) S/P)``) or ``"zigzag"``
            (the sequence cut into 2P chunks; rank r holds chunk r, then chunk 2P-1-r: the shard
            length must be even).
        return_lse: also return the rows' logsumexp over the whole sequence.

    Returns:
        ``out`` ``(B, H, S / P, D)`` in q's dtype, or ``(out, lse)`` with ``lse`` float32
        ``(B, H, S / P)`` (natural log). Differentiable in q, k, v, through ``out`` and ``lse``.

    Tensors must be on CUDA with an NCCL group, or on the CPU (``TRITON_INTERPRET=1``) with a
    gloo one. Every rank of the group must run the backward too (the gradients make the same trip
    around the ring), so each rank's loss must depend on its ``out`` or ``lse``. One small
    all-gather per call compares the shapes and options across ranks (on CUDA it synchronises
    the host once). Not traceable by ``torch.compile`` (it communicates from Python).

    Raises (all before any transfer; the shape comparison across ranks is one small all-gather):
        RuntimeError: torch.distributed is not initialised.
        TypeError: as ``flashcore.attention``; ``group`` not a ProcessGroup; ``layout`` not a str.
        ValueError: as ``flashcore.attention``; k/v shard length unlike q's; this process not in
            ``group``; an unknown ``layout``; an odd shard length with ``"zigzag"``; shard
            lengths (or other shapes, the dtype, ``causal``, ``scale``, ``layout``) that differ
            between ranks.
        NotImplementedError: head_dim above 256; forward-mode AD (a jvp); a ``torch.func``
            transform (``grad``, ``vmap``: the ring's collectives run once per call, not per
            transformed level or sample).
    """
    q, k, v = entry_inputs("flashcore.distributed.ring_attention", q, k, v)
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            "flashcore.distributed.ring_attention does not run under torch.func transforms "
            "(grad, vjp, vmap, ...): call it outside them (torch.autograd.grad for gradients)"
        )
    check_inputs(q, k, v)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale = check_scale(scale, q.shape[-1])
    zigzag = _check_layout(layout)
    group = _check_group(group)
    seqlen = q.shape[2]
    if k.shape[2] != seqlen:
        raise ValueError(
            f"k/v shard length (k.shape[2]) must equal q's (q.shape[2] = {seqlen}): each rank "
            f"holds the same positions of q, k and v; got {k.shape[2]}"
        )
    if zigzag and seqlen % 2:
        raise ValueError(
            f"layout='zigzag' needs an even shard length (two chunks per rank), got "
            f"q.shape[2] = {seqlen}"
        )
    batch, heads, _, head_dim = q.shape
    scale_bits = torch.tensor(scale, dtype=torch.float64).view(torch.int64).item()
    _check_same_everywhere(
        {
            "q.shape[2] (the shard length)": seqlen,
            "q.shape[0] (batch)": batch,
            "q.shape[1] (heads)": heads,
            "k.shape[1] (kv heads)": k.shape[1],
            "q.shape[3] (head dim)": head_dim,
            "q.dtype (index in (float16, bfloat16, float32))": SUPPORTED_DTYPES.index(q.dtype),
            "causal": int(causal),
            "scale (float64 bits)": scale_bits,
            "layout (index in ('contiguous', 'zigzag'))": int(zigzag),
        },
        q.device,
        group,
    )
    out, lse = _RingAttention.apply(q, k, v, causal, scale, zigzag, _Ring(group))
    return (out, lse) if return_lse else out


def _check_dim(x: object, dim: object) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"dim must be in [{-x.dim()}, {x.dim()}) for x of {x.dim()} dims, got {dim}"
        )
    return dim % x.dim()


def shard(
    x: torch.Tensor,
    layout: str = "contiguous",
    *,
    group: dist.ProcessGroup | None = None,
    dim: int = 2,
) -> torch.Tensor:
    """This rank's shard of a full-sequence tensor, as ``ring_attention`` takes it.

    ``x`` holds the whole sequence along ``dim`` (2 for q, k, v ``(B, H, S, D)`` and for an LSE
    ``(B, H, S)``); every rank passes the same tensor. ``"contiguous"``: rank r gets
    ``[r S/P, (r+1) S/P)``, a view of x. ``"zigzag"``: rank r gets chunks r and 2P-1-r of 2P,
    concatenated (a new tensor). Differentiable. No communication.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: x not a tensor, ``dim`` not an int, ``group`` or ``layout`` of the wrong type.
        ValueError: ``dim`` out of range, an unknown layout, this process not in ``group``, or a
            length along ``dim`` that P (contiguous) or 2P (zigzag) does not divide.
    """
    dim = _check_dim(x, dim)
    zigzag = _check_layout(layout)
    group = _check_group(group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = 2 * size if zigzag else size
    length = x.shape[dim]
    if length % chunks:
        raise ValueError(
            f"x.shape[{dim}] (the sequence, {length}) must be a multiple of {chunks} (layout "
            f"{layout!r} over {size} ranks cuts it into {chunks} equal chunks)"
        )
    chunk = length // chunks
    if not zigzag:
        return x.narrow(dim, rank * chunk, chunk)
    last = chunks - 1 - rank
    return torch.cat((x.narrow(dim, rank * chunk, chunk), x.narrow(dim, last * chunk, chunk)), dim)


def unshard(
    x: torch.Tensor,
    layout: str = "contiguous",
    *,
    group: dist.ProcessGroup | None = None,
    dim: int = 2,
) -> torch.Tensor:
    """The full-sequence tensor from every rank's shard (an all-gather): the inverse of ``shard``.

    Every rank of ``group`` calls it with its shard (equal shapes) and gets the whole tensor. Not
    differentiable (for checking and for gathering results).

    Raises:
        As ``shard``; ValueError also for shards whose shapes differ between ranks (compared by a
        small all-gather first) or an odd length along ``dim`` with ``"zigzag"``.
    """
    dim = _check_dim(x, dim)
    zigzag = _check_layout(layout)
    group = _check_group(group)
    if zigzag and x.shape[dim] % 2:
        raise ValueError(
            f"layout='zigzag' needs an even shard length (two chunks per rank), got "
            f"x.shape[{dim}] = {x.shape[dim]}"
        )
    fields = {
        "x.dim()": x.dim(),
        f"x.shape[{dim}] (the shard length)": x.shape[dim],
        "x.numel()": x.numel(),
        "x.dtype": _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1,
    }
    _check_same_everywhere(fields, x.device, group)
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    if not zigzag:
        return torch.cat(parts, dim)
    halves = [part.chunk(2, dim) for part in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)
