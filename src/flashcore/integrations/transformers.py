"""FlashCore as a Hugging Face transformers attention backend.

::

    from flashcore.integrations.transformers import register

    name = register()  # "fcore"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)
    model.set_attn_implementation(name)  # or switch a loaded model

``register`` adds two functions to transformers' registries: the attention function
(``AttentionInterface``), which every model class written against that interface calls with
``(module, q, k, v, attention_mask, **options)``, and the mask function
(``AttentionMaskInterface``), which the model calls once per forward pass (per mask kind: full,
sliding) to build what it then hands every layer as ``attention_mask``. FlashCore takes no mask, so
the mask function returns a small :class:`PaddingMask` describing the 2-D padding mask instead of
a dense 4-D one. transformers is imported here only, and only when this module is imported.

How each call maps onto FlashCore (q, k, v arrive as ``(B, H, Sq, D)`` and ``(B, Hkv, Sk, D)``,
GQA without ``repeat_kv``; the result is ``(B, Sq, H, D)`` and ``None`` for the weights):

- No padding, training or prefill: :func:`flashcore.attention`. Causal is ``module.is_causal``
  (or the ``is_causal`` option); FlashCore's causal is bottom-right aligned, which is what a query
  block at the end of a KV cache needs.
- No padding, a few new queries against a KV cache without autograd (``Sq < Sk``,
  ``Sq * H / Hkv <= 128``): :func:`flashcore.attention_with_kvcache` (split-KV decoding) with
  every row's ``cache_seqlens = Sk``. The same for a cache filled from its start whose unused
  slots follow the queries (a static cache of an unpadded batch, or a padding mask whose every
  row is valid from its first key to the queries: :class:`PaddingMask` ``prefix``), with
  ``cache_seqlens`` the valid length of each row.
- Left or right padding (or both), with or without a cache: :func:`flashcore.attention_varlen`
  on the padded tensors as they are, without gathering the valid tokens and without reading
  anything back to the host: each row is cut into five sequences (pad queries with no key, pad
  keys with no query, the valid queries against the valid keys, trailing pad queries, trailing
  pad keys), whose offsets are computed on the device from the first and last valid position of
  each row. Pad queries see no key and give 0 (as FlashAttention-2 in transformers does). When
  K and V are laid out ``(B, Sk, Hkv, D)`` (training, prefill without a cache) the rows are
  batch rows; when they are a cache laid out ``(B, Hkv, Sk, D)`` the rows are (batch, kv head)
  pairs with the ``H / Hkv`` query heads of each kv head as the sequence's heads, so the cache is
  read in place (only q, a few tokens, is copied); with sinks, which are per query head, the
  cache is copied to ``(B, Sk, Hkv, D)`` instead.
- Packed sequences with FlashAttention's ``cu_seq_lens_q/k`` and ``max_length_q/k`` options
  (``DataCollatorWithFlattening``): :func:`flashcore.attention_varlen` with those offsets.
- ``sliding_window=W``: transformers lets query i see key j iff ``i - W < j <= i`` (the current
  token counts in the W), which is FlashCore's ``window=(W - 1, 0)`` with ``causal=True``.
- ``softcap=c`` (Gemma 2): FlashCore's ``softcap=c``. ``scaling``: FlashCore's ``scale``.
- ``s_aux`` (gpt-oss's attention sinks, ``(H,)``): FlashCore's ``sinks=`` (as float32) where
  the installed FlashCore has it; NotImplementedError otherwise.

The mask function reads the padding mask back to the host once per forward pass (per mask kind),
not per layer: to send an unpadded batch to the dense kernels and to reject a padding mask with
holes (a zero between ones) rather than compute something else. Everything per layer stays on the
device.

What is refused with an error naming the option, never computed differently: ``dropout > 0`` (a
module in training mode with attention dropout), ``output_attentions``, a 4-D (or any tensor)
``attention_mask`` handed to the layers (custom masks), a padding mask with holes, packed
sequences given only through ``position_ids``, mask functions that add patterns
(``or_mask_function``/``and_mask_function``, block masks), chunked attention, a bidirectional
sliding window, ``position_bias``, and ``s_aux`` while FlashCore has no ``sinks``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch

import flashcore

__all__ = ["NAME", "PaddingMask", "attention_forward", "mask_forward", "register"]

NAME = "fcore"
"""The registered name. transformers special-cases names by their text: any name containing
``"flash"`` counts as FlashAttention (``is_flash_attention_requested``: the model loader then
imports the ``flash_attn`` package or a hub kernel for it, and generation and masking take
FlashAttention-only paths), so "flashcore" cannot be used; ``"sdpa"`` and ``"flex_attention"``
anywhere in the name run the SDPA and flex checks; a ``"paged|"`` prefix is stripped; ``org/repo``
(any ``/``) is fetched from the hub as a kernel; ``"eager"`` is the built-in. "fcore" is none of
these, so transformers dispatches it through the two registries only."""

# Largest ``Sq * H / Hkv`` flashcore.attention_with_kvcache takes (its docstring).
_DECODE_MAX_ROWS = 128
_PADDING_HOLES = "a padding mask with holes (a 0 between 1s in a row of attention_mask)"


@dataclasses.dataclass(frozen=True, eq=False)
class PaddingMask:
    """What the mask function gives every layer of one forward pass instead of a 4-D mask.

    Keys are positions ``0 .. kv_length - 1`` of the layer's K/V; query i sits at key position
    ``q_offset + i``. Row b's valid (non-padding) keys are ``bounds[0][b] <= j < bounds[1][b]``
    (int32 ``(B,)`` tensors on the device); ``bounds`` None means every key is valid and the
    queries are the last ones (``q_offset = kv_length - q_length``), so no varlen is needed.
    ``sliding_window`` is transformers' window of this mask kind (None for full attention).
    ``unsupported`` names what the mask asked for that FlashCore cannot honour; it is raised when
    a layer uses the mask, unless FlashAttention's packed options make the mask irrelevant.
    ``prefix``: every row's valid keys are ``0 .. bounds[1][b] - 1`` and the queries are the last
    ``q_length`` of them (a KV cache filled from its start, as a static cache decoding an
    unpadded batch is), which is exactly what :func:`flashcore.attention_with_kvcache` computes
    with ``cache_seqlens = bounds[1]``.
    """

    bounds: tuple[torch.Tensor, torch.Tensor] | None
    q_offset: int | torch.Tensor
    q_length: int
    kv_length: int
    sliding_window: int | None = None
    unsupported: str | None = None
    prefix: bool = False
    # Varlen offsets already built for this mask, shared by the layers of the forward pass.
    _segments: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict, repr=False
    )

    # transformers' mask preprocessing converts masks with ndim 2 and hands others to the mask
    # function as they are: generation with a static cache builds the mask before the forward
    # pass, which then calls the mask function again with it.
    ndim: ClassVar[int] = 4

    def contiguous(self) -> PaddingMask:
        """Itself (generation calls ``.contiguous()`` on whatever the mask function returned)."""
        return self


def register(name: str = NAME) -> str:
    """Register FlashCore with transformers; returns the name to pass as ``attn_implementation``.

    Registers :func:`attention_forward` with ``transformers.AttentionInterface`` and
    :func:`mask_forward` with ``transformers.AttentionMaskInterface`` under ``name`` (global
    registries: every model, present and future, sees them). Calling it again is harmless.

    Raises:
        ImportError: transformers is not installed (``pip install flashcore[transformers]``).
        ValueError: ``name`` is one that transformers special-cases (see :data:`NAME`).
    """
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            "flashcore.integrations.transformers needs transformers: "
            "pip install 'flashcore[transformers]'"
        ) from e
    lowered = name.lower() if isinstance(name, str) else ""
    if (
        not lowered
        or name == "eager"
        or "/" in name
        or lowered.startswith("paged|")
        or any(word in lowered for word in ("flash", "sdpa", "flex_attention"))
    ):
        raise ValueError(
            f"name must be a string transformers does not special-case (no 'flash', 'sdpa', "
            f"'flex_attention', '/', 'paged|' prefix, not 'eager'), got {name!r}"
        )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_forward)
    return name


def mask_forward(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    use_vmap: bool = False,
    config: Any = None,
    **kwargs: Any,
) -> PaddingMask:
    """transformers' mask function for FlashCore: a :class:`PaddingMask`, never a dense mask.

    ``attention_mask`` is the 2-D padding mask ``(B, past + Sq)``; the keys of this layer kind are
    its columns ``kv_offset .. kv_offset + kv_length - 1`` (columns past its end are padding, as
    in transformers' own masks, e.g. the unused slots of a static cache). ``mask_function``
    itself is not evaluated: the pattern is causal or bidirectional (from the module), with the
    sliding window of the config when ``local_size`` is that window. The other patterns
    transformers builds with these arguments are recorded in ``unsupported``.
    """
    if isinstance(attention_mask, PaddingMask):
        return attention_mask
    unsupported = None
    sliding_window = getattr(config, "sliding_window", None)
    if use_vmap:
        unsupported = "a custom mask pattern (or_mask_function / and_mask_function)"
    elif not allow_is_causal_skip and q_length > 1:
        # transformers turns the skip off for packed sequences (position_ids restarting within a
        # row), block masks (block_sequence_ids) and models that always materialise their mask;
        # a static cache turns it off for single-token decoding only.
        unsupported = (
            "packed sequences given through position_ids (pass FlashAttention's cu_seq_lens_q/k "
            "and max_length_q/k), block_sequence_ids, or a model that needs a materialised mask"
        )
    elif local_size is not None and local_size != sliding_window:
        unsupported = f"chunked attention (chunk size {local_size})"
    window = sliding_window if local_size is not None and unsupported is None else None
    offset = q_offset - kv_offset
    mask = PaddingMask(None, offset, q_length, kv_length, window, unsupported)
    at_end = isinstance(offset, int) and offset == kv_length - q_length
    if attention_mask is None:
        if at_end:
            return mask
        # Queries not at the end of the keys (a static cache): keys past the last query are
        # unused slots; causality hides them, and a bidirectional layer must not see them.
        device = kwargs.get("device")
        start = torch.zeros(batch_size, dtype=torch.int32, device=device)
        end = torch.clamp(torch.as_tensor(offset + q_length, device=device), max=kv_length)
        end = end.to(torch.int32).expand(batch_size).contiguous()
        # A full-attention layer's static cache holds every position, so the queries end where
        # the valid keys do (a tensor offset is transformers' cache_position, within the cache);
        # a sliding layer's cache may be a rolling window, left to varlen.
        prefix = window is None and (not isinstance(offset, int) or offset + q_length <= kv_length)
        return dataclasses.replace(mask, bounds=(start, end), prefix=prefix)
    valid = attention_mask[:, kv_offset : kv_offset + kv_length].to(torch.bool)
    if valid.shape[1] < kv_length:
        valid = torch.nn.functional.pad(valid, (0, kv_length - valid.shape[1]))
    count = valid.sum(1, dtype=torch.int32)
    start = valid.int().argmax(1).to(torch.int32)
    last = (kv_length - 1 - valid.flip(1).int().argmax(1)).to(torch.int32)
    holes = (count > 0) & (last + 1 - start != count)
    # Every row's valid keys from 0 on, ending where the queries do (a cache filled from its
    # start): the decoding kernels' case (PaddingMask.prefix).
    prefix = ((start == 0) & (count == offset + q_length)).all()
    # The one read-back per mask: holes (an error), a batch without padding (dense kernels) and
    # the prefix case.
    has_holes, full, prefix = torch.stack(
        (holes.any(), (count == kv_length).all(), prefix)
    ).tolist()
    if has_holes:
        return dataclasses.replace(mask, unsupported=unsupported or _PADDING_HOLES)
    if full and at_end:
        return mask
    return dataclasses.replace(mask, bounds=(start, start + count), prefix=bool(prefix))


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: PaddingMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function for FlashCore (the module docstring maps each case).

    Args:
        module: the attention module; its ``is_causal`` (default True) is the mask unless the
            ``is_causal`` option says otherwise.
        query: ``(B, H, Sq, D)``. key, value: ``(B, Hkv, Sk, D)``, ``H % Hkv == 0``.
        attention_mask: what :func:`mask_forward` built, or None (no padding, queries last).
        dropout: must be 0 (FlashCore has no dropout).
        scaling: the score scale; None is ``1 / sqrt(D)``.
        sliding_window: transformers' window W (query i sees keys ``i - W < j <= i``).
        softcap: Gemma 2's tanh cap; None or 0 is off.
        s_aux: attention sinks ``(H,)``, one extra logit per head in every row's softmax.
        is_causal: overrides ``module.is_causal``.
        kwargs: ``cu_seq_lens_q/k`` and ``max_length_q/k`` (packed sequences) are used;
            ``output_attentions`` and ``position_bias`` are refused; the rest is ignored.

    Returns:
        ``(out, None)`` with ``out`` ``(B, Sq, H, D)`` in q's dtype (pad queries give 0).

    Raises:
        NotImplementedError: an option FlashCore cannot honour (named in the message).
        ValueError: a mask that does not fit the keys.
    """
    if dropout:
        raise NotImplementedError(
            f"FlashCore has no attention dropout, got dropout={dropout} (the module is in training "
            "mode with attention_dropout > 0): set config.attention_dropout = 0 or use 'sdpa'"
        )
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "output_attentions: FlashCore never forms the attention weights; use 'eager'"
        )
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("position_bias: FlashCore takes no additive score bias")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    packed = kwargs.get("cu_seq_lens_q") is not None
    mask = attention_mask
    if mask is not None and not isinstance(mask, PaddingMask):
        raise NotImplementedError(
            f"attention_mask: FlashCore takes a 2-D padding mask only (turned into a PaddingMask "
            f"by its mask function), got a {type(mask).__name__}"
            + (f" of shape {tuple(mask.shape)}" if hasattr(mask, "shape") else "")
            + " (a custom 4-D mask, or a model that builds its mask without the "
            "AttentionMaskInterface)"
        )
    if mask is not None and mask.sliding_window is not None:
        if sliding_window is not None and sliding_window != mask.sliding_window:
            raise ValueError(
                f"sliding_window={sliding_window} differs from the mask's {mask.sliding_window}"
            )
        sliding_window = mask.sliding_window
    window = None
    if sliding_window is not None:
        if not causal:
            raise NotImplementedError(
                "sliding_window with a bidirectional module (is_causal=False): transformers' "
                "bidirectional window is not FlashCore's"
            )
        window = (int(sliding_window) - 1, 0)
    options: dict[str, Any] = {"scale": scaling, "window": window, "softcap": softcap or None}
    if s_aux is not None:
        options["sinks"] = s_aux.float()

    batch, seqlen_q, seqlen_k = query.shape[0], query.shape[2], key.shape[2]
    if packed:
        out = _packed(query, key, value, kwargs, causal, options)
    elif mask is not None and mask.unsupported is not None:
        raise NotImplementedError(f"FlashCore cannot honour {mask.unsupported}")
    elif mask is not None and (mask.q_length, mask.kv_length) != (seqlen_q, seqlen_k):
        raise ValueError(
            f"attention_mask was built for {mask.q_length} queries and {mask.kv_length} keys, "
            f"the layer has {seqlen_q} and {seqlen_k}"
        )
    elif mask is None or mask.bounds is None:
        if _decoding(query, key, value):
            lens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=query.device)
            out = _call(
                flashcore.attention_with_kvcache, query, key, value, cache_seqlens=lens,
                causal=causal, **options,
            )  # fmt: skip
        else:
            out = _call(flashcore.attention, query, key, value, causal=causal, **options)
        out = out.transpose(1, 2)
    elif mask.prefix and _decoding(query, key, value):
        # A cache filled from its start (a static cache, unpadded): split-KV decoding over each
        # row's valid keys instead of varlen's one program per (row, kv head).
        out = _call(
            flashcore.attention_with_kvcache, query, key, value, cache_seqlens=mask.bounds[1],
            causal=causal, **options,
        ).transpose(1, 2)  # fmt: skip
    else:
        out = _padded(query, key, value, mask, causal, options)
    return out, None


