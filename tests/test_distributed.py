"""flashcore.distributed: ring attention over torch.distributed, forward and backward.

The multi-rank cases run in spawned process groups (gloo on 127.0.0.1 through the interpreter; NCCL
on two GPUs for the ``gpu`` tier), one group per tier for every case of it, since starting the
processes costs more than a case (``distributed_worker.py`` holds the cases and the rank side).
Each case is still its own test, reading its group's result. The rest runs in this process:
the causal block schedule against the mask, the LSE merge, a world of one against
``flashcore.attention`` bit for bit, and the argument errors (raised before any communication).
"""

from __future__ import annotations

import datetime
import json
import math
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton

import flashcore
from distributed_worker import RING, RING3, RING_GPU, main
from flashcore import distributed as fd
from flashcore import reference

# A deadlocked ring fails the test instead of hanging CI (the children's gloo timeout is 120 s).
SPAWN_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, kind: str, cases: tuple, out_dir) -> dict[str, list[str]]:
    """Run ``cases`` (RingCase or check names) on ``world`` spawned ranks; ``{name: failures}``."""
    context = mp.spawn(
        main, args=(world, free_port(), kind, cases, str(out_dir)), nprocs=world, join=False
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"{world} ranks did not finish in {SPAWN_TIMEOUT_S} s (deadlock?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
    failures: dict[str, list[str]] = {}
    for rank in range(world):
        for name, failure in json.loads((out_dir / f"rank{rank}.json").read_text()).items():
            failures.setdefault(name, [])
            if failure is not None:
                failures[name].append(failure)
    return failures


def interpreter_runs() -> bool:
    """Triton 3.6's interpreter (the CPU ranks' kernels) breaks on numpy >= 2.4 (0-d arrays as
    loop bounds); the package pins numpy below it, but a GPU machine's own numpy may be newer."""
    import numpy

    def version(text: str) -> tuple[int, int]:
        return tuple(int(part) for part in text.split(".")[:2])

    return version(triton.__version__) >= (3, 8) or version(numpy.__version__) < (2, 4)


def cpu_ranks(world: int, cases: tuple, out_dir) -> dict[str, list[str]]:
    if not interpreter_runs():
        pytest.skip("the CPU ranks need Triton's interpreter, which needs numpy < 2.4 here")
    return spawn(world, "cpu", cases, out_dir)


def assert_passed(results: dict[str, list[str]], name: str) -> None:
    assert name in results, f"{name} did not run"
    failures = results[name]
    assert not failures, "\n".join(failures)


TWO_RANK_CHECKS = ("unequal_shards", "mismatched_options", "shard_round_trip")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return cpu_ranks(2, (*RING, *TWO_RANK_CHECKS), tmp_path_factory.mktemp("ring2"))


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    return cpu_ranks(3, (*RING3, "subgroup"), tmp_path_factory.mktemp("ring3"))


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    return spawn(2, "cuda", RING_GPU, tmp_path_factory.mktemp("ring_gpu"))


@pytest.mark.parametrize("case", RING, ids=lambda c: c.id)
def test_two_ranks(two_ranks, case):
    """Out, LSE and dq, dk, dv (through out and, per case, the LSE), gathered from two ranks,
    against the float64 reference over the whole sequence (FlashAttention's rule)."""
    assert_passed(two_ranks, case.id)


@pytest.mark.parametrize("name", TWO_RANK_CHECKS)
def test_two_rank_checks(two_ranks, name):
    """Shards unequal across ranks, options unequal across ranks, shard/unshard."""
    assert_passed(two_ranks, name)


@pytest.mark.parametrize("case", RING3, ids=lambda c: c.id)
def test_three_ranks(three_ranks, case):
    """A ring whose next and previous ranks differ (with two they are the same rank)."""
    assert_passed(three_ranks, case.id)


def test_subgroup(three_ranks):
    """A group of global ranks 0 and 2; rank 1 (not a member) gets a ValueError."""
    assert_passed(three_ranks, "subgroup")


@pytest.mark.gpu
@pytest.mark.parametrize("case", RING_GPU, ids=lambda c: c.id)
def test_two_gpus(two_gpus, case):
    """The same on two GPUs over NCCL, compiled kernels, fp16/bf16/fp32."""
    assert_passed(two_gpus, case.id)


def positions(rank: int, world: int, seqlen: int, zigzag: bool) -> torch.Tensor:
    """Global positions of a rank's shard of length ``seqlen``, as the docstring defines them."""
    if not zigzag:
        return torch.arange(rank * seqlen, (rank + 1) * seqlen)
    chunk = seqlen // 2
    last = 2 * world - 1 - rank
    return torch.cat(
        (
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange(last * chunk, (last + 1) * chunk),
        )
    )


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_block_schedule_is_the_causal_mask(world, layout):
    """For every (rank, source) pair the block computed is exactly what the causal mask over
    global positions lets through: nothing visible outside it, all of it visible where it runs
    without a mask, the lower triangle where it runs causal; a skipped block sees nothing."""
    seqlen, zigzag = 6, layout == "zigzag"
    for rank in range(world):
        for source in range(world):
            q_pos = positions(rank, world, seqlen, zigzag)
            k_pos = positions(source, world, seqlen, zigzag)
            visible = k_pos[None, :] <= q_pos[:, None]
            block = fd._block(rank, source, seqlen, zigzag, causal=True)
            where = f"rank {rank}, source {source}"
            if block is None:
                assert not visible.any(), where
                continue
            inside = torch.zeros_like(visible)
            inside[block.rows, block.cols] = True
            assert not visible[~inside].any(), f"{where}: visible keys outside the block"
            part = visible[block.rows, block.cols]
            want = torch.ones_like(part).tril() if block.causal else torch.ones_like(part)
            assert torch.equal(part, want), f"{where}: mask {'causal' if block.causal else 'off'}"
            assert not block.causal or source == rank, f"{where}: a mask off the diagonal"
            full = fd._block(rank, source, seqlen, zigzag, causal=False)
            assert full == (slice(0, seqlen), slice(0, seqlen), False)


def test_block_schedule_balances_zigzag():
    """Zigzag gives every rank the same causal work (in query x key elements); contiguous not."""
    world, seqlen = 4, 8

    def work(rank: int, zigzag: bool) -> int:
        blocks = [fd._block(rank, s, seqlen, zigzag, causal=True) for s in range(world)]
        return sum(
            len(range(seqlen)[b.rows]) * len(range(seqlen)[b.cols]) for b in blocks if b is not None
        )

    assert len({work(r, True) for r in range(world)}) == 1
    assert len({work(r, False) for r in range(world)}) == world


def test_merge_equals_attention_over_both_key_sets():
    """Two partial results merged through their LSEs are the attention over both key sets."""
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (5, 9, 9))
    whole = reference.attention(q, k, v)
    first = reference.attention(q, k[:, :, :4], v[:, :, :4])
    second = reference.attention(q, k[:, :, 4:], v[:, :, 4:])
    out, lse = first.out.clone(), first.lse.clone()
    fd._merge(out, lse, second.out, second.lse)
    torch.testing.assert_close(out, whole.out)
    torch.testing.assert_close(lse, whole.lse)


