"""Attention implementations the benchmark compares, under one calling convention.

A provider prepares, per case, a function ``fn(q, k, v) -> out`` with flashcore's semantics
(q ``(B, H, Sq, D)``, k ``(B, Hkv, Sk, D)``, v ``(B, Hkv, Sk, Dv)``, scale ``1/sqrt(D)``,
bottom-right causal), and a context to run it in (the SDPA backend selection). Anything a provider
raises while preparing, running or differentiating is reported as "refused" with the reason; it
never stops the run.

A provider may be a variant of another (``Provider.base``: the same work plus one feature, as
sinks or a paged cache); the report then gives its time over its base's, case by case.

Mapping to PyTorch:
- ``sdpa``: ``F.scaled_dot_product_attention`` with PyTorch's default backend choice; ``sdpa-*``
  force one backend with ``torch.nn.attention.sdpa_kernel``.
- GQA (Hkv < H) passes ``enable_gqa=True``; a backend without GQA refuses.
- Causal: SDPA's ``is_causal`` is top-left aligned, flashcore's bottom-right; they agree only when
  Sq == Sk. For causal Sq != Sk SDPA gets an explicit bottom-right boolean ``attn_mask``
  (``flashcore.reference.causal_mask``); backends that take no mask (flash) refuse.
- A local window (``Case.window``, ``--window``): flashcore's providers pass it as ``window=``,
  ``fa4`` as ``window_size`` (-1 as None), ``flex`` as a mask function with its block mask, SDPA
  as a boolean ``attn_mask`` (``flashcore.reference.visible_mask``, built outside the timed call;
  backends that take no mask refuse); ``sdpa-padded``, which takes no mask, refuses it.
- ``flashcore-kvcache``: ``flashcore.attention_with_kvcache`` reading k/v as a dense cache
  ``(B, Hkv, S_max, D)`` with every ``cache_seqlens`` equal to Sk (the queries are the last Sq
  positions: the same bottom-right semantics as ``flashcore.attention``). ``flashcore-paged16`` /
  ``-paged256`` read a paged copy (blocks of 16 / 256 keys, in shuffled order), built at the first
  call, which is the untimed correctness check, and reused by the timed calls.
- ``flashcore-portable`` / ``flashcore-sm90``: ``flashcore.attention`` under
  ``flashcore.use_tier("portable")`` / ``("sm90")``, forward and backward (the backward runs on
  the tier of its forward), to compare the kernel tiers on one GPU; off Hopper ``sm90`` falls
  back to the portable kernels.
- ``fa4``: FlashAttention-4's ``flash_attn.cute.flash_attn_func`` (pip ``flash-attn-4``) on
  ``(B, S, H, D)`` views of the same tensors, its own bottom-right causal mask; refused where it
  does not import, off CUDA, and on varlen cases that would need a padding mask.
- ``flex``: FlexAttention compiled with ``torch.compile`` (one compiled function; a block mask per
  causal case, built outside the timed region), ``enable_gqa`` for GQA.
- Dv != D: flashcore's providers, ``sdpa-math`` and (as PyTorch decides) ``sdpa``,
  ``sdpa-efficient``, ``sdpa-cudnn`` and ``flex`` take it; ``sdpa-flash`` refuses it before
  running (PyTorch's flash backend needs one head dim for q, k and v); a backend that PyTorch
  finds unable raises, and the row is "refused" with PyTorch's reason.
- ``flashcore-sinks``: ``flashcore.attention`` with attention sinks, the variant of ``flashcore``:
  ``fn(q, k, v, sinks)`` takes a fourth argument, float32 ``(H,)`` (``Provider.sinks``), the same
  for the reference; it requires grad in the backward modes, whose check includes ``dsinks``.
  Dense cases only.

Varlen cases (``Case.seqlens``): a ``packed`` provider gets q ``(total, H, D)``, k/v
``(total, Hkv, D)`` (the real tokens of each sequence back to back) and returns out in that layout;
every other provider gets the zero-padded ``(B, H, S_max, D)`` batch.
- ``flashcore-varlen``: ``flashcore.attention_varlen`` on the packed batch (dense cases refused).
- ``sdpa-padded``: ``sdpa`` on the padded batch with no mask, the most favourable case for SDPA: no
  mask work, only extra work on padding. Causal, with the padding at the end of each sequence and
  Sq = Sk, top-left equals bottom-right on the real rows, which are exact. Non-causal, the real
  queries also attend to the zero padding keys, so the result is wrong by construction (checked and
  marked so) and its time is a lower bound for SDPA on the padded batch.
- ``sdpa-padded-mask``: SDPA on the padded batch with a boolean key-padding mask (and the causal
  mask when causal): the correct padded computation, causal or not.
- ``flashcore-padded``: ``flashcore.attention`` on the padded batch (the ``flashcore`` provider
  under its varlen name). flashcore takes no mask, so the non-causal varlen cases are refused.
- ``flashcore-varlen-paged16`` / ``-paged256``: ``flashcore.attention_varlen`` with a
  ``block_table``, the variants of ``flashcore-varlen``: the same packed queries against a paged
  copy of the packed keys and values (``(num_blocks, Hkv, block_size, D)``, blocks of 16 / 256
  keys, sequence b holding ``ceil(S_b / block_size)`` of them, in shuffled order), built at the
  first call (the untimed check) like the decode providers'. Forward only: with inputs that
  require grad, ``attention_varlen`` raises and the row is refused.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashcore import reference
from flashcore.bench.cases import Case

AttnFn = Callable[..., torch.Tensor]
"""``fn(q, k, v) -> out``, or ``fn(q, k, v, sinks) -> out`` for a provider with sinks."""


class Refused(Exception):
    """A provider cannot run a case (unavailable, unsupported shape); the message says why."""


@dataclass(frozen=True)
class Provider:
    name: str
    doc: str
    prepare: Callable[[Case, torch.device], AttnFn]
    backend: str | None = None
    """SDPBackend member to force, or None."""
    packed: bool = False
    """Takes a varlen case's packed tokens ``(total, H, D)`` instead of the padded batch."""
    sinks: bool = False
    """Takes float32 ``(H,)`` attention sinks as a fourth argument (checked against a reference
    with the same sinks)."""
    base: str | None = None
    """The provider this one is a variant of (the same work plus one feature), or None."""

    def context(self) -> contextlib.AbstractContextManager:
        if self.backend is None:
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, self.backend))


