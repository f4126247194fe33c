"""Repeated runs on the GPU are bit-identical: forward, and backward with ``deterministic=True``.

Compiled kernels only (the interpreter is deterministic by construction). A backward that
accumulates dQ/dK/dV with atomics in a data-dependent order fails here by design.
"""

import pytest
import torch

import flashcore
from helpers import make_qkv
from shapes import DETERMINISM

REPEATS = 100


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", DETERMINISM, ids=[c.id for c in DETERMINISM])
def test_forward_deterministic(case, causal):
    q, k, v = make_qkv(case, torch.bfloat16, "cuda")
    out0, lse0 = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    for i in range(REPEATS):
        out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
        assert torch.equal(out, out0), f"out differs at repeat {i}"
        assert torch.equal(lse, lse0), f"lse differs at repeat {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", DETERMINISM, ids=[c.id for c in DETERMINISM])
def test_backward_deterministic(case, causal):
    """``deterministic=True``, even under ``use_tier("sm90")`` (whose dQ is atomic)."""
    q, k, v = (t.requires_grad_() for t in make_qkv(case, torch.bfloat16, "cuda"))
    dout = torch.randn_like(q)

    def grads():
        with flashcore.use_tier("sm90"):
            out = flashcore.attention(q, k, v, causal=causal, deterministic=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    first = grads()
    for i in range(REPEATS):
        for name, got, want in zip(("dq", "dk", "dv"), grads(), first, strict=True):
            assert torch.equal(got, want), f"{name} differs at repeat {i}"
