"""The process side of tests/test_distributed.py: the ring cases and what each spawned rank runs.

``main`` is the target of ``torch.multiprocessing.spawn``. It sets the environment first (the
interpreter flag before anything imports triton, NCCL's multicast off on GPUs), so nothing depends
on the parent's state, then joins the group, runs every case it was given and writes, per rank, a
JSON file ``{case id: None | the failure}``. Rank 0 checks the gathered results against the
reference; every rank records its own exceptions, so a failure on any rank names its case.

Nothing here imports flashcore or triton at module level: the parent imports this module too.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
import zlib
from pathlib import Path
from typing import NamedTuple

import torch


class RingCase(NamedTuple):
    """A sharded problem: the sequence is ``2 * P * chunk`` long (zigzag's 2P chunks; the
    contiguous layout gives each rank two of them), ``world`` ranks (0: every rank of the run).
    ``lse_grad``: a gradient reaches the LSE too (else only ``out``, called with
    ``return_lse=False``)."""

    batch: int
    heads: int
    kv_heads: int
    chunk: int
    head_dim: int
    layout: str
    causal: bool
    lse_grad: bool = True
    dtype: str = "fp32"

    @property
    def id(self) -> str:
        return (
            f"b{self.batch}h{self.heads}kv{self.kv_heads}-c{self.chunk}-d{self.head_dim}-"
            f"{self.layout}-{'causal' if self.causal else 'full'}-"
            f"{'dlse' if self.lse_grad else 'dout'}-{self.dtype}"
        )


# Interpreter tier, two ranks (fp32: the interpreter computes bf16 on raw bits).
RING = (
    RingCase(1, 2, 1, 12, 16, "contiguous", False),
    RingCase(1, 4, 2, 12, 32, "contiguous", True),
    RingCase(1, 2, 2, 13, 16, "contiguous", True, lse_grad=False),
    RingCase(1, 4, 2, 12, 16, "zigzag", True),
    RingCase(2, 2, 1, 12, 32, "zigzag", True, lse_grad=False),
    RingCase(1, 2, 2, 24, 16, "zigzag", False),
)
# Interpreter tier, three ranks: a ring whose next and previous ranks differ.
RING3 = (
    RingCase(1, 2, 1, 8, 16, "contiguous", True),
    RingCase(1, 4, 2, 8, 16, "zigzag", True),
)
# GPU tier, two GPUs (NCCL), compiled kernels.
RING_GPU = (
    RingCase(2, 8, 2, 256, 128, "zigzag", True, dtype="bf16"),
    RingCase(1, 8, 8, 384, 64, "contiguous", True, dtype="fp16"),
    RingCase(2, 4, 1, 160, 64, "zigzag", False, dtype="bf16"),
    RingCase(1, 4, 2, 96, 128, "contiguous", False, lse_grad=False, dtype="fp32"),
)


def main(rank: int, world: int, port: int, kind: str, cases: tuple, out_dir: str) -> None:
    """Spawned rank: ``kind`` is "cpu" (gloo, interpreter) or "cuda" (NCCL, one GPU a rank)."""
    if kind == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
        torch.set_num_threads(1)  # the ranks share the machine's cores
        backend, device = "gloo", torch.device("cpu")
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
        torch.cuda.set_device(rank)
        backend, device = "nccl", torch.device("cuda", rank)
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
        device_id=device if kind == "cuda" else None,
    )
    results: dict[str, str | None] = {}
    try:
        for case in cases:
            name = case if isinstance(case, str) else case.id
            try:
                if isinstance(case, str):
                    CHECKS[case](rank, world, device)
                else:
                    run_case(case, rank, device)
                results[name] = None
            except Exception:
                results[name] = f"rank {rank}: {traceback.format_exc()}"
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def run_case(case: RingCase, rank: int, device: torch.device, group=None) -> None:
    """Ring attention forward and backward on shards of one sequence; rank 0 checks the gathered
    out, LSE and gradients against the float64 reference with FlashAttention's rule."""
    import torch.distributed as dist

    from flashcore.distributed import ring_attention, shard, unshard

    dtype = DTYPES[case.dtype]
    size = dist.get_world_size(group)
    seqlen = 2 * size * case.chunk
    gen = torch.Generator().manual_seed(zlib.crc32(case.id.encode()))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    b, h, hkv, d = case.batch, case.heads, case.kv_heads, case.head_dim
    q, k, v = rand(b, h, seqlen, d), rand(b, hkv, seqlen, d), rand(b, hkv, seqlen, d)
    dout = rand(b, h, seqlen, d)
    dlse = torch.randn(b, h, seqlen, generator=gen).to(device) if case.lse_grad else None

    def cut(t: torch.Tensor) -> torch.Tensor:
        return shard(t, case.layout, group=group)

    local = [cut(t).detach().requires_grad_() for t in (q, k, v)]
    result = ring_attention(
        *local, causal=case.causal, layout=case.layout, group=group, return_lse=case.lse_grad
    )
    out, lse = result if case.lse_grad else (result, None)
    outputs, grads = [out], [cut(dout)]
    if case.lse_grad:
        outputs.append(lse)
        grads.append(cut(dlse))
    got = torch.autograd.grad(outputs, local, grads)
    assert out.shape == local[0].shape and out.dtype == dtype
    gathered = {
        name: unshard(t, case.layout, group=group)
        for name, t in zip(("out", "dq", "dk", "dv"), (out, *got), strict=True)
    }
    if lse is not None:
        assert lse.shape == out.shape[:3] and lse.dtype == torch.float32
        gathered["lse"] = unshard(lse, case.layout, group=group)
    if dist.get_rank(group) == 0:
        check_gathered(gathered, q, k, v, dout, dlse, causal=case.causal)