def _refuse_unmasked_padding(case: Case, what: str) -> None:
    if case.seqlens is not None and not case.causal:
        raise Refused(
            f"{what} takes no key-padding mask: on the padded batch without one, non-causal, the "
            "real queries would also attend to the padding keys"
        )


def _flashcore(case: Case, device: torch.device) -> AttnFn:
    import flashcore

    _refuse_unmasked_padding(case, "flashcore.attention")
    causal, window = case.causal, case.window
    return lambda q, k, v: flashcore.attention(q, k, v, causal=causal, window=window)


def _flashcore_tier(case: Case, device: torch.device, *, tier: str) -> AttnFn:
    import flashcore

    _refuse_unmasked_padding(case, "flashcore.attention")
    causal, window = case.causal, case.window

    def fn(q, k, v):
        # The backward runs on the tier that was in effect at the forward.
        with flashcore.use_tier(tier):
            return flashcore.attention(q, k, v, causal=causal, window=window)

    return fn


def _fa4(case: Case, device: torch.device) -> AttnFn:
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError as e:
        raise Refused(
            f"FlashAttention-4 (pip flash-attn-4, module flash_attn.cute) does not import: {e}"
        ) from None
    if device.type != "cuda":
        raise Refused("FlashAttention-4 runs on CUDA GPUs only")
    _refuse_unmasked_padding(case, "FlashAttention-4's flash_attn_func")
    causal = case.causal
    scale = 1.0 / case.shape.head_dim**0.5
    # FA4 takes None for a side without a bound (and, like flashcore, right 0 when causal).
    window = tuple(None if w < 0 else w for w in case.window or (-1, -1))

    def fn(q, k, v):
        # (B, S, H, D) views of the (B, H, S, D) tensors; FA4's causal mask is bottom-right
        # aligned like flashcore's. It returns (out, lse).
        out = flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
            causal=causal, window_size=window,
        )  # fmt: skip
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return fn


def _flashcore_sinks(case: Case, device: torch.device) -> AttnFn:
    import flashcore

    if case.seqlens is not None:
        raise Refused("flashcore-sinks runs dense cases only (flashcore.attention with sinks)")
    causal, window = case.causal, case.window
    return lambda q, k, v, sinks: flashcore.attention(
        q, k, v, causal=causal, sinks=sinks, window=window
    )


