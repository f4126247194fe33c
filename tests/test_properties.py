"""Property tests (interpreter tier): random problems against the reference, FlashAttention's rule.

Hypothesis draws batch, heads, a GQA group, Sq and Sk (1 to 150), the head dim, dtype, causal,
scale and a memory layout per tensor. ``derandomize=True`` makes the examples a function of the
test alone, so CI runs the same ones every time; a failure prints the drawn problem.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flashcore
from helpers import check_forward, make_qkv
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
