"""Test setup: interpreter switch, seeds, device, markers.

Without CUDA the kernels run through Triton's interpreter; the flag must be set before the first
flashcore kernel is defined, which happens at the first attention call, so setting it here is early
enough.
"""

import os

import pytest
import torch

# Inductor's on-disk graph caches key on the traced code, not on a custom op's schema: after the
# flashcore:: schema changed, a cached backward graph called the op with the old argument order.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def exact_fp32_dot(monkeypatch):
    """Round each fp32 ``tl.dot`` of the interpreter once, from a float64 accumulation.

    Triton 3.6's interpreter runs ``tl.dot`` as ``np.matmul`` in the accumulator dtype, so an fp32
    product is rounded the way the host BLAS happens to order its sums, which changes with the
    operands' shapes and transposition. A kernel that recomputes ``Q @ K^T`` in another orientation
    (the backward's dK/dV kernel computes ``K @ Q^T``) then sees scores rounded differently from
    the forward's, an error no GPU dot has (each output element accumulates in the same order
    whatever the tile shape), and fp32 gradients land near 2x PyTorch's error. Rounding once
    makes the fp32 interpreter runs measure the kernels' own arithmetic. fp16/bf16 are untouched;
    no-op on a GPU.
    """
    if HAS_CUDA:
        return
    import numpy as np
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def exact_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        exact = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)) + d.data
        return interpreter.TensorHandle(exact.astype(d.data.dtype), d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", exact_create_dot)