def _flashcore_varlen(case: Case, device: torch.device, *, block_size: int = 0) -> AttnFn:
    import flashcore

    if case.seqlens is None:
        raise Refused(
            "flashcore-varlen* runs varlen cases only (--preset varlen, paged-prefill and their "
            "-smoke versions)"
        )
    seqlens = case.seqlens
    cu = cu_seqlens(seqlens, device)
    longest = max(seqlens)
    causal, window = case.causal, case.window
    paged: dict = {}

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        table = None
        if block_size:
            key = (k.data_ptr(), v.data_ptr())
            if key not in paged:
                paged.clear()
                padded = (unpack(t, seqlens, longest) for t in (k, v))
                paged[key] = to_paged(*padded, block_size, seqlens=seqlens)
            k, v, table = paged[key]
        return flashcore.attention_varlen(
            q, k, v, cu, cu, longest, longest, causal=causal, block_table=table, window=window
        )

    return fn


def _flashcore_kvcache(case: Case, device: torch.device, *, block_size: int = 0) -> AttnFn:
    import flashcore

    _refuse_unmasked_padding(case, "flashcore.attention_with_kvcache")
    s = case.shape
    causal, window = case.causal, case.window
    lens = torch.full((s.batch,), s.seqlen_k, dtype=torch.int32, device=device)
    paged: dict = {}

    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        table = None
        if block_size:
            key = (k.data_ptr(), v.data_ptr())
            if key not in paged:
                paged.clear()
                paged[key] = to_paged(k, v, block_size)
            k, v, table = paged[key]
        return flashcore.attention_with_kvcache(
            q, k, v, cache_seqlens=lens, block_table=table, causal=causal, window=window
        )

    return fn


