"""Public functions: defaults and documentation; the input checks of ``flashcore.checks`` run
first. Launches nothing itself."""

from __future__ import annotations

import math
import numbers
import warnings

import torch

from flashcore import offsets as _offsets
from flashcore.checks import (
    MAX_HEAD_DIM,
    SUPPORTED_DTYPES,
    any_autocast,
    autocast_inputs,
    check_alibi,
    check_cu_seqlens,
    check_flag,
    check_inputs,
    check_kvcache_inputs,
    check_max_seqlen,
    check_num_splits,
    check_paged_varlen,
    check_scale,
    check_sinks,
    check_softcap,
    check_window,
    entry_inputs,
    forward_ad_active,
    runnable_device,
)
from flashcore.ops import express as _express
from flashcore.ops import registry as _ops
from flashcore.ops import transforms as _transforms  # noqa: F401 (the ops' vmap rules)
from flashcore.ops.runtime import use_tier as _use_tier


def use_tier(name: str):
    """Context manager: run the attention kernels inside the block on tier ``name``.

    ``"portable"``: the Triton (``tl``) kernels, on every device and the CPU interpreter.
    ``"sm90"``: the Gluon kernels of ``kernels/hopper`` (warp-specialised, TMA, async wgmma) on an
    sm_90 GPU (H100/H200) with a Triton version they were verified on (3.6 to 3.9), for fp16/bf16
    dense inputs with head dim 64 or 128 and 16-byte aligned strides; anything else they do not
    cover runs on the portable tier (with another Triton, everything: a warning says so once).
    The forward covers causal, window, softcap, ALiBi, sinks, GQA,
    any lengths and packed (varlen) batches; the backward too (never with
    ``deterministic``).
    ``"auto"`` (the default): each tier where it measured faster on the H100: the sm90 forward
    at head dims 128 and 64 from 512 queries and keys on (a window from 2048, softcap from 4096,
    ALiBi at head dim 128 from 4096), and
    3e10 FLOPs up (3e9 captured into a CUDA graph, no floor at head dim 64;
    ``tuning.sm90_forward``), the sm90
    backward at head dim 128 from 512 queries and keys on (causal: 1024), at 64 from 1024,
    and 3e10 FLOPs up (no FLOP floor captured into a CUDA graph; ``tuning.sm90_backward``),
    the portable kernels otherwise. A packed (varlen) batch without a block table takes the
    sm90 forward and backward by the same rules on its mean lengths (the forward at head dim
    64 from a mean of 2048 on; the backward at head dim 128 from a mean of 256, causal 384, at
    64 from 384); paged prefill and decoding
    always run on the portable tier. The choice is
    scoped to the current thread (a ``contextvars`` variable), never global; a backward runs
    on the tier that was in effect at its forward (eager calls; a graph compiled by
    ``torch.compile`` takes "auto" in its backward)::

        with flashcore.use_tier("sm90"):
            out = flashcore.attention(q, k, v, causal=True)
    """
    return _use_tier(name)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention, fused: ``softmax(scale * q @ k^T [+ mask]) @ v``.

    The scores, in order: ``s = scale * q @ k^T``; ``softcap * tanh(s / softcap)``; ``+ ALiBi``;
    ``-inf`` where the causal mask or the window hides a key. FlashAttention-2's semantics
    throughout.

    Args:
        q: ``(B, H, Sq, D)`` queries.
        k: ``(B, Hkv, Sk, D)`` keys; ``H % Hkv == 0`` (Hkv < H is GQA, Hkv = 1 is MQA: query head h
            uses kv head ``h // (H // Hkv)``).
        v: ``(B, Hkv, Sk, Dv)`` values; ``Dv`` may differ from D (MLA), 1 to 256.
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
        window: ``(left, right)`` sliding window, bottom-right aligned like ``causal``: query i
            sees key j iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``; ``-1`` leaves
            that side unbounded; None (the default) is ``(-1, -1)``. With ``causal=True`` the
            right side is 0 whatever it says (``(left, 0)`` and ``causal`` are the same mask)::

                window=(2, 1), Sq=Sk=6       window=(1, 0) = window=(1, -1), causal=True
                    k0 k1 k2 k3 k4 k5              k0 k1 k2 k3 k4 k5
                q0   x  x  .  .  .  .          q0   x  .  .  .  .  .
                q1   x  x  x  .  .  .          q1   x  x  .  .  .  .
                q2   x  x  x  x  .  .          q2   .  x  x  .  .  .
                q3   .  x  x  x  x  .          q3   .  .  x  x  .  .
                q4   .  .  x  x  x  x          q4   .  .  .  x  x  .
                q5   .  .  .  x  x  x          q5   .  .  .  .  x  x

            With Sq > Sk the first rows may see no key (out 0, lse -inf), as with ``causal``.
        softcap: ``c > 0`` caps the scaled scores as ``c * tanh(s / c)`` (Gemma 2, Grok) before
            ALiBi, the mask and the softmax. None or 0 is off. Must be finite and >= 0.
        alibi_slopes: float32 ``(H,)`` or ``(B, H)`` on q's device: adds
            ``-slope[b, h] * |i + Sk - Sq - j|`` to the (scaled, softcapped) score of query i and
            key j. The slopes get no gradient (they are constants in every ALiBi model).
        sinks: float32 ``(H,)`` on q's device, one learnable logit per query head (attention
            sinks, gpt-oss): one more term in every row's softmax, compared with the final
            scores (after scale, softcap, ALiBi and the mask), that carries no value:
            ``p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(sinks[h]))``. The LSE includes it; a
            row that sees no key gives out 0 and ``lse = sinks[h]``. Differentiable.
        deterministic: the backward gives bit-identical gradients over runs. Off (the default),
            an H100/H200 may run the faster Hopper backward (``use_tier``), whose dQ is a sum of
            atomic adds: equal to rounding, not bit for bit.
            ``torch.use_deterministic_algorithms(True)`` turns it on too. The forward is
            deterministic either way.

    Returns:
        ``out`` ``(B, H, Sq, Dv)`` in q's dtype (and in q's memory layout when q is dense), or
        ``(out, lse)`` with ``lse`` float32 ``(B, H, Sq)``: the natural-log logsumexp of the scaled
        (and masked) scores. Rows that see no key have ``out = 0`` and ``lse = -inf`` (``sinks[h]``
        with sinks).

    Autograd: ``out`` (and ``lse``) are differentiable with respect to q, k, v and ``sinks``, for
    every option above (not with respect to ``alibi_slopes``, which get no gradient: slopes that
    require grad raise a ValueError while grad mode is on), once: the gradients of a
    ``create_graph=True`` backward have their values, but differentiating them again (a second
    derivative, a gradient penalty) raises a RuntimeError. Reverse mode only: forward-mode AD
    (``torch.func.jvp``, ``jacfwd``, ``hessian``, ``torch.autograd.forward_ad``'s dual tensors)
    raises a NotImplementedError rather than lose the tangent; ``torch.func.grad``, ``vjp``,
    ``jacrev`` and ``vmap`` work (vmap folds the samples into the batch: ``ops/transforms.py``).
    The backward is FlashAttention-2's:
    it recomputes the probabilities from the saved LSE (only q, k, v, out, lse, the slopes and the
    sinks are kept for it), accumulates in fp32, writes every gradient from exactly one program
    (deterministic, no atomics; on an H100 by default dQ is reduce-added over key blocks instead,
    see ``deterministic``) and returns dq, dk, dv in the dtype and, when dense, the memory layout of
    q, k, v (GQA/MQA gradients are summed over each kv head's query heads). A gradient reaching
    ``lse`` is supported too: it adds ``dlse_i * softmax_ij`` to the score gradients (the kernels
    fold it into the per-row term ``delta_i = rowsum(dout * out)_i - dlse_i``). Rows that see no key
    get zero gradients (and, with sinks, pass ``dlse`` to the sink). The gradient of ``out`` may
    have any strides (one whose last dim is not unit-stride is copied).

    Inputs may have any strides (a ``(B, S, H, D)`` tensor passed as ``.transpose(1, 2)`` is read
    in place); only a last dim with a stride other than 1 is copied. Supported: float16, bfloat16
    and float32; any Sq, Sk; head dims 1 to 256. Under ``torch.autocast`` (on for q's device)
    float32, float16 and bfloat16 inputs run in autocast's dtype, as PyTorch's SDPA takes them
    (inputs of mixed dtypes that autocast makes alike too; out in that dtype, gradients in each
    input's own); the other entry points do the same. Tensors must be dense (strided, not sparse or
    nested) and on a CUDA device, or on the CPU with ``TRITON_INTERPRET=1`` set before the first
    call (Triton's interpreter; slow, for tests). Meta tensors (here, in ``attention_varlen`` and
    in ``attention_with_kvcache``) give meta outputs and gradients of the right shapes, through
    the registered ops' fake implementations.

    Empty sizes are fine: B, H (with Hkv = 0 too) or Sq of 0 give empty results without a launch;
    Sk = 0 gives ``out = 0`` and ``lse = -inf`` (every row sees no key), also without a launch.
    NaN and Inf propagate as in PyTorch's fused SDPA backends: a NaN in query row i makes output
    row i NaN (and only it); a NaN in key j makes NaN every row that sees j (rows causally masked
    from j stay exact); a NaN in ``v[j, d]`` makes column d NaN in every row that sees j (and may
    reach rows that share a key tile with j, as ``0 * NaN`` in the P @ V product).

    Raises:
        TypeError: an input is not a dense tensor, has an unsupported or mismatched dtype, or an
            option has the wrong type (``window`` not a pair of ints, ``alibi_slopes`` not
            float32).
        ValueError: wrong rank, mismatched shapes or devices, heads not divisible, non-finite scale,
            a window side below -1, a negative or non-finite softcap, ``alibi_slopes`` or
            ``sinks`` of the wrong shape or device.
        NotImplementedError: head_dim above 256; forward-mode AD (a jvp).
    """
    q, k, v = entry_inputs("flashcore.attention", q, k, v, sinks)
    key = None
    window_key = _express.window_key(window)
    if (
        window_key is not _express.NOT_KEYED
        and _scores_plain(softcap, alibi_slopes)
        and deterministic is False
    ):
        # A call of a signature checked and planned before (ops.express).
        key, result = _express.forward(q, k, v, causal, scale, return_lse, window_key, sinks)
        if result is not None:
            return result if return_lse else result[0]
    check_inputs(q, k, v)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale = check_scale(scale, q.shape[-1])
    # Options left at None skip their checks, which would return the defaults: ~1 us of the
    # ~12 us this function spends before the kernel on the 2-core CPU machine.
    window_left, window_right = (-1, -1) if window is None else check_window(window)
    if sinks is not None:
        sinks = _sinks_arg(check_sinks(sinks, q.shape[1], q.device))
    if key is not None:
        out, lse = _express.forward_first(
            key, q, k, v, causal, scale, (window_left, window_right), sinks
        )
        return (out, lse) if return_lse else out
    softcap = 0.0 if softcap is None else check_softcap(softcap)
    if alibi_slopes is not None:
        alibi_slopes = check_alibi(alibi_slopes, q.shape[0], q.shape[1], q.device)
    deterministic = check_flag("deterministic", deterministic)
    out, lse = _ops.attention(
        q, k, v, None, None, 0, 0, causal, scale, window_left, window_right, softcap,
        alibi_slopes, sinks, None, deterministic,
    )  # fmt: skip
    return (out, lse) if return_lse else out


def _scores_plain(softcap: object, alibi_slopes: object) -> bool:
    """No softcap or ALiBi: a call ``ops.express`` may key (its window where
    ``ops.express.window_key`` takes it, and for the forward its sinks)."""
    return softcap is None and alibi_slopes is None


def _sinks_arg(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels read the sinks with unit stride (a differentiable copy otherwise)."""
    return sinks if sinks is None or sinks.stride(0) == 1 else sinks.contiguous()


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` on a packed batch of variable-length sequences (FlashAttention-2's varlen).

    Sequence b is ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` against
    ``k/v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``, and its rows of the result are exactly what
    :func:`attention` gives on that slice alone (viewed as ``(1, H, S, D)``): the causal mask is
    bottom-right aligned per sequence (query i of the sequence sees key j iff
    ``j <= i + Sk_b - Sq_b``), and query and key lengths may differ per sequence::

        cu_seqlens_q = [0, 2, 5], cu_seqlens_k = [0, 3, 5], causal (x = sees)
                 k0 k1 k2 | k3 k4
            q0    x  x  . |  .  .      sequence 0: Sq=2, Sk=3
            q1    x  x  x |  .  .
            ------------------------
            q2    .  .  . |  .  .      sequence 1: Sq=3, Sk=2; q2 sees no key
            q3    .  .  . |  x  .
            q4    .  .  . |  x  x

    Args:
        q: ``(total_q, H, D)`` queries of every sequence, back to back.
        k: ``(total_k, Hkv, D)`` keys; ``H % Hkv == 0`` (GQA/MQA as in :func:`attention`).
        v: ``(total_k, Hkv, Dv)`` values (Dv may differ from D).
        cu_seqlens_q: int32 ``(B + 1,)`` on q's device: ``[0, Sq_0, Sq_0 + Sq_1, ..., total_q]``,
            non-decreasing. Empty sequences are allowed.
        cu_seqlens_k: int32 ``(B + 1,)``, the same for the keys (``..., total_k]``).
        max_seqlen_q: the longest query sequence, a Python int (it sizes the launch grid).
        max_seqlen_k: the longest key sequence, a Python int.
        causal, scale, return_lse, window, softcap: as in :func:`attention`, per sequence (the
            window is aligned to each sequence's own bottom-right corner).
        alibi_slopes: float32 ``(H,)`` or ``(B, H)`` (B = number of sequences), as in
            :func:`attention`, with positions counted within each sequence.
        sinks: float32 ``(H,)``, as in :func:`attention` (the same sinks for every sequence).
        block_table: int32 ``(B, max_blocks)``: k and v are then paged caches in
            :func:`attention_with_kvcache`'s layout, ``(num_blocks, Hkv, block_size, D)`` (and
            ``Dv``), block_size a multiple of 16; sequence b's keys are the first
            ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` of its pages in order (key j in page
            ``block_table[b, j // block_size]``, row ``j % block_size``): FlashAttention-2's
            paged varlen, for chunked prefill. ``max_seqlen_k`` is at most ``max_blocks *
            block_size`` (0 when no sequence has a key). Forward only: inputs that require a
            gradient raise.
        deterministic: as in :func:`attention` (on an H100 a packed batch's backward
            reduce-adds dQ over key blocks unless it is set).

    The contents of ``cu_seqlens_q``/``cu_seqlens_k`` and the maxima are trusted, as in
    FlashAttention: checking them would read device memory on the host and stall the stream.
    Offsets that are not as described (not starting at 0, decreasing, not ending at the totals,
    a maximum smaller than a sequence, block-table entries outside the cache) give wrong numbers
    for their own sequence (rows past a too-small maximum are left unwritten), never an access
    outside the tensors: the kernels clamp every offset they read to its tensor. Only types,
    dtypes, shapes and devices are validated (and that each maximum is between 1 and its
    total, or 0 for an empty total); ``with flashcore.checked():`` validates the contents too.

    Returns:
        ``out`` ``(total_q, H, Dv)`` in q's dtype (q's memory layout when q is dense), or
        ``(out, lse)`` with ``lse`` float32 ``(H, total_q)``. Rows that see no key (every row of a
        sequence with ``Sk_b = 0``) have ``out = 0`` and ``lse = -inf``.

    Autograd: differentiable in q, k and v (and through ``lse``), as :func:`attention`; a
    sequence with no query gets zero dk, dv. Inputs may have any strides (a last dim with a
    stride other than 1 is copied). Tensors on CUDA, or on the CPU with ``TRITON_INTERPRET=1``.
    The kernels run each sequence through masked pointer loads (never Hopper's tensor
    descriptors, which zero-fill only at the end of the packed tensor, not of a sequence).

    Raises:
        TypeError: a tensor argument is not a tensor or has the wrong dtype (q, k, v as in
            :func:`attention`; cu_seqlens must be int32), or an option or maximum has the wrong
            type.
        ValueError: wrong rank, mismatched shapes or devices, heads not divisible, non-finite
            scale, cu_seqlens not ``(B + 1,)`` alike, a maximum out of range.
        NotImplementedError: head_dim above 256; forward-mode AD (a jvp).
    """
    q, k, v = entry_inputs("flashcore.attention_varlen", q, k, v, sinks)
    if block_table is None:
        check_inputs(q, k, v, packed=True)
        keys, keys_name = k.shape[0], "total_k"
    else:
        keys = check_paged_varlen(q, k, v, block_table, _batch_of(cu_seqlens_q))
        keys_name = "max_blocks * block_size"
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, sinks)
        ):
            raise NotImplementedError(
                "attention_varlen with a block_table is forward-only: an input requires grad "
                "(detach it or call under torch.no_grad())"
            )
    check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k)
    max_seqlen_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0], "total_q")
    max_seqlen_k = check_max_seqlen(
        "max_seqlen_k", max_seqlen_k, keys, keys_name, packed=block_table is None
    )
    if _checked_mode(q):
        # flashcore.checked(): the offsets' contents too (one device sync).
        _offsets.check_cu_seqlens_values(
            "cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q", max_seqlen_q
        )
        lengths_k = _offsets.check_cu_seqlens_values(
            "cu_seqlens_k", cu_seqlens_k, None if block_table is not None else k.shape[0],
            "max_seqlen_k", max_seqlen_k,
        )  # fmt: skip
        if block_table is not None:
            _offsets.check_block_table_values(block_table, lengths_k, k.shape[2], k.shape[0])
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale = check_scale(scale, q.shape[-1])
    window_left, window_right = check_window(window)
    softcap = check_softcap(softcap)
    batch = cu_seqlens_q.shape[0] - 1
    alibi_slopes = check_alibi(alibi_slopes, batch, q.shape[1], q.device)
    sinks = _sinks_arg(check_sinks(sinks, q.shape[1], q.device))
    deterministic = check_flag("deterministic", deterministic)
    out, lse = _ops.attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
        window_left, window_right, softcap, alibi_slopes, sinks, block_table, deterministic,
    )  # fmt: skip
    return (out, lse) if return_lse else out


CHECKED_IN_CAPTURE = (
    "flashcore.checked() reads the offsets back to the host (a device sync), which a CUDA graph "
    "capture cannot contain: leave the checked() block before capturing (validate the offsets "
    "once in an eager call before the capture); the unchecked call is capturable"
)


def _checked_mode(q: torch.Tensor) -> bool:
    """Whether ``flashcore.checked()`` is on for this call. Raises ``RuntimeError`` when it is
    and the call is being captured into a CUDA graph: its read-back would otherwise fail inside
    CUDA with "operation not permitted when stream is capturing" and void the capture."""
    if not _offsets.active():
        return False
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(CHECKED_IN_CAPTURE)
    return True


def _batch_of(cu_seqlens_q: object) -> int:
    """The batch size cu_seqlens_q implies (its own checks come after the tensors')."""
    if isinstance(cu_seqlens_q, torch.Tensor) and cu_seqlens_q.dim() == 1:
        return cu_seqlens_q.shape[0] - 1
    return -1


# Fallback reasons already warned about; one warning per reason per process.
_sdpa_warned: set[str] = set()


def _sdpa_unsupported(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    enable_gqa: object,
) -> tuple[str, str] | None:
    """``(reason, detail)`` when FlashCore does not run this SDPA call itself, else None.

    The reason keys the once-per-reason warning; the detail says what about this call it was.
    Calls PyTorch rejects land here too, so that PyTorch raises its own error for them.
    """
    tensors = {"query": query, "key": key, "value": value}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            return "argument types", f"{name} is a {type(t).__name__}"
    if not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
        return "argument types", "is_causal or enable_gqa is not a bool"
    if attn_mask is not None:
        return "attn_mask", "an attn_mask was given (FlashCore's kernels take no mask)"
    if forward_ad_active(query, key, value):
        return "forward-mode AD", "forward-mode AD (FlashCore's kernels have no jvp)"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or dropout_p != 0:
        return "dropout_p", f"dropout_p = {dropout_p!r} (FlashCore has no dropout)"
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale)
    ):
        return "scale", f"scale = {scale!r} is not a finite real number"
    for name, t in tensors.items():
        if t.is_nested or t.layout != torch.strided:
            return "layout", f"{name} is nested or not strided ({t.layout})"
        if t.dtype not in SUPPORTED_DTYPES or t.dtype != query.dtype:
            return "dtype", f"{name}.dtype is {t.dtype} (query.dtype {query.dtype})"
        if t.device != query.device:
            return "device", f"{name} is on {t.device}, query on {query.device}"
    if not runnable_device(query.device):
        return "device", (
            f"the inputs are on {query.device} (CUDA, the CPU interpreter or meta only)"
        )
    if not query.dim() == key.dim() == value.dim() >= 2 or (enable_gqa and query.dim() < 3):
        dims = f"{query.dim()}, {key.dim()}, {value.dim()}"
        return "shape", f"query, key, value have {dims} dims"
    head_dim, head_dim_v = query.shape[-1], value.shape[-1]
    if not (
        key.shape[-1] == head_dim
        and 1 <= head_dim <= MAX_HEAD_DIM
        and 1 <= head_dim_v <= MAX_HEAD_DIM
    ):
        return "head dim", (
            f"head dims (query {head_dim}, key {key.shape[-1]}, value {head_dim_v}): query and "
            f"key must agree, each from 1 to {MAX_HEAD_DIM}"
        )
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-1] != value.shape[:-1]:
        return "shape", "batch dims differ (broadcast) or key and value shapes differ"
    if query.dim() > 2:
        heads, kv_heads = query.shape[-3], key.shape[-3]
        grouped = enable_gqa and kv_heads > 0 and heads % kv_heads == 0
        # kv_heads = 1 without enable_gqa broadcasts in PyTorch: the same numbers as MQA.
        if heads != kv_heads and kv_heads != 1 and not grouped:
            return "shape", f"query has {heads} heads, key/value {kv_heads}"
    return None


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """``(..., H, S, E)`` as ``(B, H, S, E)``: a view, unless > 4 dims that cannot be merged."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[None]
    return t.flatten(0, -4)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``, same semantics.

    Shapes as PyTorch's: query ``(..., H, L, E)``, key/value ``(..., Hkv, S, E)`` with the same
    leading dims (2-D ``(L, E)`` and 3-D ``(H, L, E)`` inputs too; more than 4 dims are flattened
    into one batch dim, a view for any tensor whose batch dims can be merged, else a copy).
    ``Hkv`` must equal ``H``, or be 1 (PyTorch broadcasts it), or divide ``H`` with
    ``enable_gqa=True``. Returns ``(..., H, L, E)`` in query's dtype.

    ``is_causal`` is PyTorch's TOP-LEFT aligned mask, query i sees key j iff ``j <= i``, unlike
    ``flashcore.attention(causal=True)``, which is bottom-right aligned. They agree when
    ``L == S``; otherwise (``x`` = sees)::

        L=2, S=4:  top-left         L=4, S=2:  top-left
              k0 k1 k2 k3                 k0 k1
          q0   x  .  .  .             q0   x  .
          q1   x  x  .  .             q1   x  x
                                      q2   x  x   <- rows past S see every key
                                      q3   x  x

    FlashCore runs it on its bottom-right kernel: for ``L < S`` on the first L keys (keys past L
    are hidden from every row), for ``L > S`` as a causal ``S x S`` block plus a non-causal block
    for the last ``L - S`` rows (two launches and a concatenation).

    Falls back to ``torch.nn.functional.scaled_dot_product_attention``, with a ``UserWarning``
    once per reason, for what FlashCore does not run: an ``attn_mask``, forward-mode AD (a jvp,
    which PyTorch's math backend has), ``dropout_p > 0`` (in this
    functional form dropout applies whatever the module's training mode), dtypes other than
    float16/bfloat16/float32, tensors not on CUDA (or on the CPU without ``TRITON_INTERPRET=1``),
    head dims outside 1..256 or a key head dim other than the query's, batch broadcasting, key
    and value with different head counts, a non-finite scale, nested tensors. Inputs PyTorch
    rejects (for example ``H != Hkv`` without ``enable_gqa``) raise PyTorch's own error.
    """
    if any_autocast():
        # As PyTorch's autocast casts SDPA's inputs (before the fallback's checks, so that
        # inputs of mixed dtypes that autocast makes alike are run here).
        query, key, value = autocast_inputs(query, key, value)
    unsupported = _sdpa_unsupported(
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )
    if unsupported is not None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
        # Only after PyTorch accepted the call: an error needs no extra warning.
        reason, detail = unsupported
        if reason not in _sdpa_warned:
            _sdpa_warned.add(reason)
            warnings.warn(
                f"flashcore.scaled_dot_product_attention ran PyTorch's SDPA instead: {detail}. "
                f"Shown once per reason ({reason}).",
                stacklevel=2,
            )
        return out

    q, k, v = _as_4d(query), _as_4d(key), _as_4d(value)
    seqlen_q, seqlen_k = q.shape[2], k.shape[2]
    if not is_causal or seqlen_q == seqlen_k:
        out = attention(q, k, v, causal=is_causal, scale=scale)
    elif seqlen_q < seqlen_k:
        k, v = k[:, :, :seqlen_q], v[:, :, :seqlen_q]
        out = attention(q, k, v, causal=True, scale=scale)
    else:
        square = attention(q[:, :, :seqlen_k], k, v, causal=True, scale=scale)
        rest = attention(q[:, :, seqlen_k:], k, v, causal=False, scale=scale)
        out = torch.cat((square, rest), dim=2)
    return out.reshape(*query.shape[:-1], value.shape[-1])


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new queries against a KV cache (decoding, chunked prefill), split-KV.
    Inference only.

    Args:
        q: ``(B, H, Sq, D)``: Sq = 1 for decoding, a few for speculative decoding, any number
            for a chunk of prefill (the last Sq positions of each sequence). Any strides.
        k_cache, v_cache: either contiguous ``(B, Hkv, S_max, D)`` and ``(B, Hkv, S_max, Dv)``
            (v_cache's head dim Dv may differ from D; sequence b's key j at
            ``[b, :, j]``), or paged ``(num_blocks, Hkv, block_size, D)`` with ``block_table``.
            ``H % Hkv == 0`` (GQA/MQA). Any strides.
        cache_seqlens: int32 ``(B,)``: sequence b has ``L_b`` valid keys, the first ``L_b`` of its
            cache; the queries are its LAST Sq positions (query i at ``pos_i = i + L_b - Sq``;
            the new tokens' keys must already be in the cache). Values must lie in
            ``[0, capacity]``; they are not checked (that would synchronise with the device), the
            kernel clamps them to that range so that it never reads outside the cache.
        block_table: int32 ``(B, max_blocks)``: key j of sequence b is row ``j % block_size`` of
            cache block ``block_table[b, j // block_size]``; block_size a multiple of 16.
            Entries past ``L_b`` are never read.
        causal: bottom-right causal: query i sees key j iff ``j <= pos_i``::

                L=5, Sq=2 (x = sees)       L=1, Sq=3
                    k0 k1 k2 k3 k4             k0
                q0   x  x  x  x  .         q0   .   <- sees no key: out 0, lse -inf
                q1   x  x  x  x  x         q1   .
                                           q2   x

            With ``causal=False`` every valid key ``j < L_b`` is seen.
        scale: multiplies ``q @ k^T``; defaults to ``1 / sqrt(D)``.
        window: ``(left, right)`` sliding window, -1 for an unbounded side: query i sees key j
            iff ``pos_i - left <= j <= pos_i + right`` (with causal, ``right`` is 0).
        softcap: ``c > 0``: scores become ``c * tanh(scores / c)`` after scaling.
        alibi_slopes: float32 ``(H,)`` or ``(B, H)``: adds ``-slope * |pos_i - j|`` to the scores
            (after the softcap).
        num_splits: how many parts each sequence's keys are split into (flash-decoding); None
            chooses from the SM count and the cache capacity. At most 64 (or one per key tile of
            the capacity) are used; any value gives the same result up to rounding. A chunk of
            512 or more fp16/bf16 queries on an H100/H200 (a paged cache, or a dense one whose
            capacity is a multiple of 128) runs as the packed batch :func:`attention_varlen`
            with ``block_table`` would (the Hopper forward, 1.5-2x faster there), where no
            split applies.
        return_lse: also return the logsumexp of each row.
        sinks: float32 ``(H,)``, one logit per query head, as in :func:`attention` (a row that
            sees no key gives out 0 and ``lse = sinks[h]``). No gradient here: sinks that
            require one raise ``ValueError`` while grad mode is on.

    Returns:
        ``out`` ``(B, H, Sq, Dv)`` in q's dtype (contiguous), or ``(out, lse)`` with ``lse``
        float32 ``(B, H, Sq)``, the natural-log logsumexp of the scaled, capped, biased, masked
        scores. Rows that see no key have ``out = 0`` and ``lse = -inf``.

    Forward only: there is no backward; differentiating through the result raises PyTorch's
    "no autograd formula" error at ``backward()`` (under ``torch.func.grad``, a
    NotImplementedError at the call).

    Raises:
        TypeError: a tensor argument is not a tensor or has the wrong dtype (q/k_cache/v_cache:
            float16, bfloat16 or float32, all alike; cache_seqlens/block_table: int32;
            alibi_slopes: float32), or an option has the wrong type.
        ValueError: wrong ranks or shapes, mismatched devices, heads not divisible, a block_size
            that is not a multiple of 16, bad window/softcap/scale/num_splits values.
        NotImplementedError: head_dim above 256; forward-mode AD (a jvp).
    """
    q, k_cache, v_cache = entry_inputs(
        "flashcore.attention_with_kvcache", q, k_cache, v_cache, sinks
    )
    key = None
    window_key = _express.window_key(window)
    if (
        window_key is not _express.NOT_KEYED
        and _scores_plain(softcap, alibi_slopes)
        and not _offsets.active()
    ):
        # A call of a signature checked and planned before (ops.express).
        key, result = _express.decode(
            q, k_cache, v_cache, cache_seqlens, block_table, causal, scale, num_splits,
            return_lse, window_key, sinks,
        )  # fmt: skip
        if result is not None:
            return result if return_lse else result[0]
    check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table)
    causal = check_flag("causal", causal)
    return_lse = check_flag("return_lse", return_lse)
    scale = check_scale(scale, q.shape[-1])
    window_left, window_right = check_window(window)
    softcap_value = check_softcap(softcap)
    slopes = check_alibi(alibi_slopes, q.shape[0], q.shape[1], q.device)
    splits = check_num_splits(num_splits)
    if _checked_mode(q):
        # flashcore.checked(): the lengths and block table entries too (one device sync).
        paged = block_table is not None
        capacity = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
        lengths = _offsets.check_cache_seqlens_values(cache_seqlens, capacity)
        if paged:
            _offsets.check_block_table_values(
                block_table, lengths, k_cache.shape[2], k_cache.shape[0]
            )
    sinks = _sinks_arg(check_sinks(sinks, q.shape[1], q.device, differentiable=False))
    args = (
        q, k_cache, v_cache, cache_seqlens, block_table, slopes, causal, scale, window_left,
        window_right, softcap_value, splits, sinks,
    )  # fmt: skip
    if key is not None:
        out, lse = _express.decode_first(key, *args)
    else:
        out, lse = _ops.attention_with_kvcache(*args)
    return (out, lse) if return_lse else out
