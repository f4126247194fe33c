"""Work lists of packed batches for the Hopper forward's flat grid (``kernels/varlen.py:
work_list_kernel``).

A packed batch's flat grid sized by its longest sequence has ``batch x cdiv(longest,
BLOCK_M) x heads`` programs, of which those past a shorter sequence's end only start and exit
(38% of them for 16 sequences of 256-4096 tokens), the sequences in their packed order. With a
work list the grid holds the most programs the packed rows can make; one small program builds
the list on the device from the offsets (no host sync): every sequence's programs, in the
dense grid's order, the sequences costliest first; the programs past the list's end return at
once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flashcore.ops.launch import Launcher

# Sequences the list program takes at a time, and the programs of each it writes at a time.
CHUNK_B = 64
CHUNK_R = 64
# Costs (key tiles a sequence's last query tile sees, plus one) sorted apart; costlier ones share
# the last. 2047 key tiles of 128 are 262k keys.
MAX_COSTS = 2048


class WorkList(NamedTuple):
    """The list's launch but its tensors: its length in ``(b, r)`` pairs (the grid), the scalar
    arguments and the constexprs of ``work_list_kernel``."""

    size: int
    scalars: tuple
    meta: dict


def plan(
    batch: int,
    heads: int,
    total_q: int,
    total_k: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_m: int,
    block_n: int,
    *,
    causal: bool,
    window_left: int,
    window_right: int,
    has_window: bool,
) -> WorkList | None:
    """The work list of a packed batch of ``heads`` query heads whose longest sequences are
    ``max_seqlen_q`` / ``max_seqlen_k``, tiled by ``block_m`` query rows and ``block_n`` keys;
    None without a row. Its length bounds the programs from both sides: every sequence at most
    ``cdiv(max_seqlen_q, block_m)`` tiles, and ``sum cdiv(len, block_m) <= (total_q + batch
    (block_m - 1)) / block_m``, ``heads`` programs a tile."""
    max_tiles = -(-max_seqlen_q // block_m)
    if total_q == 0 or max_tiles == 0:
        return None
    size = heads * min(max_tiles * batch, (total_q + batch * (block_m - 1)) // block_m)
    n_costs = min(1 << (-(-max_seqlen_k // block_n) + 1).bit_length(), MAX_COSTS)
    scalars = (batch, total_q, total_k, max_tiles, heads, size, window_left, window_right)
    meta = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "N_COSTS": n_costs,
        "IS_CAUSAL": causal,
        "HAS_WINDOW": has_window,
        "CHUNK_B": CHUNK_B,
        "CHUNK_R": CHUNK_R,
        "num_warps": 4,
    }
    return WorkList(size, scalars, meta)


@functools.cache
def launcher() -> Launcher:
    """The list kernel's ``Launcher`` (CU_Q, CU_K and WORK come first)."""
    from flashcore.kernels.varlen import work_list_kernel

    return Launcher(work_list_kernel, 3)


def build(work: WorkList, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """The list of ``work`` for these offsets, on their device: int32, its length, then
    ``work.size`` pairs, then the list program's scratch."""
    size = 2 + 2 * (work.size + work.meta["N_COSTS"])
    out = torch.empty(size, dtype=torch.int32, device=cu_seqlens_q.device)
    launcher()((1,), (cu_seqlens_q, cu_seqlens_k, out, *work.scalars), work.meta, planned=True)
    return out
