"""The compile log and ``flashcore.warmup``.

Under the interpreter nothing compiles: the CPU tests drive the logging launcher with a stand-in
for a compiled ``@triton.jit`` function and run ``warmup``'s calls through the interpreter; the
gpu test compiles for real.
"""

from __future__ import annotations

import logging

import pytest
import torch

import flashcore
from flashcore.ops import launch, runtime
from helpers import record_backward_tiers, record_sm90_forwards, require_sm90

LOGGER = "flashcore.ops.runtime"


class FakeCompiled:
    """Stands in for a Triton ``CompiledKernel``: ``kernel[grid](*args)``."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid):
        def launch(*args):
            self.launches += 1

        return launch


class FakeJit:
    """Stands in for a compiled-mode ``JITFunction``: one kernel per specialisation, which here
    is the constexprs and whether the scalar ``n`` is divisible by 16 (as Triton's)."""

    __name__ = "fake_kernel"

    def __init__(self) -> None:
        self.arg_names = ["X", "n", "BLOCK", "FLAG"]
        self.device_caches: dict = {}  # compiled-mode functions have it, interpreted ones not
        self.kernels: dict[tuple, FakeCompiled] = {}

    def __getitem__(self, grid):
        def run(x, n, **meta):
            key = (n % 16 == 0, tuple(meta.items()))
            return self.kernels.setdefault(key, FakeCompiled())

        return run


@pytest.fixture
def launcher(monkeypatch):
    # The launch cache keys on the current CUDA device; the CPU has none to ask.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return runtime.LoggingLauncher(FakeJit(), num_pointers=1)


def test_first_launch_of_a_variant_is_logged_once(launcher, caplog):
    x = torch.zeros(4)
    meta = {"BLOCK": 64, "FLAG": True, "num_warps": 4}
    events = len(runtime.compile_events())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        launcher((1,), (x, 32), meta)  # compiles
        launcher((1,), (x, 32), meta)  # the launch cache's hit
        launcher((1,), (x, 48), meta)  # a miss, but the same specialisation (48 % 16 == 0)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1
    message = records[0].getMessage()
    assert records[0].levelno == logging.INFO
    assert message.startswith("compiled fake_kernel for cuda:0 in ")
    assert message.endswith("(BLOCK=64 FLAG num_warps=4)")
    new = runtime.compile_events()[events:]
    assert [(e.kernel, e.device, e.variant) for e in new] == [
        ("fake_kernel", "cuda:0", "BLOCK=64 FLAG num_warps=4")
    ]
    assert new[0].seconds >= 0


def test_each_new_specialisation_is_logged(launcher, caplog):
    x = torch.zeros(4)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        launcher((1,), (x, 32), {"BLOCK": 64, "FLAG": False, "num_warps": 4})
        launcher((1,), (x, 33), {"BLOCK": 64, "FLAG": False, "num_warps": 4})  # not % 16
        launcher((1,), (x, 32), {"BLOCK": 128, "FLAG": False, "num_warps": 8})
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 3
    # Flags that are off are left out of the description.
    assert messages[0].endswith("(BLOCK=64 num_warps=4)")
    assert messages[2].endswith("(BLOCK=128 num_warps=8)")


def test_nothing_is_logged_at_the_default_level(launcher, caplog):
    # The log is INFO: a process that configured no logging sees nothing.
    with caplog.at_level(logging.WARNING):
        launcher((1,), (torch.zeros(4), 32), {"BLOCK": 32, "FLAG": True, "num_warps": 4})
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_interpreter_compiles_and_logs_nothing(device, caplog):
    if device != "cpu":
        pytest.skip("the interpreter runs on the CPU")
    q = torch.randn(1, 2, 17, 16)
    events = len(runtime.compile_events())
    with caplog.at_level(logging.INFO, logger="flashcore"):
        flashcore.attention(q, q, q, causal=True)
    assert len(runtime.compile_events()) == events
    assert not [r for r in caplog.records if r.name == LOGGER]


@pytest.mark.parametrize(
    "options",
    [
        dict(backward=True),
        dict(varlen=True, backward=True, batch_sizes=(2,)),
        dict(decode=True, causal=(True, False)),
        dict(decode=True, block_size=16, window=(8, 0), softcap=20.0, alibi=True),
        dict(backward=True, decode=True, graphs=True),
        dict(varlen=True, block_size=16, batch_sizes=(2,), causal=(True, False)),
    ],
    ids=["dense-bwd", "varlen-bwd", "decode", "paged-masks", "graphs", "paged-prefill"],
)
def test_warmup_runs_its_calls(device, options):
    if device != "cpu":
        pytest.skip("the interpreter runs on the CPU (the gpu test compiles)")
    sizes = dict(dtypes=(torch.float16,), head_dims=(16,), heads=(2, 1), seqlens=(17,))
    assert flashcore.warmup("cpu", **sizes, **options) == []


def test_warmup_paged_prefill(device, monkeypatch):
    """``varlen=True`` with a ``block_size``: the packed call, then the same queries against a
    paged cache of the same lengths (forward only, whatever ``backward`` says)."""
    if device != "cpu":
        pytest.skip("the interpreter runs on the CPU (the gpu test compiles)")
    calls = []
    real = flashcore.api.attention_varlen

    def spy(q, k, v, *args, **kwargs):
        calls.append((k.dim(), kwargs.get("block_table") is not None, q.requires_grad))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(flashcore.api, "attention_varlen", spy)
    sizes = dict(dtypes=(torch.float16,), head_dims=(16,), heads=(2, 1), seqlens=(40,))
    flashcore.warmup("cpu", **sizes, varlen=True, backward=True, block_size=16)
    assert calls == [(3, False, True), (4, True, False)]


def test_warmup_graphs_runs_each_call_again_as_captured(device, monkeypatch):
    """``graphs=True``: every combination runs once as an eager call chooses and once more as a
    capture would (``runtime.as_captured``), with the autograd engine on the calling thread so
    that the backward sees it too."""
    if device != "cpu":
        pytest.skip("the interpreter runs on the CPU (the gpu test compiles)")
    seen = []
    real = runtime.capturing

    def capturing(t):
        seen.append((runtime._as_captured.get(), torch.autograd.is_multithreading_enabled()))
        return real(t)

    monkeypatch.setattr(runtime, "capturing", capturing)
    sizes = dict(dtypes=(torch.float16,), head_dims=(16,), heads=(2, 1), seqlens=(17, 33))
    assert flashcore.warmup("cpu", **sizes, backward=True, graphs=True) == []
    # The forward asks at ops.express's check and in the launcher at the first call of each of
    # the two lengths, at the check alone when it repeats (host tensors are never captured, so
    # the second pass repeats the first's launches); the portable backward does not ask.
    assert seen == [(False, True)] * 4 + [(True, False)] * 2
    assert not runtime._as_captured.get() and torch.autograd.is_multithreading_enabled()


def test_as_captured_is_scoped():
    class OnGpu:  # what capturing() reads of a tensor
        is_cuda = True

    with runtime.as_captured():
        assert runtime.capturing(OnGpu())
        assert not runtime.capturing(torch.zeros(1))  # host tensors never
        assert not torch._C._is_multithreading_enabled()  # backwards on this thread
    assert not runtime._as_captured.get()
    assert torch._C._is_multithreading_enabled()


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(seqlens=()), "seqlens must be positive ints"),
        (dict(seqlens=(0,)), "seqlens must be positive ints"),
        (dict(batch_sizes=(2.0,)), "batch_sizes must be positive ints"),
        (dict(decode=True, block_size=24), "block_size must be a positive multiple of 16"),
    ],
)
def test_warmup_rejects_bad_sizes(options, match):
    with pytest.raises(ValueError, match=match):
        flashcore.warmup("cpu", **options)