def to_paged(
    k: torch.Tensor,
    v: torch.Tensor,
    block_size: int,
    *,
    seqlens: tuple[int, ...] | None = None,
):
    """A paged copy of dense k ``(B, Hkv, S, D)``, v ``(B, Hkv, S, Dv)``:
    ``(k_blocks, v_blocks, block_table)``, blocks ``(num_blocks, Hkv, block_size, D or Dv)``.

    Sequence b holds ``ceil(S / block_size)`` blocks, or ``ceil(seqlens[b] / block_size)`` with
    ``seqlens`` (its keys past ``seqlens[b]`` are dropped; its unused table entries are 0). Blocks
    are laid out in a fixed shuffled order, as a cache allocator hands them out over time.
    """
    batch, kv_heads, seqlen, _ = k.shape
    per_seq = -(-seqlen // block_size)
    lens = seqlens if seqlens is not None else (seqlen,) * batch
    used = torch.tensor([-(-n // block_size) for n in lens])
    # (B, per_seq): True where sequence b uses its j-th block.
    in_use = torch.arange(per_seq)[None] < used[:, None]
    gen = torch.Generator(device="cpu").manual_seed(0)
    order = torch.randperm(int(used.sum()), generator=gen)
    table = torch.zeros((batch, per_seq), dtype=torch.int32)
    table[in_use] = order.to(torch.int32)
    order = order.to(k.device)
    in_use = in_use.to(k.device)

    def page(t: torch.Tensor) -> torch.Tensor:
        dim = t.shape[-1]
        t = torch.nn.functional.pad(t, (0, 0, 0, per_seq * block_size - seqlen))
        blocks = t.view(batch, kv_heads, per_seq, block_size, dim).transpose(1, 2)
        out = torch.empty((len(order), kv_heads, block_size, dim), dtype=t.dtype, device=t.device)
        out[order] = blocks[in_use]
        return out

    return page(k), page(v), table.to(k.device)


def cu_seqlens(seqlens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 ``[0, s_0, s_0 + s_1, ...]``, as ``attention_varlen`` takes it."""
    return torch.tensor((0, *seqlens), device=device).cumsum(0).to(torch.int32)


def real_tokens(seqlens: tuple[int, ...], padded_len: int, device: torch.device) -> torch.Tensor:
    """Boolean ``(B, S_max)``: True at the real tokens of the padded batch (padding at the end)."""
    lens = torch.tensor(seqlens, device=device)
    return torch.arange(padded_len, device=device)[None] < lens[:, None]


def pack(x: torch.Tensor, seqlens: tuple[int, ...]) -> torch.Tensor:
    """The real tokens of a padded ``(B, H, S_max, D)`` batch as ``(total, H, D)``."""
    return x.transpose(1, 2)[real_tokens(seqlens, x.shape[2], x.device)]


def unpack(x: torch.Tensor, seqlens: tuple[int, ...], padded_len: int) -> torch.Tensor:
    """Packed ``(total, H, D)`` as the zero-padded batch ``(B, H, S_max, D)`` (contiguous)."""
    out = x.new_zeros((len(seqlens), padded_len, *x.shape[1:]))
    out[real_tokens(seqlens, padded_len, x.device)] = x
    return out.transpose(1, 2).contiguous()


def _sdpa_padded_mask(case: Case, device: torch.device) -> AttnFn:
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    s = case.shape
    if case.seqlens is None:
        return _sdpa(case, device)
    # (B, 1, 1 or S, S): real keys only; causal as well (Sq = Sk, so top-left is bottom-right).
    mask = real_tokens(case.seqlens, s.seqlen_k, device)[:, None, None, :]
    if case.causal or case.window is not None:
        mask = mask & reference.visible_mask(
            s.seqlen_q, s.seqlen_k, device, causal=case.causal, window=case.window
        )
    kwargs = {"enable_gqa": True} if s.kv_heads != s.heads else {}
    return lambda q, k, v: sdpa(q, k, v, attn_mask=mask, **kwargs)


def _sdpa_flash(case: Case, device: torch.device) -> AttnFn:
    s = case.shape
    if s.value_dim != s.head_dim:
        # PyTorch's check_head_dim_size_flash, said up front: its own refusal leads with "No
        # available kernel" and keeps the reason among its warnings.
        raise Refused(
            f"SDPA's FLASH_ATTENTION backend needs one head dim for q, k and v "
            f"(got D={s.head_dim}, Dv={s.value_dim})"
        )
    return _sdpa(case, device)


def _sdpa(case: Case, device: torch.device) -> AttnFn:
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    s = case.shape
    kwargs = {"enable_gqa": True} if s.kv_heads != s.heads else {}
    if case.window is not None:
        if case.seqlens is not None:
            raise Refused("SDPA on the padded batch without a mask cannot take a window")
        mask = reference.visible_mask(
            s.seqlen_q, s.seqlen_k, device, causal=case.causal, window=case.window
        )
        return lambda q, k, v: sdpa(q, k, v, attn_mask=mask, **kwargs)
    if case.causal and s.seqlen_q != s.seqlen_k:
        mask = reference.causal_mask(s.seqlen_q, s.seqlen_k, device=device)
        return lambda q, k, v: sdpa(q, k, v, attn_mask=mask, **kwargs)
    causal = case.causal
    return lambda q, k, v: sdpa(q, k, v, is_causal=causal, **kwargs)


@functools.cache
def _compiled_flex() -> Callable:
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError as e:
        raise Refused(f"FlexAttention is unavailable in torch {torch.__version__}: {e}") from None
    # One compiled function serves every shape (dynamic=False: a graph per shape, as FlexAttention
    # is meant to be used); a sweep needs more recompiles than dynamo's default limit of 8.
    from torch._dynamo import config

    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), 256))
    return torch.compile(flex_attention, dynamic=False)


def _flex(case: Case, device: torch.device) -> AttnFn:
    flex = _compiled_flex()
    from torch.nn.attention.flex_attention import create_block_mask

    s = case.shape
    block_mask = None
    diag = s.seqlen_k - s.seqlen_q
    if case.window is not None:
        left, right = case.window
        right = 0 if case.causal else right

        def local(b, h, q_idx, kv_idx):
            seen = kv_idx >= 0
            if left >= 0:
                seen = seen & (kv_idx >= q_idx + diag - left)
            if right >= 0:
                seen = seen & (kv_idx <= q_idx + diag + right)
            return seen

        block_mask = create_block_mask(local, None, None, s.seqlen_q, s.seqlen_k, device=device)
    elif case.causal:

        def bottom_right(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + diag

        block_mask = create_block_mask(
            bottom_right, None, None, s.seqlen_q, s.seqlen_k, device=device
        )
    gqa = s.kv_heads != s.heads
    return lambda q, k, v: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in [
        Provider("flashcore", "flashcore.attention (Triton)", _flashcore),
        Provider(
            "flashcore-portable",
            "flashcore.attention under use_tier('portable') (the Triton tl kernels only)",
            functools.partial(_flashcore_tier, tier="portable"),
        ),
        Provider(
            "flashcore-sm90",
            "flashcore.attention under use_tier('sm90') (the Gluon kernels on an H100/H200)",
            functools.partial(_flashcore_tier, tier="sm90"),
        ),
        Provider("fa4", "FlashAttention-4's flash_attn_func, where flash_attn.cute imports", _fa4),
        Provider(
            "flashcore-sinks",
            "flashcore.attention with learnable sinks, float32 (H,) (dense cases)",
            _flashcore_sinks,
            sinks=True,
            base="flashcore",
        ),
        Provider(
            "flashcore-varlen",
            "flashcore.attention_varlen on the packed tokens (varlen cases)",
            _flashcore_varlen,
            packed=True,
        ),
        Provider(
            "flashcore-varlen-paged16",
            "flashcore.attention_varlen on a paged K/V copy, 16-key blocks (varlen cases; fwd)",
            functools.partial(_flashcore_varlen, block_size=16),
            packed=True,
            base="flashcore-varlen",
        ),
        Provider(
            "flashcore-varlen-paged256",
            "flashcore.attention_varlen on a paged K/V copy, 256-key blocks (varlen cases; fwd)",
            functools.partial(_flashcore_varlen, block_size=256),
            packed=True,
            base="flashcore-varlen",
        ),
        Provider(
            "flashcore-padded",
            "flashcore.attention on the zero-padded batch (varlen cases; causal only)",
            _flashcore,
        ),
        Provider(
            "flashcore-kvcache",
            "flashcore.attention_with_kvcache, dense cache (split-KV decoding)",
            _flashcore_kvcache,
        ),
        Provider(
            "flashcore-paged16",
            "flashcore.attention_with_kvcache, paged cache of 16-key blocks",
            functools.partial(_flashcore_kvcache, block_size=16),
            base="flashcore-kvcache",
        ),
        Provider(
            "flashcore-paged256",
            "flashcore.attention_with_kvcache, paged cache of 256-key blocks",
            functools.partial(_flashcore_kvcache, block_size=256),
            base="flashcore-kvcache",
        ),
        Provider("sdpa", "F.scaled_dot_product_attention, PyTorch's backend choice", _sdpa),
        Provider("sdpa-flash", "SDPA forced to FLASH_ATTENTION", _sdpa_flash, "FLASH_ATTENTION"),
        Provider("sdpa-cudnn", "SDPA forced to CUDNN_ATTENTION", _sdpa, "CUDNN_ATTENTION"),
        Provider(
            "sdpa-efficient", "SDPA forced to EFFICIENT_ATTENTION", _sdpa, "EFFICIENT_ATTENTION"
        ),
        Provider("sdpa-math", "SDPA forced to MATH (materialises Sq x Sk)", _sdpa, "MATH"),
        Provider(
            "sdpa-padded",
            "SDPA on the zero-padded batch, no mask (varlen cases; wrong when non-causal)",
            _sdpa,
        ),
        Provider(
            "sdpa-padded-mask",
            "SDPA on the zero-padded batch with a key-padding mask (varlen cases)",
            _sdpa_padded_mask,
        ),
        Provider("flex", "FlexAttention under torch.compile", _flex),
    ]
}

DEFAULT_GPU = ["flashcore", "sdpa", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"]
DEFAULT_CPU = ["flashcore", "sdpa", "sdpa-math"]
DECODE_GPU = ["flashcore-kvcache", "flashcore-paged16", "flashcore-paged256", "sdpa", "flex"]
DECODE_CPU = ["flashcore-kvcache", "flashcore-paged16", "sdpa"]
VARLEN_GPU = ["flashcore-varlen", "flashcore-padded", "sdpa-padded", "sdpa-padded-mask"]
VARLEN_CPU = VARLEN_GPU
PAGED_PREFILL_GPU = [
    "flashcore-varlen",
    "flashcore-varlen-paged16",
    "flashcore-varlen-paged256",
    "sdpa-padded",
]
PAGED_PREFILL_CPU = PAGED_PREFILL_GPU
BASELINE = "sdpa"
VARLEN_BASELINE = "sdpa-padded"


def baseline(case: Case) -> str:
    """The provider whose time the ``vs sdpa`` column divides by."""
    return BASELINE if case.seqlens is None else VARLEN_BASELINE
