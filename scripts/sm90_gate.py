"""Open the sm90 tier's Triton gate in this process: the way to verify the tier on a Triton it is
not yet enabled on (``ops/runtime.py: SM90_TRITON``), on a GPU, before adding that version there.

As a pytest plugin (``scripts`` on PYTHONPATH): ``python -m pytest -p sm90_gate ...`` (xdist's
workers take the same ``-p``); in a script: ``import sm90_gate; sm90_gate.open_gate()`` before
the first call. Never for users: a Triton the tier was not verified on may miscompile it.

With ``DIRECT_GATE=1`` in the environment it opens the direct launches' gate too
(``ops/launch.py: DIRECT_TRITON``, both tiers' launches): how a Triton whose native launcher
was only read and CPU-tested is run on a GPU before it is added there (how 3.7 was).
"""

from __future__ import annotations

import os


def open_gate() -> str:
    """Add this Triton's ``major.minor.`` to the verified versions (and, with ``DIRECT_GATE=1``,
    to the direct launches' versions); returns it."""
    import triton

    from flashcore.ops import launch, runtime

    prefix = ".".join(triton.__version__.split(".")[:2]) + "."
    if not triton.__version__.startswith(runtime.SM90_TRITON):
        runtime.SM90_TRITON = (*runtime.SM90_TRITON, prefix)
    runtime.sm90_verified.cache_clear()
    direct = os.environ.get("DIRECT_GATE") == "1"
    if direct and not triton.__version__.startswith(launch.DIRECT_TRITON):
        launch.DIRECT_TRITON = (*launch.DIRECT_TRITON, prefix)
    return prefix + (" and direct launches" if direct else "")


def pytest_configure(config) -> None:
    open_gate()
