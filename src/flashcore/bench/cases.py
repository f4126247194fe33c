"""Benchmark cases: shapes, presets and the ``--shape`` syntax.

A case is one attention problem: q and k ``(B, H, Sq, D)``, ``(B, Hkv, Sk, D)``, v
``(B, Hkv, Sk, Dv)`` (the value head dim Dv is D unless a shape says otherwise, as MLA's
``192:128``), causal or not. Presets list shapes and the causal settings each is run with;
``--causal on|off`` narrows them.

A case may carry a local window ``(left, right)`` (``--window``): query i sees keys ``i + d - left``
to ``i + d + right`` (``d = Sk - Sq``, bottom-right as the causal mask; -1 unbounded on that side;
with causal the right side is 0), flashcore's ``window=``.

A varlen case also has per-sequence lengths (``seqlens``, the same for queries and keys): sequence
b holds ``seqlens[b]`` real tokens and its shape's ``S`` is the padded length (the longest), so
``(B, H, S, D)`` is the zero-padded batch and the packed one holds ``sum(seqlens)`` tokens.
"""

from __future__ import annotations

import random
from typing import NamedTuple

SHAPE_SYNTAX = "B,H,S,D[:Dv][,Hkv[,Sk]]"
MAX_HEAD_DIM = 256


class Shape(NamedTuple):
    batch: int
    heads: int
    seqlen_q: int
    head_dim: int
    """D: the head dim of q and k (the QK^T product)."""
    kv_heads: int
    seqlen_k: int
    value_dim: int
    """Dv: the head dim of v and out (the PV product); D unless the shape says otherwise."""

    @property
    def spec(self) -> str:
        """The shape in ``--shape`` syntax (optional fields only when they differ)."""
        dims = f"{self.head_dim}" if self.value_dim == self.head_dim else self.dims
        text = f"{self.batch},{self.heads},{self.seqlen_q},{dims}"
        if self.seqlen_k != self.seqlen_q:
            return f"{text},{self.kv_heads},{self.seqlen_k}"
        if self.kv_heads != self.heads:
            return f"{text},{self.kv_heads}"
        return text

    @property
    def dims(self) -> str:
        """``D:Dv``, the head dims of q/k and of v."""
        return f"{self.head_dim}:{self.value_dim}"


class Case(NamedTuple):
    shape: Shape
    causal: bool
    seqlens: tuple[int, ...] | None = None
    """Varlen: the real length of each sequence (queries and keys); None for a dense case."""
    window: tuple[int, int] | None = None
    """A local window ``(left, right)`` (module docstring), or None."""

    @property
    def padding(self) -> float:
        """Share of the padded ``(B, S)`` tokens that are padding (0 for a dense case)."""
        if self.seqlens is None:
            return 0.0
        return 1 - sum(self.seqlens) / (self.shape.batch * self.shape.seqlen_q)

    @property
    def label(self) -> str:
        text = f"{self.shape.spec} {'causal' if self.causal else 'full'}"
        if self.window is not None:
            text += f" window {self.window[0]},{self.window[1]}"
        return text if self.seqlens is None else f"{text} varlen pad {self.padding:.0%}"


def shape(
    b: int,
    h: int,
    s: int,
    d: int,
    hkv: int | None = None,
    sk: int | None = None,
    *,
    dv: int | None = None,
) -> Shape:
    return Shape(
        b, h, s, d, h if hkv is None else hkv, s if sk is None else sk, d if dv is None else dv
    )


def parse_shape(text: str) -> Shape:
    """Parse ``B,H,S,D[:Dv][,Hkv[,Sk]]``; raises ValueError with a message for the command line.

    ``192:128`` in the D field is D=192 for q and k, Dv=128 for v (MLA); a plain D is Dv = D.
    """
    parts = [p.strip() for p in text.split(",")]
    if not 4 <= len(parts) <= 6:
        raise ValueError(f"expected {SHAPE_SYNTAX} (4 to 6 integers), got {text!r}")
    names = ["B", "H", "S", "D", "Hkv", "Sk"]
    fields = []
    for name, part in zip(names, parts, strict=False):
        head, colon, tail = part.partition(":")
        if colon and name != "D":
            raise ValueError(
                f"only D takes a value head dim (D:Dv, as 192:128), got {name}={part!r} in {text!r}"
            )
        fields += [(name, head), ("Dv", tail)] if colon else [(name, head)]
    values = {}
    for name, part in fields:
        try:
            values[name] = int(part)
        except ValueError:
            raise ValueError(f"expected {SHAPE_SYNTAX} with integers, got {text!r}") from None
        if values[name] < 1:
            raise ValueError(f"{name} must be a positive integer, got {values[name]} in {text!r}")
    result = shape(
        values["B"], values["H"], values["S"], values["D"], values.get("Hkv"), values.get("Sk"),
        dv=values.get("Dv"),
    )  # fmt: skip
    if result.heads % result.kv_heads:
        raise ValueError(
            f"H ({result.heads}) must be a multiple of Hkv ({result.kv_heads}) in {text!r}"
        )
    for name, dim in (("D", result.head_dim), ("Dv", result.value_dim)):
        if dim > MAX_HEAD_DIM:
            raise ValueError(
                f"{name} must be at most {MAX_HEAD_DIM} (flashcore's limit), got {dim} in {text!r}"
            )
    return result