def test_merge_rows_that_saw_no_key():
    """-inf on one side takes the other side exactly; on both sides stays 0 and -inf, no NaN."""
    inf = math.inf
    out = torch.tensor([[[[1.0, 2.0], [0.0, 0.0], [0.0, 0.0]]]])
    lse = torch.tensor([[[0.5, -inf, -inf]]])
    block_out = torch.tensor([[[[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]]]])
    block_lse = torch.tensor([[[-inf, 0.25, -inf]]])
    fd._merge(out, lse, block_out, block_lse)
    assert torch.equal(out, torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]]]]))
    assert torch.equal(lse, torch.tensor([[[0.5, 0.25, -inf]]]))


@pytest.fixture
def world_of_one(device):
    """A process group of this process alone (torch.distributed torn down afterwards)."""
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", fd.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_world_of_one_is_attention(world_of_one, device, causal, layout):
    """With one rank the ring is one block: out, lse and dq, dk, dv (through both) are
    ``flashcore.attention``'s bit for bit."""
    q = torch.randn(1, 4, 14, 16, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, 14, 16, device=device, requires_grad=True) for _ in range(2))
    dout, dlse = torch.randn_like(q), torch.randn(1, 4, 14, device=device)
    got = fd.ring_attention(q, k, v, causal=causal, layout=layout, return_lse=True)
    want = flashcore.attention(q, k, v, causal=causal, return_lse=True)
    for name, g, w in zip(("out", "lse"), got, want, strict=True):
        assert torch.equal(g, w), name
    got_grads = torch.autograd.grad(got, (q, k, v), (dout, dlse), retain_graph=True)
    want_grads = torch.autograd.grad(want, (q, k, v), (dout, dlse), retain_graph=True)
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads, strict=True):
        assert torch.equal(g, w), name
    # Only the LSE differentiated (out's gradient arrives as None).
    got_grads = torch.autograd.grad(got[1], (q, k, v), dlse)
    want_grads = torch.autograd.grad(want[1], (q, k, v), dlse)
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads, strict=True):
        assert torch.equal(g, w), f"{name} through the LSE alone"
    only_out = fd.ring_attention(q, k, v, causal=causal, layout=layout)
    assert torch.equal(only_out, want[0])


