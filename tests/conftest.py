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