def check_gathered(gathered: dict, q, k, v, dout, dlse, *, causal: bool) -> None:
    from flashcore import reference
    from helpers import reference_grads
    from numerics import assert_fa_rule

    ref = reference.attention(q, k, v, causal=causal, dtype=torch.float64)
    pt = reference.attention(q, k, v, causal=causal, dtype=q.dtype)
    assert_fa_rule("out", gathered["out"], pt.out, ref.out)
    if "lse" in gathered:
        assert_fa_rule("lse", gathered["lse"], pt.lse, ref.lse)
    want64 = reference_grads(q, k, v, dout, dlse, causal=causal, dtype=torch.float64)
    want_pt = reference_grads(q, k, v, dout, dlse, causal=causal, dtype=q.dtype)
    for name, p, r in zip(("dq", "dk", "dv"), want_pt, want64, strict=True):
        assert gathered[name].dtype == q.dtype, f"{name}: dtype {gathered[name].dtype}"
        assert_fa_rule(name, gathered[name], p, r)


def check_unequal_shards(rank: int, world: int, device: torch.device) -> None:
    """Shard lengths that differ between ranks raise on every rank, before any transfer."""
    import pytest

    from flashcore.distributed import ring_attention

    seqlen = 4 + 2 * rank
    q = torch.randn(1, 2, seqlen, 16, device=device)
    with pytest.raises(ValueError, match=r"q.shape\[2\] \(the shard length\) must be equal"):
        ring_attention(q, q, q, causal=True)


def check_mismatched_options(rank: int, world: int, device: torch.device) -> None:
    """Options that differ between ranks (here causal) raise on every rank."""
    import pytest

    from flashcore.distributed import ring_attention

    q = torch.randn(1, 2, 8, 16, device=device)
    with pytest.raises(ValueError, match="causal must be equal on every rank"):
        ring_attention(q, q, q, causal=rank == 0)


def check_shard_round_trip(rank: int, world: int, device: torch.device) -> None:
    """shard cuts the positions as documented; unshard inverts it, on any dim."""
    from flashcore.distributed import shard, unshard

    positions = torch.arange(4 * world, device=device)
    chunk = [2 * rank, 2 * rank + 1]
    last = [2 * (2 * world - 1 - rank), 2 * (2 * world - 1 - rank) + 1]
    assert shard(positions, "zigzag", dim=0).tolist() == chunk + last
    assert shard(positions, "contiguous", dim=0).tolist() == list(range(4 * rank, 4 * rank + 4))
    x = torch.randn(3, 4 * world, 5, generator=torch.Generator().manual_seed(1)).to(device)
    for layout in ("contiguous", "zigzag"):
        for dim in (1, -2):
            assert torch.equal(unshard(shard(x, layout, dim=dim), layout, dim=dim), x)


def check_subgroup(rank: int, world: int, device: torch.device) -> None:
    """A group of ranks 0 and 2 (group peers are not global ranks); rank 1, not a member, gets
    an error naming the group."""
    import pytest
    import torch.distributed as dist

    from flashcore.distributed import ring_attention

    group = dist.new_group([0, 2])
    if rank == 1:
        q = torch.randn(1, 1, 4, 16, device=device)
        with pytest.raises(ValueError, match=r"group: this process .* is not a member"):
            ring_attention(q, q, q, group=group)
        return
    run_case(RingCase(1, 2, 1, 6, 16, "zigzag", True), rank, device, group=group)


CHECKS = {
    "unequal_shards": check_unequal_shards,
    "mismatched_options": check_mismatched_options,
    "shard_round_trip": check_shard_round_trip,
    "subgroup": check_subgroup,
}
