"""Every test case, in named tiers. Narrow a run with ``-k``.

A case is (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim).
- INTERP: tiny and odd, run through the interpreter in CI (and compiled on a GPU).
- SDPA: the SDPA drop-in's top-left causal mapping (Sq < Sk, Sq > Sk, Sq = Sk), interpreter.
- GPU: real sizes, compiled kernels only.
- DETERMINISM: repeated runs must be bit-identical (GPU).
- HUGE: q with more than 2**31 elements (GPU, ~9 GB each in fp16).
- SANITIZE: small shapes for scripts/sanitize.sh (compute-sanitizer).
- VARLEN / VARLEN_GPU / SANITIZE_VARLEN: packed variable-length batches (``attention_varlen``),
  as VarlenCase.
- MASKS / MASKS_GPU: sliding window, softcap and ALiBi (``MaskCase``), interpreter and GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Case(NamedTuple):
    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int

    @property
    def id(self) -> str:
        return (
            f"b{self.batch}h{self.heads}kv{self.kv_heads}"
            f"-q{self.seqlen_q}k{self.seqlen_k}-d{self.head_dim}"
        )


class MaskCase(NamedTuple):
    """A case with the score modifiers of ``flashcore.attention``; ``alibi`` is the slopes' shape,
    ``"h"`` for ``(H,)`` or ``"bh"`` for ``(B, H)`` (made by ``helpers.mask_options``)."""

    case: Case
    causal: bool = False
    window: tuple[int, int] | None = None
    softcap: float | None = None
    alibi: str | None = None

    @property
    def id(self) -> str:
        parts = [self.case.id, "causal" if self.causal else "full"]
        if self.window is not None:
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.alibi is not None:
            parts.append(f"alibi_{self.alibi}")
        return "-".join(parts)


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

INTERP = [
    Case(1, 1, 1, 1, 1, 16),  # single query, single key
    Case(2, 2, 1, 1, 257, 64),  # decode-like Sq=1, MQA
    Case(1, 4, 2, 45, 77, 80),  # Sq < Sk, GQA, padded head dim
    Case(1, 2, 2, 83, 45, 64),  # Sq > Sk: causal leaves rows with no key
    Case(1, 2, 1, 129, 129, 128),  # ragged in both directions, one past a block multiple
    Case(1, 1, 1, 64, 96, 256),  # block multiples, largest head dim
    Case(2, 3, 3, 33, 17, 16),  # Sq > Sk, ragged, smallest head dim
    Case(1, 2, 2, 47, 47, 96),  # head dim 96 (padded to 128)
]

SDPA = [
    Case(1, 2, 2, 5, 37, 16),  # Sq < Sk: top-left sees only the first Sq keys
    Case(2, 4, 2, 37, 5, 32),  # Sq > Sk, GQA: a causal square plus full rows
    Case(1, 2, 1, 40, 40, 64),  # Sq = Sk: both alignments agree
    Case(1, 1, 1, 1, 17, 80),  # single query sees key 0 only
]

GPU = [
    Case(2, 16, 16, 4096, 4096, 128),
    Case(2, 16, 4, 2048, 2048, 64),
    Case(1, 8, 8, 1024, 4096, 256),
    Case(1, 8, 1, 4096, 1024, 128),
    Case(4, 8, 2, 1000, 3001, 80),
    Case(2, 4, 4, 777, 777, 192),
    Case(2, 32, 8, 513, 513, 32),
]

DETERMINISM = [
    Case(2, 8, 2, 1000, 1500, 128),
    Case(1, 4, 4, 777, 513, 80),
]

# q.numel() > 2**31 = 2_147_483_648: across batch x heads (read as (B, S, H, D)), and in one head.
HUGE = [
    Case(2, 32, 8, 2**18 + 17, 300, 128),
    Case(1, 1, 1, 2**24 + 33, 256, 128),
]

# The interpreter tier (ragged edges, Sq != Sk both ways, GQA/MQA, head dims 16 to 256) plus
# block multiples of the GPU tiles and a ragged head dim 256.
SANITIZE = [
    *INTERP,
    Case(1, 2, 2, 128, 128, 128),
    Case(1, 2, 1, 200, 333, 256),
]

# MLA's head dims (q and k at 192, v at SANITIZE_MLA_DV) for ``sanitize_cases.py --mla``: the
# Hopper forward's one-Q-buffer persistent grid (causal, and non-causal up to 16 key tiles) with
# ragged tiles, GQA/MQA, Sq > Sk (causal rows that see no key), several tiles a program, and the
# flat grid past 16 key tiles.
SANITIZE_MLA_DV = 128
SANITIZE_MLA = [
    Case(2, 4, 1, 700, 300, 192),
    Case(1, 8, 2, 777, 1500, 192),
    Case(2, 16, 4, 1000, 1000, 192),
    Case(1, 4, 4, 64, 64, 192),
    Case(1, 4, 2, 300, 2100, 192),
]

# The Hopper forward's persistent causal grid dealt dynamically (``sanitize_cases.py --deal``: its
# producer hands the consumers their work items through shared memory), which the cases above
# never reach, each with v's head dim (None: the case's): D = 64 at 512 on one consumer with three
# CTAs an SM (taken from six rounds of 128-row tiles, dealt at every length: 1024 tiles here), and
# MLA's head dims at 4096 (dealt from there on; 192 tiles of 128 rows, past the 132 of a wave).
SANITIZE_DEAL = [
    (Case(4, 64, 64, 512, 512, 64), None),
    (Case(1, 6, 6, 4096, 4096, 192), SANITIZE_MLA_DV),
]

# Backward, interpreter tier: every case runs in fp16, bf16 and fp32, full and causal. Lengths are
# odd against both backward configs (16x32 for dK/dV, 32x16 for dQ) so every tile edge is ragged
# somewhere, and the features the backward treats specially are all here.
BWD_INTERP = [
    Case(1, 1, 1, 2, 3, 16),  # one tile each way, smallest head dim
    Case(2, 2, 1, 1, 77, 64),  # Sq=1 (decode-like), MQA: one dK/dV program sums 2 heads
    Case(1, 4, 2, 45, 77, 80),  # GQA, Sq < Sk, head dim padded to 128
    Case(1, 2, 2, 83, 45, 64),  # Sq > Sk: causal leaves 38 rows with no key (zero dQ)
    Case(1, 3, 1, 17, 17, 128),  # MQA over 3 heads, one ragged tile each way
    Case(1, 1, 1, 64, 96, 256),  # block multiples (EVEN_M/EVEN_N), largest head dim
    Case(2, 3, 3, 33, 17, 16),  # Sq > Sk, ragged, smallest head dim
]

# Backward, GPU tier: real sizes, fp16 and bf16, full and causal.
BWD_GPU = [
    Case(1, 16, 16, 4096, 4096, 128),  # batch 1: the float64 reference keeps ~6 score-sized tensors
    Case(2, 16, 4, 2048, 2048, 64),
    Case(1, 8, 8, 1024, 4096, 256),
    Case(1, 8, 1, 4096, 1024, 128),
    Case(4, 8, 2, 1000, 3001, 80),
    Case(2, 4, 4, 777, 777, 192),
    Case(2, 32, 8, 513, 513, 32),
    Case(4, 8, 8, 1, 4096, 96),
]


class VarlenCase(NamedTuple):
    """A packed batch: sequence b has ``seqlens_q[b]`` queries and ``seqlens_k[b]`` keys."""

    heads: int
    kv_heads: int
    seqlens_q: tuple[int, ...]
    seqlens_k: tuple[int, ...]
    head_dim: int
    head_dim_v: int | None = None  # v's head dim, None: head_dim

    @property
    def id(self) -> str:
        q = "_".join(map(str, self.seqlens_q))
        k = "_".join(map(str, self.seqlens_k))
        dv = f"-dv{self.head_dim_v}" if self.head_dim_v else ""
        return f"h{self.heads}kv{self.kv_heads}-q{q}-k{k}-d{self.head_dim}{dv}"


# Interpreter tier, forward and backward, every dtype, full and causal. In one batch: Sq < Sk,
# Sq = Sk, a sequence with no query (its dK/dV must be 0) and one with no key (out 0, lse -inf);
# Sq > Sk (causal rows that see no key); lengths ragged against every interpreter block size.
VARLEN = [
    VarlenCase(2, 1, (1, 37, 0, 64), (5, 37, 3, 0), 32),  # MQA
    VarlenCase(4, 2, (50, 3, 17), (20, 40, 17), 80),  # GQA, padded head dim
]

# GPU tier: 8 sequences of mixed lengths up to 4096 (fixed, so failures reproduce).
VARLEN_GPU = [
    VarlenCase(
        16,
        4,
        (4096, 1, 777, 2048, 0, 3001, 130, 1500),
        (4096, 513, 777, 1000, 64, 3001, 0, 2500),
        128,
    ),
    VarlenCase(
        8, 8, (1023, 4096, 17, 2500, 999, 64, 3333, 1), (1023, 4096, 17, 2500, 999, 64, 3333, 1), 64
    ),
]


# Packed batches (``sanitize_cases.py --varlen``, through ``attention_varlen``): lengths that vary
# (the Hopper forward's flat grid with its work list) with GQA, Sq != Sk both ways and empty
# sequences; near-equal lengths (the dense rules' grid); MLA's head dims under MQA; head dim 256.
# Forward and backward: the packed backward builds hand row statistics and zeroed rows between
# partitions (scripts/racecheck_triage.py's hand-overs).
SANITIZE_VARLEN = [
    VarlenCase(8, 2, (300, 1, 0, 700, 129), (300, 64, 17, 1000, 0), 128),
    VarlenCase(4, 4, (512, 500, 512, 449), (512, 500, 512, 449), 64),
    VarlenCase(4, 1, (700, 65, 1), (700, 300, 5), 192, SANITIZE_MLA_DV),
    VarlenCase(2, 1, (200, 1, 129), (333, 64, 0), 256),
]


class DecodeCase(NamedTuple):
    """A KV-cache decoding problem: q ``(B, H, Sq, D)`` against a cache of capacity ``s_max``
    holding ``seqlens[b]`` valid keys per sequence; ``block_size`` 0 is a contiguous
    ``(B, Hkv, s_max, D)`` cache, otherwise a paged one with a shuffled block table."""

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    s_max: int
    head_dim: int
    seqlens: tuple[int, ...]
    block_size: int

    @property
    def id(self) -> str:
        cache = f"paged{self.block_size}" if self.block_size else "dense"
        lens = "_".join(map(str, self.seqlens))
        return (
            f"b{self.batch}h{self.heads}kv{self.kv_heads}-q{self.seqlen_q}-{cache}"
            f"{self.s_max}-L{lens}-d{self.head_dim}"
        )


# Decoding, interpreter tier (the interpreter's decode tiles hold 16 keys). Lengths 0 (no key),
# 1, full capacity and ragged ones; Sq = 3 makes rows of short sequences see no key.
DECODE = [
    DecodeCase(3, 4, 2, 1, 96, 64, (96, 0, 37), 0),  # GQA, dense, empty and full sequences
    DecodeCase(3, 4, 1, 3, 80, 32, (1, 80, 49), 16),  # MQA, speculative Sq=3, paged 16
    DecodeCase(2, 2, 2, 1, 64, 80, (64, 17), 32),  # MHA, paged 32, padded head dim
    DecodeCase(2, 8, 2, 3, 100, 16, (2, 97), 0),  # G*Sq = 12 padded to 16 rows, ragged
]

# Decoding, GPU tier: Llama-style GQA (32 query heads on 8 kv heads), D=128, bf16, long caches.
DECODE_GPU = [
    DecodeCase(1, 32, 8, 1, 32768, 128, (32768,), 0),
    DecodeCase(8, 32, 8, 1, 4096, 128, (4096, 1, 4000, 2049, 17, 4096, 3000, 128), 0),
    DecodeCase(8, 32, 8, 1, 8192, 128, (8192, 5000, 1, 8191, 4096, 333, 7000, 16), 16),
    DecodeCase(1, 32, 8, 1, 16384, 128, (16000,), 256),
    DecodeCase(8, 32, 8, 1, 32768, 128, (32768,) * 4 + (20000, 9, 30000, 12345), 256),
]

# Score modifiers, interpreter tier: forward and backward in fp16, bf16 and fp32. Lengths are odd
# against the interpreter tiles (32x16 forward; 16x32 and 32x16 backward), windows narrower and
# wider than a tile, so every part of the tile ranges (masked head band, full middle, masked tail,
# no full tile at all) is visited; Sq > Sk windows leave rows with no key.
MASKS = [
    MaskCase(Case(1, 2, 1, 45, 70, 32), window=(8, 3)),  # both sides, Sq < Sk, MQA
    MaskCase(Case(1, 2, 2, 70, 45, 64), window=(3, 2)),  # Sq > Sk: rows 0..22 see no key
    MaskCase(Case(1, 2, 1, 33, 113, 32), window=(40, -1)),  # left only
    MaskCase(Case(1, 2, 1, 57, 57, 16), window=(-1, 5)),  # right only
    MaskCase(Case(1, 2, 1, 61, 77, 32), causal=True, window=(20, 7)),  # causal: right side 0
    MaskCase(Case(1, 2, 2, 50, 20, 32), window=(0, 1)),  # <= 2 keys a row, 29 rows with none
    MaskCase(Case(1, 2, 1, 45, 70, 32), softcap=1.0),  # saturated: most scores near +-1
    MaskCase(Case(1, 2, 2, 37, 37, 64), causal=True, softcap=50.0),  # tanh near 0 (small x)
    MaskCase(Case(1, 4, 2, 29, 45, 16), alibi="h"),  # GQA: per-head slopes in one dK/dV program
    MaskCase(Case(2, 2, 2, 29, 41, 64), causal=True, alibi="bh"),
    MaskCase(Case(1, 2, 1, 65, 47, 32), window=(12, 4), softcap=10.0, alibi="bh"),  # all at once
]

# Score modifiers, GPU tier: real sizes, fp16 and bf16 (a few in fp32 via the forward tests).
MASKS_GPU = [
    MaskCase(Case(2, 8, 2, 2048, 2048, 128), causal=True, window=(256, 0)),
    MaskCase(Case(1, 8, 8, 4096, 4096, 64), window=(512, 512)),
    MaskCase(Case(2, 4, 4, 1000, 3001, 80), window=(300, -1)),
    MaskCase(Case(1, 8, 1, 3001, 1000, 128), window=(100, 37)),  # Sq > Sk: rows with no key
    MaskCase(Case(2, 16, 16, 2048, 2048, 128), causal=True, softcap=30.0),
    MaskCase(Case(1, 8, 8, 1024, 4096, 256), softcap=50.0),
    MaskCase(Case(2, 8, 8, 1024, 3000, 128), causal=True, alibi="bh"),
    MaskCase(Case(2, 16, 4, 2048, 2048, 64), alibi="h"),
    MaskCase(Case(2, 8, 2, 2048, 2048, 128), causal=True, window=(511, 0), softcap=20, alibi="h"),
]
