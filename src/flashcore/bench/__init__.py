"""``flashcore-bench``: the benchmark CLI (``python -m flashcore.bench``).

Modules: ``cases`` (presets, ``--shape``), ``providers`` (flashcore, SDPA backends, FlexAttention),
``check`` (reference and error rule), ``metrics`` (FLOPs, timing, matmul ceiling), ``runner`` (one
measurement), ``report`` (table, JSONL, plot), ``resources`` (compiled-kernel resources), ``cli``.
Importing this package does not import triton (Triton's interpreter switch must come first).
"""
