"""Public functions: validation, defaults and documentation. Launches nothing itself."""

from __future__ import annotations

import math
import numbers

import torch

from flashcore.ops import attention as _ops
from flashcore.ops.fwd import is_interpreted

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(
            f"{name} must have 4 dims (batch, heads, seqlen, head_dim), got {t.dim()} dims "
            f"with shape {tuple(t.shape)}"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    return t


def _check_inputs(q: object, k: object, v: object) -> None:
    q = _check_tensor("q", q)
    k = _check_tensor("k", k)
    v = _check_tensor("v", v)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    batch, heads, _, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape (batch, kv_heads, seqlen_k, head_dim), "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if k.shape[0] != batch:
        raise ValueError(f"k/v batch size must equal q's ({batch}), got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k/v head_dim must equal q's ({head_dim}), got {k.shape[3]}")
    kv_heads = k.shape[1]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"q's heads ({heads}) must be a multiple of k/v's heads ({kv_heads}) for GQA/MQA"
        )
    if head_dim > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"head_dim up to {MAX_HEAD_DIM} is supported, got q.shape[-1] = {head_dim}"
        )
    if head_dim == 0:
        raise ValueError("head_dim (q.shape[-1]) must be at least 1, got 0")
    if q.device.type == "cpu" and not is_interpreted():
        raise ValueError(
            "q is on the CPU, but FlashCore's kernels were defined for a GPU; set "
            "TRITON_INTERPRET=1 before triton is first imported (flashcore imports it at its "
            "first call) to run them through Triton's interpreter, or move the tensors to CUDA"
        )


def _check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # Tiles load whole rows of head_dim: a strided last dim would turn every vector load into
    # scalar gathers, so copy only then.
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention, fused: ``softmax(scale * q @ k^T [+ mask]) @ v``.

    Args:
        q: ``(B, H, Sq, D)`` queries.
        k: ``(B, Hkv, Sk, D)`` keys; ``H % Hkv == 0`` (Hkv < H is GQA, Hkv = 1 is MQA: query head h
            uses kv head ``h // (H // Hkv)``).
        v: ``(B, Hkv, Sk, D)`` values.
        causal: bottom-right aligned causal mask (FlashAttention-2's convention): query i sees key
            j iff ``j <= i + Sk - Sq``. With Sq = Sk this is the usual lower triangle::

                Sq=2, Sk=5 (x = sees)        Sq=5, Sk=2
                    k0 k1 k2 k3 k4               k0 k1
                q0   x  x  x  x  .           q0   .  .   <- sees no key: out 0, lse -inf
                q1   x  x  x  x  x           q1   .  .
                                             q2   .  .
                                             q3   x  .
                                             q4   x  x

            Note that ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` is
            top-left aligned instead (query i sees key j iff ``j <= i``); both agree when Sq = Sk.
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(D)``. Must be finite.
        return_lse: also return the logsumexp of each row.

    Returns:
        ``out`` ``(B, H, Sq, D)`` in q's dtype (and in q's memory layout when q is dense), or
        ``(out, lse)`` with ``lse`` float32 ``(B, H, Sq)``: the natural-log logsumexp of the scaled
        (and masked) scores. Rows that see no key have ``out = 0`` and ``lse = -inf``.

    Autograd: ``out`` (and ``lse``) are differentiable with respect to q, k and v, for every
    option above. The backward is FlashAttention-2's: it recomputes the probabilities from the
    saved LSE (only q, k, v, out and lse are kept for it), accumulates in fp32, writes every
    gradient from exactly one program (deterministic, no atomics) and returns dq, dk, dv in the
    dtype and, when dense, the memory layout of q, k, v (GQA/MQA gradients are summed over each
    kv head's query heads). A gradient reaching ``lse`` is supported too: it adds
    ``dlse_i * softmax_ij`` to the score gradients (the kernels fold it into the per-row term
    ``delta_i = rowsum(dout * out)_i - dlse_i``). Rows that see no key get zero gradients. The
    gradient of ``out`` may have any strides (one whose last dim is not unit-stride is copied).

    Inputs may have any strides (a ``(B, S, H, D)`` tensor passed as ``.transpose(1, 2)`` is read
    in place); only a last dim with a stride other than 1 is copied. Supported: float16, bfloat16
    and float32; any Sq, Sk; head dims 1 to 256. Tensors must be on a CUDA device, or on the CPU
    with ``TRITON_INTERPRET=1`` set before the first call (Triton's interpreter; slow, for tests).

    Raises:
        TypeError: an input is not a tensor, has an unsupported or mismatched dtype, or an option
            has the wrong type.
        ValueError: wrong rank, mismatched shapes or devices, heads not divisible, non-finite scale.
        NotImplementedError: head_dim above 256.
    """
    _check_inputs(q, k, v)
    causal = _check_flag("causal", causal)
    return_lse = _check_flag("return_lse", return_lse)
    scale = _check_scale(scale, q.shape[-1])
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    out, lse = _ops.attn_fwd(q, k, v, causal, scale)
    return (out, lse) if return_lse else out
