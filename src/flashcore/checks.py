"""Input validation for the public functions: one check per argument kind, each raising with the
argument's name, what was expected and what was got. Runs before anything is launched."""

from __future__ import annotations

import math
import numbers

import torch
from torch.autograd import forward_ad as _forward_ad

from flashcore.ops.runtime import is_interpreted, transform_active

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def interpreted() -> bool:
    """Whether the kernels run through Triton's interpreter (fixed once they are defined)."""
    # Fixed for the life of the process once the kernels are defined. Under torch.compile the
    # answer is taken once at trace time and baked in, instead of tracing the import and the
    # functools.cache inside (which dynamo only traces through with a warning).
    return is_interpreted()


# What ``torch.compiler.assume_constant_result`` does (torch 2.6 to 2.13: it sets this attribute),
# without its ``import torch._dynamo``: that imports triton, and triton's own jit helpers are then
# compiled-mode objects even if TRITON_INTERPRET=1 is set later, so ``import flashcore`` before
# setting the flag broke every interpreted call ("Cannot call @triton.jit'd outside of the scope
# of a kernel"). tests/test_compile.py checks that dynamo still traces this without a break.
interpreted._dynamo_marked_constant = True  # type: ignore[attr-defined]


# Whether autocast is on for any device: one C call (~0.2 us on the 2-core CPU machine, against
# ~1 us for the per-device test with q's device looked up), all that a call pays with autocast
# off. torch._C's; the public per-device test where a build lacks it.
any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)
# Devices with an autocast state that the kernels run on.
_AUTOCAST_DEVICES = ("cuda", "cpu")


def autocast_inputs(*tensors: object) -> tuple:
    """``tensors`` (q first) as ``torch.autocast`` hands them to PyTorch's SDPA where it is on for
    q's device: float32, float16 and bfloat16 tensors on that device cast to autocast's dtype
    (differentiably; gradients return in each input's dtype), anything else as given for the
    checks to judge (float64 stays float64, as autocast leaves it). So an fp32 model under
    ``torch.autocast(dtype=torch.bfloat16)`` runs attention in bf16, as with SDPA, and inputs
    of mixed dtypes (q and k in fp32 after a rotary embedding, v in bf16) are taken."""
    q = tensors[0]
    if not isinstance(q, torch.Tensor) or q.device.type not in _AUTOCAST_DEVICES:
        return tensors
    device_type = q.device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype)
        if isinstance(t, torch.Tensor)
        and t.dtype in SUPPORTED_DTYPES
        and t.dtype != dtype
        and t.device.type == device_type
        else t
        for t in tensors
    )


def forward_ad_active(*tensors: object) -> bool:
    """Whether forward-mode AD would differentiate through a call on ``tensors``: one of them
    carries a tangent at the current ``torch.autograd.forward_ad`` level, or a ``torch.func``
    jvp transform (``jvp``, ``jacfwd``, ``hessian``) is active. FlashCore's ops have no
    forward-mode formula, and PyTorch does not refuse them for it: a tangent through them came
    out zero (``torch.func.jvp``) or missing (dual tensors), silently."""
    if _forward_ad._current_level >= 0:
        for t in tensors:
            if isinstance(t, torch.Tensor) and _forward_ad.unpack_dual(t).tangent is not None:
                return True
    return transform_active("Jvp")


FORWARD_AD = (
    "{fn} has no forward-mode derivative, and forward-mode AD is differentiating through it "
    "(torch.func.jvp, jacfwd or hessian, or torch.autograd.forward_ad's dual tensors): the "
    "tangent of its output would be lost; differentiate it in reverse mode (backward, "
    "torch.autograd.grad)"
)


def check_no_forward_ad(fn: str, *tensors: object) -> None:
    """Raise NotImplementedError where forward-mode AD would go through ``fn``
    (``forward_ad_active``)."""
    if forward_ad_active(*tensors):
        raise NotImplementedError(FORWARD_AD.format(fn=fn))


def entry_inputs(fn: str, q: object, k: object, v: object, *others: object) -> tuple:
    """``(q, k, v)`` as the entry point ``fn`` takes them, before any other check: cast as
    autocast casts them (``autocast_inputs``), forward-mode AD through them or ``others``
    refused (``check_no_forward_ad``). With both off, two C calls."""
    if any_autocast():
        q, k, v = autocast_inputs(q, k, v)
    check_no_forward_ad(fn, q, k, v, *others)
    return q, k, v


