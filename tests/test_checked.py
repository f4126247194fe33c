"""``flashcore.checked()``: the offsets the kernels trust are validated, scoped to the block."""

from __future__ import annotations

import threading

import pytest
import torch

import flashcore
from helpers import cu_seqlens


def varlen_inputs(device):
    q = torch.randn(12, 2, 16, device=device)
    k = torch.randn(20, 1, 16, device=device)
    return q, k, k.clone(), cu_seqlens((5, 7), device), cu_seqlens((8, 12), device)


BAD_VARLEN = {
    # name: (how to break (cu_q, cu_k, max_q, max_k), message)
    "not-from-0": (lambda q, k, a, b: (q + 1, k, a, b), r"^cu_seqlens_q must start at 0"),
    "decreasing": (
        lambda q, k, a, b: (torch.tensor([0, 7, 5], dtype=torch.int32, device=q.device), k, a, b),
        r"^cu_seqlens_q must not decrease",
    ),
    "past-total": (
        lambda q, k, a, b: (q, torch.tensor([0, 8, 30], dtype=torch.int32, device=q.device), a, b),
        r"^cu_seqlens_k must end at the packed total \(20\), got 30",
    ),
    "max-too-small": (lambda q, k, a, b: (q, k, 5, b), r"^max_seqlen_q \(5\) is smaller"),
}


@pytest.mark.parametrize("name", list(BAD_VARLEN))
def test_checked_varlen(name, device):
    q, k, v, cu_q, cu_k = varlen_inputs(device)
    make, message = BAD_VARLEN[name]
    args = make(cu_q, cu_k, 7, 12)
    with flashcore.checked(), pytest.raises(ValueError, match=message):
        flashcore.attention_varlen(q, k, v, *args)
    # Valid offsets pass the checks and give the unchecked result.
    with flashcore.checked():
        got = flashcore.attention_varlen(q, k, v, cu_q, cu_k, 7, 12, causal=True)
    assert torch.equal(got, flashcore.attention_varlen(q, k, v, cu_q, cu_k, 7, 12, causal=True))


def test_checked_kvcache(device):
    q = torch.randn(2, 2, 1, 16, device=device)
    cache = torch.randn(4, 1, 16, 16, device=device)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    lens = torch.tensor([20, 40], dtype=torch.int32, device=device)
    with flashcore.checked(), pytest.raises(ValueError, match=r"^cache_seqlens\[1\] = 40"):
        flashcore.attention_with_kvcache(q, cache, cache, cache_seqlens=lens, block_table=table)
    lens[1] = 30
    bad = table.clone()
    bad[1, 1] = 9
    with flashcore.checked(), pytest.raises(ValueError, match=r"^block_table\[1, 1\] = 9"):
        flashcore.attention_with_kvcache(q, cache, cache, cache_seqlens=lens, block_table=bad)
    # Entries a sequence never reads are not checked.
    bad[0, 1] = -5
    lens[0] = 16
    bad[1, 1] = 3
    with flashcore.checked():
        flashcore.attention_with_kvcache(q, cache, cache, cache_seqlens=lens, block_table=bad)


def test_checked_paged_varlen(device):
    q = torch.randn(6, 2, 16, device=device)
    cache = torch.randn(3, 1, 16, 16, device=device)
    table = torch.tensor([[0, 7], [2, 1]], dtype=torch.int32, device=device)
    cu_q, cu_k = cu_seqlens((3, 3), device), cu_seqlens((20, 4), device)
    with flashcore.checked(), pytest.raises(ValueError, match=r"^block_table\[0, 1\] = 7"):
        flashcore.attention_varlen(q, cache, cache, cu_q, cu_k, 3, 20, block_table=table)


def test_checked_is_scoped():
    """Off outside the block and in other threads; the flag must be a bool."""
    seen = []
    with flashcore.checked():
        thread = threading.Thread(target=lambda: seen.append(flashcore.offsets.active()))
        thread.start()
        thread.join()
        assert flashcore.offsets.active()
        with flashcore.checked(False):
            assert not flashcore.offsets.active()
    assert seen == [False]
    assert not flashcore.offsets.active()
    with pytest.raises(TypeError, match="enabled must be a bool"), flashcore.checked(1):
        pass


def test_bad_offsets_stay_inside_the_tensors(device):
    """Unchecked, offsets past the packed tensor or a block table entry past the cache are
    clamped by the kernels: no fault, and the other sequences' rows are exact."""
    q, k, v, cu_q, cu_k = varlen_inputs(device)
    want = flashcore.attention_varlen(q, k, v, cu_q, cu_k, 7, 12, causal=True)
    bad_q = cu_q.clone()
    bad_q[-1] = 1 << 20  # the last sequence ends far past total_q
    bad_k = cu_k.clone()
    bad_k[-1] = 1 << 20
    got = flashcore.attention_varlen(q, k, v, bad_q, bad_k, 7, 12, causal=True)
    assert torch.equal(got[:5], want[:5])  # sequence 0 untouched
    assert torch.isfinite(got[5:]).all()
    # Paged: a table entry far outside the cache reads a page of the cache.
    cache = torch.randn(3, 1, 16, 16, device=device)
    table = torch.tensor([[0, 1], [2, 1 << 20]], dtype=torch.int32, device=device)
    cu_k = cu_seqlens((20, 30), device)
    out = flashcore.attention_varlen(q, cache, cache, cu_q, cu_k, 7, 30, block_table=table)
    good = table.clone()
    good[1, 1] = 2
    want = flashcore.attention_varlen(q, cache, cache, cu_q, cu_k, 7, 30, block_table=good)
    assert torch.equal(out, want)  # clamped to the last page, 2
    lens = torch.tensor([20, 30], dtype=torch.int32, device=device)
    q4 = torch.randn(2, 2, 1, 16, device=device)
    out = flashcore.attention_with_kvcache(q4, cache, cache, cache_seqlens=lens, block_table=table)
    want = flashcore.attention_with_kvcache(q4, cache, cache, cache_seqlens=lens, block_table=good)
    assert torch.equal(out, want)
