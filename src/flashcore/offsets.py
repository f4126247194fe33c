"""Checked mode: validate the offsets the kernels otherwise trust, at the cost of a device sync.

By default ``cu_seqlens_q/k``, the maxima, ``cache_seqlens`` and ``block_table`` entries are
trusted, as in FlashAttention: reading them on the host would stall the stream. Inside
``flashcore.checked()`` (scoped to the current thread and context, never global) the public
functions read them back and raise ``ValueError`` naming the argument when they are not as
documented. Under ``torch.compile`` the checks are skipped (they would break the graph).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator

import torch

_checked: contextvars.ContextVar[bool] = contextvars.ContextVar("flashcore_checked", default=False)


@contextlib.contextmanager
def checked(enabled: bool = True) -> Iterator[None]:
    """Context manager: inside it, FlashCore validates every offset argument on the host (one
    device sync per call) and raises ``ValueError`` naming a bad one::

        with flashcore.checked():
            out = flashcore.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    token = _checked.set(enabled)
    try:
        yield
    finally:
        _checked.reset(token)


def active() -> bool:
    # Compiling first: dynamo cannot trace ContextVar.get (the checks are skipped there anyway).
    return not torch.compiler.is_compiling() and _checked.get()


def check_cu_seqlens_values(
    name: str, cu: torch.Tensor, total: int | None, max_name: str, max_seqlen: int
) -> list[int]:
    """``cu`` starts at 0, never decreases, ends at ``total`` (None: not checked), and no
    sequence is longer than ``max_seqlen``. Returns the sequence lengths."""
    bounds = cu.tolist()
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    for i, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"{name} must not decrease, got {bounds[i]} then {bounds[i + 1]}")
    if total is not None and bounds[-1] != total:
        raise ValueError(f"{name} must end at the packed total ({total}), got {bounds[-1]}")
    longest = max(lengths, default=0)
    if longest > max_seqlen:
        raise ValueError(
            f"{max_name} ({max_seqlen}) is smaller than the longest sequence of {name} ({longest})"
        )
    return lengths


def check_block_table_values(
    block_table: torch.Tensor, lengths: list[int], block_size: int, num_blocks: int
) -> None:
    """The entries each sequence reads (its first ``ceil(length / block_size)``) are pages of
    the cache, ``[0, num_blocks)``."""
    table = block_table.tolist()
    for b, n in enumerate(lengths):
        used = -(-n // block_size)
        if used > len(table[b]):
            raise ValueError(
                f"block_table row {b} has {len(table[b])} entries, sequence {b} needs {used}"
            )
        for j, page in enumerate(table[b][:used]):
            if not 0 <= page < num_blocks:
                raise ValueError(
                    f"block_table[{b}, {j}] = {page} is not a page of the cache "
                    f"(0 to {num_blocks - 1})"
                )


def check_cache_seqlens_values(cache_seqlens: torch.Tensor, capacity: int) -> list[int]:
    lengths = cache_seqlens.tolist()
    for b, n in enumerate(lengths):
        if not 0 <= n <= capacity:
            raise ValueError(f"cache_seqlens[{b}] = {n} is outside [0, capacity] = [0, {capacity}]")
    return lengths