def _decoding(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the call is a few new queries against a cache without autograd: what
    :func:`flashcore.attention_with_kvcache` takes (``Sq < Sk``, ``Sq * H / Hkv <= 128``)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return False
    seqlen_q, heads, kv_heads = query.shape[2], query.shape[1], key.shape[1]
    return seqlen_q < key.shape[2] and seqlen_q * heads // max(kv_heads, 1) <= _DECODE_MAX_ROWS


@functools.cache
def _takes_sinks(fn: Callable) -> bool:
    """Whether this FlashCore's ``fn`` takes ``sinks=`` (being added; read once per function)."""
    return "sinks" in inspect.signature(fn).parameters


def _call(fn: Callable, *args: Any, **options: Any) -> torch.Tensor:
    """``fn(*args, **options)``, refusing ``s_aux`` where ``fn`` has no ``sinks=`` yet."""
    if "sinks" in options and not _takes_sinks(fn):
        raise NotImplementedError(
            f"s_aux (attention sinks, gpt-oss): this FlashCore's {fn.__name__} has no sinks= "
            "argument yet"
        )
    return fn(*args, **options)


def _packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kwargs: dict[str, Any],
    causal: bool,
    options: dict[str, Any],
) -> torch.Tensor:
    """FlashAttention's packed options (B = 1, sequences back to back) through varlen."""
    batch, heads, seqlen_q, head_dim = query.shape
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(-1, heads, head_dim)
    k = key.transpose(1, 2).reshape(-1, kv_heads, head_dim)
    v = value.transpose(1, 2).reshape(-1, kv_heads, head_dim)
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs.get("cu_seq_lens_k", kwargs["cu_seq_lens_q"]).to(torch.int32)
    max_q = kwargs.get("max_length_q")
    max_k = kwargs.get("max_length_k", max_q)
    if max_q is None or max_k is None:
        raise ValueError("cu_seq_lens_q needs max_length_q (and max_length_k), Python ints")
    out = _call(
        flashcore.attention_varlen, q, k, v, cu_q, cu_k, int(max_q), int(max_k), causal=causal,
        **options,
    )  # fmt: skip
    return out.view(batch, seqlen_q, heads, head_dim)


