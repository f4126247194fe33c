"""Compile ahead of time the kernel variants a server will launch.

Triton compiles a kernel the first time it is launched with a new specialisation (seconds per
variant; the first launch is logged, ``flashcore.ops.runtime``). ``warmup`` makes those first
launches before traffic arrives: it runs the public functions once per combination of the options
it is given, on zero-filled tensors of the given sizes, and returns what compiled.

What selects a variant, and so what a warmup covers:

- dtype, head dim, causal, the window/softcap/ALiBi flags, varlen or not, backward or not, dense
  or paged decoding: each combination passed is run.
- The launch config, which follows from the sizes: tiles for short causal sequences (up to 1024
  queries) differ from long ones; forwards of at most 2**34 FLOPs use plain pointers instead of
  tensor descriptors (``tuning.TMA_MIN_FLOPS``); decoding splits the keys by the SM count and the
  cache capacity, and the split count sets the combine kernel's tile. Pass the lengths and batch
  sizes the server sees (``seqlens``, ``batch_sizes``).
- Triton's own specialisation of integer arguments (strides and sizes divisible by 16 or not) and
  of pointers (16-byte aligned or not): the sequence lengths given here are used as they are, so
  a length that is not a multiple of 16 and one that is select different kernels. Dense inputs of
  other lengths that end on a tile boundary (``EVEN_M``/``EVEN_N``) or not also differ.

- Whether the call is being captured into a CUDA graph: on an H100 a capture takes the Gluon
  kernels below the sizes an eager call does (no host cost at replay; ``tuning``'s
  ``SM90_*_GRAPH`` floors) and tensor descriptors for small forwards, where this process has
  run them (``runtime.in_capture``: loading a kernel inside a capture can void it), else the
  eager call's kernels. ``graphs=True`` runs every call a second time choosing as a capture
  would, so that capturing it later takes those kernels and loads nothing.

A call that selects a variant the warmup did not compile still works: it compiles on first use,
as without a warmup. Compiled kernels also land in Triton's on-disk cache (``~/.triton/cache`` by
default), so a second process loads them instead of compiling. Under Triton's interpreter (the
CPU) nothing compiles: the calls run (slowly) and the result is empty.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import torch

from flashcore import api
from flashcore.ops import runtime
from flashcore.ops.runtime import CompileEvent

log = logging.getLogger(__name__)

__all__ = ["CompileEvent", "warmup"]


def warmup(
    device: torch.device | str = "cuda",
    *,
    dtypes: Sequence[torch.dtype] = (torch.bfloat16,),
    head_dims: Sequence[int] = (128,),
    heads: tuple[int, int] = (32, 8),
    causal: Sequence[bool] = (True,),
    seqlens: Sequence[int] = (512, 4096),
    batch_sizes: Sequence[int] = (1,),
    varlen: bool = False,
    backward: bool = False,
    decode: bool = False,
    block_size: int | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi: bool = False,
    graphs: bool = False,
) -> list[CompileEvent]:
    """Run the kernels once for every combination of the options, so that they compile now.

    For each dtype, head dim, causal flag, sequence length ``S`` and batch size ``B``:

    - ``attention`` on q ``(B, H, S, D)`` and k, v ``(B, Hkv, S, D)`` with ``heads = (H, Hkv)``;
      with ``varlen=True`` instead ``attention_varlen`` on ``B`` packed sequences of length ``S``;
      with ``backward=True`` also the gradients of q, k and v.
    - with ``decode=True``, ``attention_with_kvcache`` for one new token per sequence
      (q ``(B, H, 1, D)``) against a full cache of ``S`` keys: dense, or paged in blocks of
      ``block_size`` keys (a multiple of 16) when one is given; ``num_splits`` chosen as in a
      call that leaves it None.
    - with ``varlen=True`` and a ``block_size``, also ``attention_varlen`` with a block table
      (paged prefill, forward only): the packed queries against ``B`` sequences of ``S`` keys
      in pages of ``block_size``.

    ``window``, ``softcap`` and ``alibi`` (slopes of shape ``(H,)``) are passed to every call as
    in the public functions. ``graphs=True`` runs each combination again as a CUDA-graph capture
    of it would choose its kernels (``runtime.as_captured``, with the backward on the calling
    thread), for a server that captures those calls. Sizes are used exactly as given: the
    module docstring says which properties of a call select a compiled variant, and so what a
    later call may still compile.

    Returns the kernel variants compiled (or loaded from Triton's on-disk cache) during the
    warmup, in order; empty under the interpreter, and for variants compiled earlier in the
    process. Raises what the public functions raise for the same arguments (a bad dtype or head
    dim, ``heads`` with ``H % Hkv != 0``, ...), ``RuntimeError`` for a CUDA device where torch
    sees none, and ``ValueError`` for an empty or non-positive
    ``seqlens`` or ``batch_sizes`` or a ``block_size`` that is not a positive multiple of 16.
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"warmup: device {str(device)!r} asked for, but torch sees no CUDA device (nothing to "
            "compile; on the CPU the kernels run through Triton's interpreter, which needs none)"
        )
    for name, sizes in (("seqlens", seqlens), ("batch_sizes", batch_sizes)):
        if not sizes or any(not isinstance(s, int) or s < 1 for s in sizes):
            raise ValueError(f"{name} must be positive ints, got {sizes!r}")
    if block_size is not None and (block_size < 16 or block_size % 16):
        raise ValueError(f"block_size must be a positive multiple of 16, got {block_size!r}")

    def run(combo: tuple) -> None:
        """``warmup``'s calls for one (dtype, head dim, causal, length, batch) combination."""
        dtype, head_dim, is_causal, seqlen, batch = combo
        num_heads, kv_heads = heads
        slopes = (
            torch.exp2(-torch.arange(1, num_heads + 1, dtype=torch.float32, device=device))
            if alibi
            else None
        )
        options = dict(causal=is_causal, window=window, softcap=softcap, alibi_slopes=slopes)

        def zeros(*shape: int, grad: bool = False, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, requires_grad=grad)

        def pages(per_seq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            """Zero-filled paged k and v caches of ``per_seq`` blocks a sequence, and a table."""
            k_cache, v_cache = (
                zeros(batch * per_seq, kv_heads, block_size, head_dim) for _ in "kv"
            )
            table = torch.arange(batch * per_seq, dtype=torch.int32, device=device)
            return k_cache, v_cache, table.view(batch, per_seq)

        if varlen:
            q = zeros(batch * seqlen, num_heads, head_dim, grad=backward)
            k, v = (zeros(batch * seqlen, kv_heads, head_dim, grad=backward) for _ in "kv")
            cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * seqlen
            out = api.attention_varlen(q, k, v, cu, cu, seqlen, seqlen, **options)
            if block_size is not None:
                k_cache, v_cache, table = pages(-(-seqlen // block_size))
                api.attention_varlen(
                    q.detach(), k_cache, v_cache, cu, cu, seqlen, seqlen, block_table=table,
                    **options,
                )  # fmt: skip
        else:
            q = zeros(batch, num_heads, seqlen, head_dim, grad=backward)
            k, v = (zeros(batch, kv_heads, seqlen, head_dim, grad=backward) for _ in "kv")
            out = api.attention(q, k, v, **options)
        if backward:
            torch.autograd.grad(out, (q, k, v), torch.zeros_like(out))
        if decode:
            q = zeros(batch, num_heads, 1, head_dim)
            lens = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
            if block_size is None:
                k_cache, v_cache = (zeros(batch, kv_heads, seqlen, head_dim) for _ in "kv")
                table = None
            else:
                k_cache, v_cache, table = pages(-(-seqlen // block_size))
            api.attention_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=lens, block_table=table, **options
            )

    before = len(runtime.compile_events())
    start = time.perf_counter()
    combos = list(itertools.product(dtypes, head_dims, causal, seqlens, batch_sizes))
    for combo in combos:
        run(combo)
    if graphs:
        # The capture's choices (runtime.capturing; backwards on this thread).
        with runtime.as_captured():
            for combo in combos:
                run(combo)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    events = runtime.compile_events()[before:]
    log.info(
        "warmup: %d kernel variants compiled in %.1f s", len(events), time.perf_counter() - start
    )
    return events
