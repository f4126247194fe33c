"""Property tests (interpreter tier): random problems against the reference, FlashAttention's rule.

Hypothesis draws batch, heads, a GQA group, Sq and Sk (1 to 150), the head dim, dtype, causal,
scale and a memory layout per tensor; for the KV cache, the cache (dense or paged), its lengths,
the split count and the score options. ``derandomize=True`` makes the examples a function of the
test alone, so CI runs the same ones every time; a failure prints the drawn problem.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flashcore
from flashcore import reference
from helpers import check_forward, make_qkv, paged_pools
from numerics import assert_fa_rule
from shapes import DTYPES, Case

HEAD_DIMS = [16, 32, 64, 80, 96, 128]
# make_qkv's layouts, plus a last dim with stride != 1 (the API copies that one).
LAYOUTS = ["bhsd", "bshd", "sliced", "last_dim_strided"]

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    # The fixtures (device, the autouse seed) are per-test and stateless: sharing them is fine.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class Problem(NamedTuple):
    case: Case
    dtype: torch.dtype
    causal: bool
    scale: float | None
    q_layout: str
    kv_layout: str
    seed: int


@st.composite
def problems(draw) -> Problem:
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.integers(1, 3))
    case = Case(
        batch=draw(st.integers(1, 2)),
        heads=kv_heads * group,
        kv_heads=kv_heads,
        seqlen_q=draw(st.integers(1, 150)),
        seqlen_k=draw(st.integers(1, 150)),
        head_dim=draw(st.sampled_from(HEAD_DIMS)),
    )
    return Problem(
        case=case,
        dtype=draw(st.sampled_from(list(DTYPES.values()))),
        causal=draw(st.booleans()),
        scale=draw(st.none() | st.floats(0.01, 2.0)),
        q_layout=draw(st.sampled_from(LAYOUTS)),
        kv_layout=draw(st.sampled_from(LAYOUTS)),
        seed=draw(st.integers(0, 2**16)),
    )


def _tensors(p: Problem, layout: str, device: str) -> tuple[torch.Tensor, ...]:
    base = "bhsd" if layout == "last_dim_strided" else layout
    q, k, v = make_qkv(p.case, p.dtype, device, layout=base)
    if layout == "last_dim_strided":
        q, k, v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (q, k, v))
    return q, k, v


# Always run, whatever the draws: each head dim above 64, Sq > Sk causal (rows that see no key),
# GQA with mixed layouts, bf16.
EXAMPLES = [
    Problem(Case(1, 4, 2, 150, 37, 80), torch.bfloat16, True, None, "bshd", "sliced", 1),
    Problem(Case(2, 3, 1, 61, 150, 96), torch.float16, True, 0.3, "sliced", "bshd", 2),
    Problem(
        Case(1, 2, 1, 129, 129, 128), torch.float32, False, None, "last_dim_strided", "bhsd", 3
    ),
]


@SETTINGS
@given(p=problems())
@example(p=EXAMPLES[0])
@example(p=EXAMPLES[1])
@example(p=EXAMPLES[2])
def test_forward_property(p: Problem, device):
    torch.manual_seed(p.seed)
    q, _, _ = _tensors(p, p.q_layout, device)
    _, k, v = _tensors(p, p.kv_layout, device)
    out, lse = flashcore.attention(q, k, v, causal=p.causal, scale=p.scale, return_lse=True)
    assert out.shape == q.shape
    check_forward(out, lse, q, k, v, causal=p.causal, scale=p.scale)


class CacheProblem(NamedTuple):
    """``attention_with_kvcache`` off the decode tier's grid: any split count, a dense cache
    whose rows past each sequence's keys are NaN or a paged one (``block_size`` > 0), score
    options, a value head dim of its own."""

    batch: int
    kv_heads: int
    group: int
    seqlen_q: int
    capacity: int
    seqlens: tuple[int, ...]
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    block_size: int
    num_splits: int | None
    causal: bool
    window: tuple[int, int] | None
    softcap: float | None
    sinks: bool
    seed: int


@st.composite
def cache_problems(draw) -> CacheProblem:
    batch = draw(st.integers(1, 3))
    capacity = draw(st.integers(1, 150))
    head_dim = draw(st.sampled_from(HEAD_DIMS))
    return CacheProblem(
        batch=batch,
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.integers(1, 4)),
        seqlen_q=draw(st.integers(1, 9)),
        capacity=capacity,
        seqlens=tuple(draw(st.integers(0, capacity)) for _ in range(batch)),
        head_dim=head_dim,
        head_dim_v=draw(st.sampled_from([head_dim, head_dim, 32])),
        dtype=draw(st.sampled_from(list(DTYPES.values()))),
        block_size=draw(st.sampled_from([0, 0, 16, 32, 48])),
        num_splits=draw(st.none() | st.integers(1, 6)),
        causal=draw(st.booleans()),
        window=draw(st.none() | st.tuples(st.integers(-1, 40), st.integers(-1, 40))),
        softcap=draw(st.none() | st.just(5.0)),
        sinks=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@SETTINGS
@given(p=cache_problems())
def test_kvcache_property(p: CacheProblem, device):
    torch.manual_seed(p.seed)
    heads = p.kv_heads * p.group
    q = torch.randn(p.batch, heads, p.seqlen_q, p.head_dim, dtype=p.dtype, device=device)
    shape_k, shape_v = (p.capacity, p.kv_heads, p.head_dim), (p.capacity, p.kv_heads, p.head_dim_v)
    ks = [torch.randn(shape_k, dtype=p.dtype, device=device) for _ in range(p.batch)]
    vs = [torch.randn(shape_v, dtype=p.dtype, device=device) for _ in range(p.batch)]
    table = None
    if p.block_size:
        k_cache, v_cache, table = paged_pools(ks, vs, p.block_size)
    else:
        k_cache, v_cache = (torch.stack(t).transpose(1, 2).contiguous() for t in (ks, vs))
        for b, n in enumerate(p.seqlens):  # past the valid keys: never read
            k_cache[b, :, n:], v_cache[b, :, n:] = float("nan"), float("nan")
    opts = {
        "cache_seqlens": torch.tensor(p.seqlens, dtype=torch.int32, device=device),
        "block_table": table, "causal": p.causal, "window": p.window, "softcap": p.softcap,
        "sinks": torch.randn(heads, device=device) if p.sinks else None,
    }  # fmt: skip
    out, lse = flashcore.attention_with_kvcache(
        q, k_cache, v_cache, num_splits=p.num_splits, return_lse=True, **opts
    )
    ref = reference.attention_with_kvcache(q, k_cache, v_cache, **opts)
    pt = reference.attention_with_kvcache(q, k_cache, v_cache, dtype=p.dtype, **opts)
    assert out.shape == (*q.shape[:3], p.head_dim_v)
    assert_fa_rule("out", out, pt.out, ref.out)
    assert_fa_rule("lse", lse, pt.lse, ref.lse)