def _padded(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: PaddingMask,
    causal: bool,
    options: dict[str, Any],
) -> torch.Tensor:
    """A padded batch through varlen, in place (see the module docstring)."""
    batch, heads, seqlen_q, head_dim = query.shape
    kv_heads, seqlen_k = key.shape[1], key.shape[2]
    group = heads // kv_heads
    k = _view(key.transpose(1, 2), batch * seqlen_k, kv_heads, head_dim)
    v = _view(value.transpose(1, 2), batch * seqlen_k, kv_heads, head_dim)
    if (k is None or v is None) and "sinks" in options:
        # Sinks are per query head, (H,), and a (batch, kv head) row has only its group's heads:
        # copy the cache to (B, S, Hkv, D) (gpt-oss decoding a padded batch).
        k = key.transpose(1, 2).reshape(batch * seqlen_k, kv_heads, head_dim)
        v = value.transpose(1, 2).reshape(batch * seqlen_k, kv_heads, head_dim)
    token_rows = k is not None and v is not None
    if token_rows:
        # (B, S, H, D) in memory: every row of the batch is one run of tokens.
        q = query.transpose(1, 2).reshape(batch * seqlen_q, heads, head_dim)
        rows, q_heads = batch, heads
    else:
        # A cache, (B, Hkv, S, D) in memory: every (batch, kv head) is one run of tokens with one
        # kv head and its `group` query heads.
        q = query.unflatten(1, (kv_heads, group)).transpose(2, 3)
        q = q.reshape(batch * kv_heads * seqlen_q, group, head_dim)
        k = key.reshape(batch * kv_heads * seqlen_k, 1, head_dim)
        v = value.reshape(batch * kv_heads * seqlen_k, 1, head_dim)
        rows, q_heads = batch * kv_heads, group
    cu_q, cu_k = _segments(mask, causal, rows // batch)
    out = _call(
        flashcore.attention_varlen, q, k, v, cu_q, cu_k, seqlen_q, seqlen_k, causal=causal,
        **options,
    )  # fmt: skip
    if token_rows:
        return out.view(batch, seqlen_q, heads, head_dim)
    out = out.view(batch, kv_heads, seqlen_q, q_heads, head_dim).transpose(1, 2)
    return out.reshape(batch, seqlen_q, heads, head_dim)


def _segments(mask: PaddingMask, causal: bool, repeat: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens_q/k`` cutting each row of the padded batch into five sequences.

    Row r holds queries at key positions ``o .. o + Sq - 1`` (``o = q_offset``) and keys
    ``0 .. Sk - 1``, of which ``[s, e)`` are valid. The valid queries are ``[qs, qe)`` (those
    whose own position is valid); with causal, the keys they can see end at ``ke = o + qe`` (so
    the last valid query and its key sit at the bottom-right corner, which is where FlashCore's
    causal and window align), else at ``e``. The sequences, as (queries, keys)::

        ([0, qs), [0, 0))   leading pad queries: no key, out 0
        ([qs, qs), [0, s))  leading pad keys: no query
        ([qs, qe), [s, ke)) the valid tokens
        ([qe, Sq), [ke, ke)) trailing pad queries: no key, out 0
        ([Sq, Sq), [ke, Sk)) trailing keys: no query

    Built on the device from ``mask.bounds`` (no read-back) and kept on the mask for the next
    layers. ``repeat``: rows per batch row (the kv heads of a ``(B, Hkv, S, D)`` cache).
    """
    cache_key = (causal, repeat)
    if cache_key in mask._segments:
        return mask._segments[cache_key]
    start, end = mask.bounds
    sq, sk, offset = mask.q_length, mask.kv_length, mask.q_offset
    qs = (start - offset).clamp(0, sq).to(torch.int32)
    qe = torch.maximum((end - offset).clamp(0, sq).to(torch.int32), qs)
    ke = torch.minimum(torch.maximum(offset + qe, start), end).to(torch.int32) if causal else end
    zero, full = torch.zeros_like(qs), torch.full_like(qs, sq)
    q_cuts = torch.stack((zero, qs, qs, qe, full), 1)
    k_cuts = torch.stack((zero, zero, start, ke, ke), 1)
    if repeat > 1:
        q_cuts, k_cuts = q_cuts.repeat_interleave(repeat, 0), k_cuts.repeat_interleave(repeat, 0)
    rows = q_cuts.shape[0]
    base = torch.arange(rows + 1, device=qs.device, dtype=torch.int32)
    cu_q = torch.cat(((q_cuts + base[:-1, None] * sq).flatten(), base[-1:] * sq))
    cu_k = torch.cat(((k_cuts + base[:-1, None] * sk).flatten(), base[-1:] * sk))
    mask._segments[cache_key] = cu_q.to(torch.int32), cu_k.to(torch.int32)
    return mask._segments[cache_key]


def _view(t: torch.Tensor, *shape: int) -> torch.Tensor | None:
    """``t`` ``(B, S, ...)`` as ``(B * S, ...)`` without a copy, or None where that would need one.

    Decided from the strides, not by trying ``view``: under torch.compile a failed view is a
    tracing error (fake tensors raise ValueError inside dynamo), not an exception to catch.
    """
    if not (t.shape[0] <= 1 or t.shape[1] <= 1 or t.stride(0) == t.stride(1) * t.shape[1]):
        return None
    return t.view(shape)
