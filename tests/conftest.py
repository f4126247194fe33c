"""Test setup: interpreter switch, seeds, device, markers, and a failure log.

Without CUDA the kernels run through Triton's interpreter; the flag must be set before the first
flashcore kernel is defined, which happens at the first attention call, so setting it here is early
enough.

``FLASHCORE_FAILURE_LOG=path``: each failing test's report is appended to ``path`` when it fails
(with the xdist worker's name), not only in pytest's summary at the end, so that a GPU run cut
off by a timeout still shows the first failure and its chained causes.
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


@pytest.fixture(autouse=True)
def _no_kept_launches():
    """Each test starts without the launches ``ops.express`` and ``ops.bwd`` ("Quick
    backwards") kept for earlier tests' calls: a test that monkeypatches the runtime
    (capability, tiers, capture) plans its own calls."""
    from flashcore.ops import bwd, decode, fwd

    fwd._LEARNED.clear()
    decode._LEARNED.clear()
    bwd._QUICK.clear()


@pytest.fixture
def fresh_sdpa_warnings():
    """The SDPA drop-in warns once per fallback reason and process: a test that expects its
    warning starts (and leaves) with none given, whatever ran before it on the worker."""
    from flashcore import api

    api._sdpa_warned.clear()
    yield
    api._sdpa_warned.clear()


def pytest_runtest_logreport(report):
    path = os.environ.get("FLASHCORE_FAILURE_LOG")
    # Under xdist the workers write; the controller (no worker name) sees the same reports.
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not path or not report.failed or (worker is None and hasattr(report, "node")):
        return
    with open(path, "a") as log:
        log.write(f"=== {report.nodeid} ({report.when}) on {worker or 'main'}\n")
        log.write(f"{report.longreprtext}\n")