WINDOW_SYNTAX = "LEFT,RIGHT"


def parse_window(text: str) -> tuple[int, int]:
    """Parse ``LEFT,RIGHT`` (integers, -1 for a side without a bound, not both -1); raises
    ValueError with a message for the command line."""
    parts = [p.strip() for p in text.split(",")]
    try:
        left, right = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected {WINDOW_SYNTAX} (two integers), got {text!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be >= 0, or -1 for no bound; got {text!r}")
    if left == right == -1:
        raise ValueError(f"window -1,-1 bounds neither side (leave --window out); got {text!r}")
    return left, right


BOTH = (False, True)
VARLEN_MIN_FRACTION = 0.1


def draw_seqlens(batch: int, max_seqlen: int, *, seed: int = 0) -> tuple[int, ...]:
    """Sequence lengths for a varlen case, fixed by ``seed``: about 45% of the padded batch is
    padding.

    Fractions of ``max_seqlen`` are drawn uniformly on [0.1, 1], one per equal slice of that range
    (stratified, so that a batch of 16 already has a mean close to 0.55), and shuffled; the longest
    sequence is set to ``max_seqlen`` so that the padded length is tight (no all-padding columns,
    the most favourable padding for the padded providers).
    """
    rng = random.Random(seed)
    span = 1 - VARLEN_MIN_FRACTION
    fractions = [VARLEN_MIN_FRACTION + span * (b + rng.random()) / batch for b in range(batch)]
    rng.shuffle(fractions)
    lens = [max(1, round(f * max_seqlen)) for f in fractions]
    lens[lens.index(max(lens))] = max_seqlen
    return tuple(lens)


def _seed() -> list[tuple[Shape, tuple[bool, ...]]]:
    return [
        (shape(1, 8, 512, 64), BOTH),
        (shape(2, 8, 2048, 64), BOTH),
        (shape(2, 8, 2048, 128), (False,)),
    ]


def _sweep() -> list[tuple[Shape, tuple[bool, ...]]]:
    # The FlashAttention papers' sweep: H * D = 2048 and B * S = 16384 (constant total tokens and
    # model width), S from 512 to 16k, D 64 and 128, causal and not.
    cases = []
    for head_dim in (64, 128):
        for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
            cases.append((shape(16384 // seqlen, 2048 // head_dim, seqlen, head_dim), BOTH))
    return cases


def _smoke() -> list[tuple[Shape, tuple[bool, ...]]]:
    # Tiny, for the CPU interpreter: block multiples; GQA with ragged Sq < Sk (SDPA gets an
    # explicit bottom-right mask when causal); decode-like single query.
    return [
        (shape(1, 2, 128, 64), BOTH),
        (shape(1, 4, 97, 32, 2, 160), BOTH),
        (shape(2, 2, 1, 64, 1, 203), (False,)),
    ]


def _decode() -> list[tuple[Shape, tuple[bool, ...]]]:
    # KV-cache decoding, Llama-style GQA (32 query heads on 8 kv heads, D=128): one new query
    # against 4k to 32k cached keys, batch 1 and 8. Sq=1 sees every key, so causal or not is the
    # same problem; it runs as "full" so that SDPA takes its mask-free kernels.
    return [
        (shape(batch, 32, 1, 128, 8, cache), (False,))
        for batch in (1, 8)
        for cache in (4096, 16384, 32768)
    ]


def _decode_smoke() -> list[tuple[Shape, tuple[bool, ...]]]:
    # The decode preset's structure at interpreter sizes: GQA, cache lengths not tile multiples.
    return [(shape(2, 4, 1, 32, 2, 80), (False,)), (shape(1, 2, 1, 64, 1, 48), (False,))]


def _varlen() -> list[tuple[Shape, tuple[bool, ...], tuple[int, ...]]]:
    # Packed training batches: 16 sequences of seeded lengths (~45% of the padded batch is
    # padding), H=16 at D=128 with padded lengths 1k and 4k; H=32 at D=64 (the same width).
    shapes = [shape(16, 16, 1024, 128), shape(16, 16, 4096, 128), shape(16, 32, 4096, 64)]
    return [(s, BOTH, draw_seqlens(s.batch, s.seqlen_q)) for s in shapes]


def _varlen_smoke() -> list[tuple[Shape, tuple[bool, ...], tuple[int, ...]]]:
    # The varlen preset's structure at interpreter sizes; GQA and odd lengths in the second case.
    return [
        (shape(3, 2, 48, 32), BOTH, draw_seqlens(3, 48)),
        (shape(4, 4, 37, 16, 2), (False,), draw_seqlens(4, 37, seed=1)),
    ]


def _paged_prefill() -> list[tuple[Shape, tuple[bool, ...], tuple[int, ...]]]:
    # Prefill from a paged KV cache, Llama-style GQA (32 query heads on 8 kv heads, D=128):
    # packed batches of seeded lengths (the varlen preset's draw), causal; 4 sequences at 16k.
    shapes = [
        shape(16, 32, 1024, 128, 8),
        shape(16, 32, 4096, 128, 8),
        shape(4, 32, 16384, 128, 8),
    ]
    return [(s, (True,), draw_seqlens(s.batch, s.seqlen_q)) for s in shapes]


def _paged_prefill_smoke() -> list[tuple[Shape, tuple[bool, ...], tuple[int, ...]]]:
    # The paged-prefill preset's structure at interpreter sizes: several 16-key pages per
    # sequence with a partial last page; GQA and odd lengths in the second case.
    return [
        (shape(3, 2, 48, 32), (True,), draw_seqlens(3, 48)),
        (shape(4, 4, 37, 16, 2), (True,), draw_seqlens(4, 37, seed=1)),
    ]


PRESETS = {
    "seed": (
        _seed,
        "(1,8,512,64), (2,8,2048,64) causal and not; (2,8,2048,128) non-causal",
    ),
    "sweep": (_sweep, "FlashAttention papers' sweep: H*D=2048, B*S=16384, S 512..16k, D 64/128"),
    "smoke": (_smoke, "tiny shapes for the CPU interpreter (correctness; no performance)"),
    "decode": (
        _decode,
        "KV-cache decoding: Sq=1, H=32, Hkv=8, D=128, cache 4k/16k/32k, batch 1 and 8 "
        "(default providers: the flashcore-kvcache* ones, sdpa, flex)",
    ),
    "decode-smoke": (_decode_smoke, "the decode preset at CPU-interpreter sizes"),
    "varlen": (
        _varlen,
        "packed variable-length batches: B=16, seeded lengths, about 45 percent padding, "
        "H=16 D=128 at S_max 1k/4k, H=32 D=64 at 4k, causal and not (default providers: "
        "flashcore-varlen and the padded ones)",
    ),
    "varlen-smoke": (_varlen_smoke, "the varlen preset at CPU-interpreter sizes"),
    "paged-prefill": (
        _paged_prefill,
        "prefill against a paged KV cache: packed batches of seeded lengths (as varlen), H=32, "
        "Hkv=8, D=128, S_max 1k/4k (B=16) and 16k (B=4), causal; forward only (default "
        "providers: flashcore-varlen on dense packed k/v, the flashcore-varlen-paged* ones on "
        "pages of 16 and 256 keys in shuffled order, sdpa-padded)",
    ),
    "paged-prefill-smoke": (
        _paged_prefill_smoke,
        "the paged-prefill preset at CPU-interpreter sizes",
    ),
}
DECODE_PRESETS = ("decode", "decode-smoke")
VARLEN_PRESETS = ("varlen", "varlen-smoke")
PAGED_PREFILL_PRESETS = ("paged-prefill", "paged-prefill-smoke")
GPU_PRESETS = ("seed", "sweep", "decode", "varlen", "paged-prefill")


def preset_cases(name: str) -> list[Case]:
    """A preset's entries are ``(shape, causal settings[, seqlens])``."""
    return [Case(s, c, *varlen) for s, causals, *varlen in PRESETS[name][0]() for c in causals]


def select_cases(presets: list[str], shapes: list[Shape], causal: str) -> list[Case]:
    """Cases of the presets, then of the one-off shapes (both causal settings), filtered by
    ``causal`` ("both", "on", "off"); duplicates removed, order kept."""
    cases = [c for name in presets for c in preset_cases(name)]
    cases += [Case(s, c) for s in shapes for c in BOTH]
    keep = {"both": BOTH, "on": (True,), "off": (False,)}[causal]
    return list(dict.fromkeys(c for c in cases if c.causal in keep))
