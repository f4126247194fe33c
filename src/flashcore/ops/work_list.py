"""Work lists of packed batches for the Hopper forward's flat grid (``kernels/varlen.py:
work_list_kernel``).

A packed batch's grid used to be sized by its longest sequence: ``batch x cdiv(longest,
BLOCK_M) x heads`` programs, of which those past a shorter sequence's end only started and
exited (38% of them for 16 sequences of 256-4096 tokens), in an order that knew nothing of the
tiles' costs. With a work list the grid holds the most tiles the packed rows can make, each
program takes a real tile from a list that one small program builds on the device from the
offsets (no host sync), costliest first, and the programs past the list's end return at once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from flashcore.ops.launch import Launcher

# Sequences and query tiles the list program takes at a time (a 16 x 64 block of tiles).
CHUNK_B = 16
CHUNK_T = 64
# Costs (key tiles seen, plus one) sorted apart; costlier tiles share the last one. 2047 key
# tiles of 128 are 262k keys.
MAX_COSTS = 2048
# A list entry is ``b * 2**16 + t``.
MAX_TILES = 2**16
MAX_BATCH = 2**15


class WorkList(NamedTuple):
    """The list's launch but its tensors: its length (the grid's items), the scalar arguments
    and the constexprs of ``work_list_kernel``."""

    size: int
    scalars: tuple
    meta: dict


def plan(
    batch: int,
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
    """The work list of a packed batch whose longest sequences are ``max_seqlen_q`` /
    ``max_seqlen_k``, tiled by ``block_m`` query rows and ``block_n`` keys; None where an entry
    cannot hold its tile (``MAX_TILES``, ``MAX_BATCH``) or there is no row. Its length bounds the
    tiles from both sides: every sequence at most ``cdiv(max_seqlen_q, block_m)`` of them, and
    ``sum cdiv(len, block_m) <= (total_q + batch (block_m - 1)) / block_m``."""
    max_tiles = -(-max_seqlen_q // block_m)
    if total_q == 0 or max_tiles == 0 or max_tiles > MAX_TILES or batch >= MAX_BATCH:
        return None
    size = min(max_tiles * batch, (total_q + batch * (block_m - 1)) // block_m)
    n_costs = min(1 << (-(-max_seqlen_k // block_n) + 1).bit_length(), MAX_COSTS)
    scalars = (batch, total_q, total_k, max_tiles, size, window_left, window_right)
    meta = {
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "N_COSTS": n_costs,
        "IS_CAUSAL": causal,
        "HAS_WINDOW": has_window,
        "CHUNK_B": CHUNK_B,
        "CHUNK_T": CHUNK_T,
        "num_warps": 4,
    }
    return WorkList(size, scalars, meta)


@functools.cache
def launcher() -> Launcher:
    """The list kernel's ``Launcher`` (CU_Q, CU_K and WORK come first)."""
    from flashcore.kernels.varlen import work_list_kernel

    return Launcher(work_list_kernel, 3)


def build(work: WorkList, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """The list of ``work`` for these offsets, on their device: int32, ``work.size`` entries
    and the list program's scratch after them."""
    size = work.size + work.meta["N_COSTS"]
    out = torch.empty(size, dtype=torch.int32, device=cu_seqlens_q.device)
    launcher()((1,), (cu_seqlens_q, cu_seqlens_k, out, *work.scalars), work.meta)
    return out