def test_warmup_without_cuda(monkeypatch):
    """The default device with no CUDA device visible: a clear error, not torch's assertion."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        flashcore.warmup()


def test_warmup_raises_what_the_functions_raise(device):
    # heads (3, 2): 3 query heads cannot share 2 kv heads; attention names the problem.
    with pytest.raises(ValueError, match="head"):
        flashcore.warmup(device, heads=(3, 2), head_dims=(16,), seqlens=(17,))


@pytest.mark.gpu
def test_warmup_compiles_what_later_calls_launch(caplog):
    # An odd head dim and length that no other test uses, so the variants are new here.
    options = dict(
        dtypes=(torch.float16,), head_dims=(40,), heads=(4, 2), seqlens=(200,), backward=True,
        decode=True,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="flashcore"):
        events = flashcore.warmup("cuda", **options)
    kernels = {e.kernel for e in events}
    assert {"attn_fwd_kernel", "attn_bwd_dq_kernel", "attn_bwd_dkdv_kernel"} <= kernels
    assert "attn_decode_kernel" in kernels
    assert all(e.device.startswith("cuda:") and e.seconds > 0 for e in events)
    logged = [r for r in caplog.records if r.name == LOGGER]
    assert len(logged) == len(events)
    # Warm: the same calls compile nothing, in warmup or outside it.
    assert flashcore.warmup("cuda", **options) == []
    before = len(runtime.compile_events())
    q = torch.randn(1, 4, 200, 40, device="cuda", dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn_like(q[:, :2]).requires_grad_() for _ in "kv")
    flashcore.attention(q, k, v, causal=True).sum().backward()
    torch.cuda.synchronize()
    assert len(runtime.compile_events()) == before


@pytest.mark.gpu
def test_warmup_graphs_loads_what_a_capture_takes(monkeypatch):
    # (2, 8, 2048, 64) causal: under the eager FLOP floors, so an eager call runs the portable
    # kernels and a capture the Gluon ones. After warmup(graphs=True) capturing the call (forward
    # and backward) misses no launch cache: nothing is compiled or loaded inside the capture.
    require_sm90()
    shape = dict(dtypes=(torch.bfloat16,), head_dims=(64,), heads=(8, 8), seqlens=(2048,))
    flashcore.warmup("cuda", **shape, batch_sizes=(2,), backward=True, graphs=True)
    misses = []
    real = launch.Launcher.miss
    monkeypatch.setattr(
        launch.Launcher, "miss", lambda self, *a: misses.append(self.fn) or real(self, *a)
    )
    tiers = record_backward_tiers(monkeypatch)
    forwards = record_sm90_forwards(monkeypatch)
    q, k, v = (
        torch.randn(2, 8, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dout = torch.randn_like(q)

    def call():
        out = flashcore.attention(q, k, v, causal=True)
        return torch.autograd.grad(out, (q, k, v), dout)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # the usual warm-up: eager, so the portable kernels
    torch.cuda.current_stream().wait_stream(stream)
    assert tiers == ["portable"] and not forwards
    misses.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    assert tiers[-1] == "sm90" and forwards, "the capture did not take the Gluon kernels"
    assert misses == [], f"launched for the first time inside the capture: {misses}"