def test_world_of_one_second_derivative_raises(world_of_one, device):
    """A gradient of the ring taken with ``create_graph=True`` has its first-order values, and
    differentiating it raises instead of taking it as a constant (``ops.registry``'s
    ``first_order``)."""
    q = torch.randn(1, 2, 10, 16, device=device, requires_grad=True)
    k, v = (torch.randn(1, 2, 10, 16, device=device) for _ in range(2))
    out = fd.ring_attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    (want,) = torch.autograd.grad(fd.ring_attention(q, k, v, causal=True).sum(), q)
    assert torch.equal(dq.detach(), want)
    with pytest.raises(RuntimeError, match="attention backward is not differentiable"):
        (out.sum() + dq.pow(2).sum()).backward()


def test_world_of_one_autocast(world_of_one, device):
    """Under torch.autocast the ring takes its inputs as flashcore.attention does (fp32 q and k,
    bf16 v: all in bf16), the same result."""
    q, k = (torch.randn(1, 2, 10, 16, device=device) for _ in range(2))
    v = torch.randn(1, 2, 10, 16, device=device, dtype=torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        got = fd.ring_attention(q, k, v, causal=True)
        want = flashcore.attention(q, k, v, causal=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_world_of_one_jvp_refused(world_of_one, device):
    """Forward-mode AD through the ring raises (tests/test_transforms.py)."""
    q, k, v = (torch.randn(1, 2, 10, 16, device=device) for _ in range(3))
    with pytest.raises(NotImplementedError, match="ring_attention has no forward-mode"):
        torch.func.jvp(lambda q: fd.ring_attention(q, k, v), (q,), (torch.ones_like(q),))


def test_world_of_one_func_transforms_refused(world_of_one, device):
    """torch.func's grad and vmap through the ring raise an error that names them (PyTorch's
    own named the Function's missing setup_context)."""
    q, k, v = (torch.randn(1, 2, 10, 16, device=device) for _ in range(3))
    refused = pytest.raises(NotImplementedError, match=r"does not run under torch\.func")
    with refused:
        torch.func.grad(lambda q: fd.ring_attention(q, k, v).sum())(q)
    with refused:
        torch.func.vmap(lambda q: fd.ring_attention(q, k, v))(q[None])


def test_world_of_one_empty(world_of_one, device):
    """An empty batch gives empty results and zero gradients, without a launch."""
    q = torch.randn(0, 2, 4, 16, device=device, requires_grad=True)
    out, lse = fd.ring_attention(q, q, q, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (0, 2, 4)
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert grad.shape == q.shape


@pytest.fixture
def no_communication(monkeypatch):
    """Any collective or point-to-point call fails: the errors must come before them."""

    def refuse(*args, **kwargs):
        raise AssertionError("communicated before raising")

    for name in ("all_gather", "batch_isend_irecv", "isend", "irecv"):
        monkeypatch.setattr(dist, name, refuse)


def qkv(seqlen: int = 8, device: str = "cpu"):
    return (torch.randn(1, 2, seqlen, 16, device=device) for _ in range(3))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"layout": "ring"}, ValueError, r"layout must be one of \('contiguous', 'zigzag'\)"),
        ({"layout": None}, TypeError, "layout must be a str"),
        ({"group": 0}, TypeError, "group must be a torch.distributed.ProcessGroup"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"scale": float("nan")}, ValueError, "scale must be finite"),
        ({"return_lse": "yes"}, TypeError, "return_lse must be a bool"),
    ],
    ids=["layout", "layout_type", "group_type", "causal_type", "scale", "return_lse_type"],
)
def test_option_errors(world_of_one, no_communication, device, change, error, match):
    with pytest.raises(error, match=match):
        fd.ring_attention(*qkv(device=device), **change)


