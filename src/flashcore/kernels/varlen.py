"""Packed variable-length batches (FlashAttention-2's varlen): where a sequence's rows are.

A packed batch stores its sequences back to back along the row dim of a ``(total, heads, D)``
tensor; ``CU`` holds the int32 prefix sums ``[0, len_0, len_0 + len_1, ..., total]`` of their
lengths. The kernels take the batch index from the grid, call ``seq_bounds`` in their prologue,
move their base pointers to the sequence's first row and run the sequence as one ordinary
problem of its own lengths.
"""

import triton
import triton.language as tl


@triton.jit
def seq_bounds(CU, b, total):
    """``(first row, length)`` of sequence b: ``CU[b]`` as int64 (it scales row strides into
    offsets that may pass 2**31) and ``CU[b + 1] - CU[b]`` as int32, like the kernels' lengths.

    Both offsets are clamped to ``[0, total]`` (the packed rows, or a paged sequence's capacity)
    and the end to at least the start: offsets that are not as documented give wrong numbers for
    their own sequence, never an access outside the tensors."""
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), total)
    end = tl.minimum(tl.maximum(tl.load(CU + b + 1), start), total)
    return start.to(tl.int64), end - start