def check_dense(name: str, t: object, what: str = "a torch.Tensor") -> torch.Tensor:
    """``t`` a tensor with strides: not sparse, not nested (the kernels read plain memory)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be {what}, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_nested:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise TypeError(f"{name} must be a dense (strided) tensor, got {kind}")
    return t


def check_tensor(name: str, t: object, packed: bool = False) -> torch.Tensor:
    check_dense(name, t)
    dims, layout = (
        (3, "(total, heads, head_dim)") if packed else (4, "(batch, heads, seqlen, head_dim)")
    )
    if t.dim() != dims:
        raise ValueError(
            f"{name} must have {dims} dims {layout}, got {t.dim()} dims with shape {tuple(t.shape)}"
        )
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    return t


def check_pair(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names: str, shape: str) -> None:
    """k and v (named by ``names``, "k/v" or "k_cache/v_cache") against q: dtype, device, one shape
    but for the head dims, and k's head dim equal to q's."""
    k_name, v_name = names.split("/")
    for name, t in ((k_name, k), (v_name, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{k_name} and {v_name} must have the same shape {shape} (only their head dims may "
            f"differ), got {k_name} {tuple(k.shape)} and {v_name} {tuple(v.shape)}"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{k_name} head_dim must equal q's ({q.shape[-1]}), got {k.shape[-1]}")


def check_gqa(heads: int, kv_heads: int, names: str, empty_ok: bool = False) -> None:
    """q's heads a multiple of k/v's (``empty_ok``: H = Hkv = 0 is an empty problem)."""
    if empty_ok and heads == kv_heads:
        return
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"q's heads ({heads}) must be a multiple of {names}'s heads ({kv_heads}) for GQA/MQA"
        )


def check_block_size(block_size: int, name: str) -> None:
    if block_size == 0 or block_size % 16:
        raise ValueError(
            f"block_size ({name}.shape[2] of a paged cache) must be a positive multiple of 16, "
            f"got {block_size}"
        )


def runnable_device(device: torch.device) -> bool:
    """Whether FlashCore runs on ``device``: CUDA; the CPU only through Triton's interpreter;
    meta (shapes only, through the registered ops' fake implementations)."""
    kind = device.type
    return kind in ("cuda", "meta") or (kind == "cpu" and interpreted())


def check_runnable(q: torch.Tensor) -> None:
    """``runnable_device(q.device)``, or an error that says what to do."""
    if runnable_device(q.device):
        return
    if q.device.type == "cpu":
        raise ValueError(
            "q is on the CPU, but FlashCore's kernels were defined for a GPU; set "
            "TRITON_INTERPRET=1 before triton is first imported (flashcore imports it at its "
            "first call) to run them through Triton's interpreter, or move the tensors to CUDA"
        )
    raise ValueError(
        f"q must be on a CUDA device (or the CPU with TRITON_INTERPRET=1, or the meta device for "
        f"shapes only), got {q.device}"
    )


def check_inputs(q: object, k: object, v: object, packed: bool = False) -> None:
    """q, k, v as ``attention`` takes them, or packed ``(total, heads, head_dim)`` ones."""
    q = check_tensor("q", q, packed)
    k = check_tensor("k", k, packed)
    v = check_tensor("v", v, packed)
    layout = "(total_k, kv_heads)" if packed else "(batch, kv_heads, seqlen_k)"
    check_pair(q, k, v, "k/v", layout)
    if not packed and k.shape[0] != q.shape[0]:
        raise ValueError(f"k/v batch size must equal q's ({q.shape[0]}), got {k.shape[0]}")
    check_gqa(q.shape[1], k.shape[1], "k/v", empty_ok=True)
    check_head_dims(q.shape[-1], v.shape[-1], "v")
    check_runnable(q)


def check_head_dims(head_dim: int, head_dim_v: int, v_name: str) -> None:
    """Both head dims (q/k's and v's, which may differ) from 1 to MAX_HEAD_DIM."""
    for name, dim in (("q.shape[-1]", head_dim), (f"{v_name}.shape[-1]", head_dim_v)):
        if dim > MAX_HEAD_DIM:
            raise NotImplementedError(
                f"head dims up to {MAX_HEAD_DIM} are supported, got {name} = {dim}"
            )
        if dim == 0:
            raise ValueError(f"head dims must be at least 1, got {name} = 0")


def check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_cu_seqlens(q: torch.Tensor, cu_seqlens_q: object, cu_seqlens_k: object) -> None:
    """Type, shape and device only: reading the offsets would sync with the device."""
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_dense(name, t)
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.dim() != 1 or t.shape[0] < 1:
            raise ValueError(f"{name} must have shape (batch + 1,), got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {t.device}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(
            f"cu_seqlens_k must have cu_seqlens_q's shape {tuple(cu_seqlens_q.shape)} (one "
            f"offset per sequence, plus one), got {tuple(cu_seqlens_k.shape)}"
        )


def check_max_seqlen(
    name: str, value: object, total: int, total_name: str, packed: bool = True
) -> int:
    """``total`` bounds ``value``: the packed rows (``packed``) or a paged cache's capacity."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    # Without reading cu_seqlens, what the packed size alone rules out: a sequence longer than
    # the pack, or rows to attend with no sequence longer than 0 (the grid would be empty). A
    # paged cache's capacity says nothing of its lengths: every sequence may hold no key.
    lowest = 1 if packed and total > 0 else 0
    if value < lowest or value > total:
        raise ValueError(
            f"{name} must be the longest sequence's length, from {lowest} to {total_name} "
            f"({total}), got {value}"
        )
    return value


def check_window(window: object) -> tuple[int, int]:
    if window is None:
        return -1, -1
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) tuple of two ints or None, got {window!r}")
    for side, value in zip(("left", "right"), window, strict=True):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"window {side} must be an int, got {type(value).__name__}")
        if value < -1:
            raise ValueError(f"window {side} must be >= -1 (-1: unbounded), got {value}")
    return int(window[0]), int(window[1])


def check_softcap(softcap: object) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number or None, got {type(softcap).__name__}")
    softcap = float(softcap)
    if not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap}")
    return softcap


def check_alibi(
    slopes: object, batch: int, heads: int, device: torch.device
) -> torch.Tensor | None:
    if slopes is None:
        return None
    check_dense("alibi_slopes", slopes, "a torch.Tensor or None")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"alibi_slopes must have shape (heads,) = ({heads},) or (batch, heads) = "
            f"({batch}, {heads}), got {tuple(slopes.shape)}"
        )
    if slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {slopes.dtype}")
    if slopes.device != device:
        raise ValueError(f"alibi_slopes must be on q's device ({device}), got {slopes.device}")
    if slopes.requires_grad and torch.is_grad_enabled():
        # Not a silent None: no function here computes a gradient for the slopes.
        raise ValueError(
            "alibi_slopes requires grad, but FlashCore computes no gradient for the slopes (they "
            "would get none); pass alibi_slopes.detach() or slopes that do not require grad"
        )
    return slopes


def check_sinks(
    sinks: object, heads: int, device: torch.device, differentiable: bool = True
) -> torch.Tensor | None:
    """Sinks: float32 ``(heads,)`` on q's device; without autograd (``differentiable`` False),
    not requiring a gradient while grad mode is on."""
    if sinks is None:
        return None
    check_dense("sinks", sinks, "a torch.Tensor or None")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(
            f"sinks must have shape (heads,) = ({heads},), one logit per query head, got "
            f"{tuple(sinks.shape)}"
        )
    if sinks.dtype != torch.float32:
        raise TypeError(f"sinks must be float32, got {sinks.dtype}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on q's device ({device}), got {sinks.device}")
    if not differentiable and sinks.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "sinks requires grad, but attention_with_kvcache is inference-only (no backward); "
            "pass sinks.detach() or call it under torch.no_grad()"
        )
    return sinks


def check_paged_varlen(q, k, v, block_table, batch: int) -> int:
    """``attention_varlen`` with a block table: q packed ``(total_q, H, D)``, k and v paged caches
    ``(num_blocks, Hkv, block_size, D/Dv)``, block_table int32 ``(batch, max_blocks)``. Returns
    the capacity (``max_blocks * block_size``), which bounds max_seqlen_k."""
    q = check_tensor("q", q, packed=True)
    k = check_tensor("k", k)
    v = check_tensor("v", v)
    check_pair(q, k, v, "k/v", "(num_blocks, kv_heads, block_size)")
    check_gqa(q.shape[1], k.shape[1], "k/v")
    check_block_size(k.shape[2], "k")
    check_head_dims(q.shape[-1], v.shape[-1], "v")
    check_int_tensor("block_table", block_table, (batch, -1), q.device)
    check_runnable(q)
    return block_table.shape[1] * k.shape[2]


def check_int_tensor(name: str, t: object, shape: tuple[int, ...], device: torch.device):
    check_dense(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != len(shape) or any(e >= 0 and e != g for e, g in zip(shape, t.shape, strict=True)):
        want = ", ".join("*" if e < 0 else str(e) for e in shape)
        raise ValueError(f"{name} must have shape ({want}), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {t.device}")
    return t


def check_kvcache_inputs(q, k_cache, v_cache, cache_seqlens, block_table) -> None:
    q = check_tensor("q", q)
    k_cache = check_tensor("k_cache", k_cache)
    v_cache = check_tensor("v_cache", v_cache)
    check_pair(
        q, k_cache, v_cache, "k_cache/v_cache", "(B or num_blocks, kv_heads, S_max or block_size)"
    )
    batch = q.shape[0]
    check_int_tensor("cache_seqlens", cache_seqlens, (batch,), q.device)
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"k_cache/v_cache batch size must equal q's ({batch}) for a contiguous cache "
                f"(B, Hkv, S_max, D), got {k_cache.shape[0]}"
            )
    else:
        check_int_tensor("block_table", block_table, (batch, -1), q.device)
        check_block_size(k_cache.shape[2], "k_cache")
    check_gqa(q.shape[1], k_cache.shape[1], "k_cache/v_cache")
    check_head_dims(q.shape[-1], v_cache.shape[-1], "v_cache")
    check_runnable(q)


def check_num_splits(num_splits: object) -> int:
    if num_splits is None:
        return 0
    if isinstance(num_splits, bool) or not isinstance(num_splits, int):
        raise TypeError(f"num_splits must be an int or None, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 (or None to choose), got {num_splits}")
    return num_splits