def test_zigzag_needs_an_even_shard(world_of_one, no_communication, device):
    with pytest.raises(ValueError, match=r"zigzag.*even shard length.*q.shape\[2\] = 7"):
        fd.ring_attention(*qkv(7, device), layout="zigzag")


def test_kv_shard_unlike_q(world_of_one, no_communication, device):
    q, _, _ = qkv(8, device)
    _, k, v = qkv(6, device)
    with pytest.raises(ValueError, match=r"k/v shard length \(k.shape\[2\]\) must equal q's"):
        fd.ring_attention(q, k, v)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dims"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "k must be float16, bfloat16 or float32"),
        (lambda q, k, v: (q, k, v[:, :1]), ValueError, "k and v must have the same shape"),
        (lambda q, k, v: (q[:, :1], k, v), ValueError, r"q's heads \(1\) must be a multiple"),
        (lambda q, k, v: (q, k, "v"), TypeError, "v must be a torch.Tensor"),
    ],
    ids=["rank", "dtype", "kv_shapes", "heads", "not_tensor"],
)
def test_input_errors(world_of_one, no_communication, device, args, error, match):
    with pytest.raises(error, match=match):
        fd.ring_attention(*args(*qkv(device=device)))


def test_shard_errors(world_of_one, device):
    x = torch.randn(1, 2, 9, 4, device=device)
    with pytest.raises(
        ValueError, match=r"x.shape\[2\] \(the sequence, 9\) must be a multiple of 2"
    ):
        fd.shard(x, "zigzag")
    with pytest.raises(ValueError, match="dim must be in"):
        fd.shard(x, dim=4)
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        fd.shard([1, 2], dim=0)
    with pytest.raises(ValueError, match="layout must be one of"):
        fd.unshard(x, "stripes")
    with pytest.raises(ValueError, match=r"zigzag.*even shard length.*x.shape\[2\] = 9"):
        fd.unshard(x, "zigzag")


def test_not_initialised(device):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"group: torch\.distributed is not initialised"):
        fd.ring_attention(*qkv(device=device))
    for function in (fd.shard, fd.unshard):
        with pytest.raises(RuntimeError, match=r"torch\.distributed is not initialised"):
            function(torch.zeros(1, 1, 4, 1))


def test_inputs_are_checked_before_the_group(device):
    """Bad inputs name the input even without a process group."""
    assert not dist.is_initialized()
    q, k, v = qkv(device=device)
    with pytest.raises(ValueError, match="q must have 4 dims"):
        fd.ring_attention(q[0], k, v)
