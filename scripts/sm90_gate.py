"""Open the sm90 tier's Triton gate in this process: the way to verify the tier on a Triton it is
not yet enabled on (``ops/runtime.py: SM90_TRITON``), on a GPU, before adding that version there.

As a pytest plugin (``scripts`` on PYTHONPATH): ``python -m pytest -p sm90_gate ...`` (xdist's
workers take the same ``-p``); in a script: ``import sm90_gate; sm90_gate.open_gate()`` before
the first call. Never for users: a Triton the tier was not verified on may miscompile it.
"""

from __future__ import annotations


def open_gate() -> str:
    """Add this Triton's ``major.minor.`` to the verified versions; returns it."""
    import triton

    from flashcore.ops import runtime

    prefix = ".".join(triton.__version__.split(".")[:2]) + "."
    if not triton.__version__.startswith(runtime.SM90_TRITON):
        runtime.SM90_TRITON = (*runtime.SM90_TRITON, prefix)
    runtime.sm90_verified.cache_clear()
    return prefix


def pytest_configure(config) -> None:
    open_gate()
