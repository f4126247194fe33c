"""The isolation probes of ``flashcore.debug`` against the reference, with FlashAttention's rule.

Every probe runs on every interpreter case (ragged lengths, Sq != Sk both ways, GQA, padded head
dims) in fp16, causal and not; one case covers bf16 and fp32.
"""

import pytest
import torch

from flashcore import debug, reference
from helpers import make_qkv
from numerics import assert_fa_rule
from shapes import INTERP, Case

PROBES = ["scores", "probs", "uniform_pv"]
DTYPE_CASE = Case(1, 4, 2, 47, 70, 80)


def check_probe(probe: str, case: Case, dtype: torch.dtype, causal: bool, device: str) -> None:
    q, k, v = make_qkv(case, dtype, device)
    if probe == "scores":
        out = debug.probe_scores(q, k, causal=causal)
        assert out.dtype == torch.float32
        ref = reference.scores(q, k, causal=causal, dtype=torch.float64)
        pt = reference.scores(q, k, causal=causal, dtype=dtype)
        assert_fa_rule("scores", out, pt, ref)
    elif probe == "probs":
        out, lse = debug.probe_probs(q, k, causal=causal)
        assert out.dtype == lse.dtype == torch.float32
        ref = reference.probs(q, k, causal=causal, dtype=torch.float64)
        pt = reference.probs(q, k, causal=causal, dtype=dtype)
        assert_fa_rule("probs", out, pt.probs, ref.probs)
        assert_fa_rule("lse", lse, pt.lse, ref.lse)
    else:
        out = debug.probe_uniform_pv(v, seqlen_q=case.seqlen_q, num_heads=case.heads, causal=causal)
        assert out.dtype == dtype
        # Zero queries make every visible score 0: the reference then averages the visible V rows.
        zero_q = torch.zeros_like(q)
        ref = reference.attention(zero_q, k, v, causal=causal, dtype=torch.float64)
        pt = reference.attention(zero_q, k, v, causal=causal, dtype=dtype)
        assert_fa_rule("uniform P @ V", out, pt.out, ref.out)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", INTERP, ids=[c.id for c in INTERP])
@pytest.mark.parametrize("probe", PROBES)
def test_probe(probe, case, causal, device):
    check_probe(probe, case, torch.float16, causal, device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("probe", PROBES)
def test_probe_dtypes(probe, dtype, device):
    check_probe(probe, DTYPE_CASE, dtype, True, device)


def test_scores_hidden_keys_exact(device):
    # Sq > Sk causal: the first Sq - Sk rows see no key, every later row sees one more key.
    q, k, _ = make_qkv(Case(1, 1, 1, 70, 20, 32), torch.float16, device)
    s = debug.probe_scores(q, k, causal=True)
    assert torch.equal(torch.isfinite(s[0, 0]), reference.causal_mask(70, 20, device=device))
    p, lse = debug.probe_probs(q, k, causal=True)
    assert torch.all(p[:, :, :50] == 0)
    assert torch.all(lse[:, :, :50] == float("-inf"))
    torch.testing.assert_close(p.sum(-1)[:, :, 50:], torch.ones(1, 1, 20, device=device))


def test_uniform_pv_is_mean_of_visible_rows(device):
    v = torch.arange(6, dtype=torch.float32, device=device).reshape(1, 1, 6, 1).expand(1, 1, 6, 16)
    out = debug.probe_uniform_pv(v, seqlen_q=3, causal=True)
    # Sq = 3, Sk = 6, bottom-right: query i sees keys 0..i+3, whose mean is (i + 3) / 2.
    expected = torch.tensor([1.5, 2.0, 2.5], device=device)[:, None].expand(3, 16)
    torch.testing.assert_close(out[0, 0], expected)


def test_uniform_pv_bad_heads(device):
    v = torch.randn(1, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match="num_heads must be a positive multiple of v's heads"):
        debug.probe_uniform_pv(v, seqlen_q=4, num_heads=3)
