"""A/B of one boolean switch of the Hopper forward (``ops/fwd_sm90_configs.py`` or
``ops/fwd_sm90.py``, whichever defines it), in one process on the GPU machine:

    PYTHONPATH=src python scripts/fwd_switch_ab.py DYNAMIC_DEAL [--rounds 5] \
        [--cases 192:4096:1:128:2,128:2048:1]
    PYTHONPATH=src python scripts/fwd_switch_ab.py PERSISTENT_MAX_KEY_TILES --values 16,32 \
        --cases 128:4096:0:128:4:16

An integer attribute takes ``--values OFF,ON``: the two values set as the sides "off" and "on".

Both sides run the same kernel module through ``flashcore.attention`` under ``use_tier("sm90")``;
the switch (a module attribute read when a plan is built) is set off or on and the plans and kept
launches are dropped (``ops.fwd.forget``). A case is ``D:S:causal[:Dv[:B[:H]]]``, bf16, by
default 16k tokens of 2048 / D heads (16 heads past 128), as ``fwd_module_ab.py``'s (``ab``). Prints
TFLOP/s of each side (``do_bench`` medians of rotated rounds), the ratio (off / on time: > 1,
the switch on is faster) with the range of the per-round ratios, and whether the outputs are bit
for bit equal.
"""

from __future__ import annotations

import argparse
import sys

from fwd_module_ab import ab, case_options, run_cases

from flashcore.ops import fwd, fwd_sm90, fwd_sm90_configs

CASES = "192:4096:1:128:2,192:8192:1:128:1,192:2048:1:128:4,128:1024:1,128:2048:1,128:4096:1"


def owner(switch: str):
    """The module that defines ``switch`` (the configs' rules read theirs, the launcher its own)."""
    return fwd_sm90_configs if hasattr(fwd_sm90_configs, switch) else fwd_sm90


def compare(switch: str, case: str, rounds: int, window=None, values=(False, True)) -> str:
    def select(side: str) -> None:
        setattr(owner(switch), switch, values[side == "on"])
        fwd.forget()

    return ab(case, "off", "on", select, rounds, "off/on", window)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "switch",
        help="a boolean (or, with --values, integer) of ops/fwd_sm90_configs.py or ops/fwd_sm90.py",
    )
    parser.add_argument("--values", metavar="OFF,ON", help="an integer switch's two values")
    case_options(parser, 5, CASES)
    args = parser.parse_args()
    default = getattr(owner(args.switch), args.switch, None)
    if args.values is None:
        if not isinstance(default, bool):
            parser.error(f"switch: no boolean {args.switch!r} in the forward's modules")
        values = (False, True)
    else:
        if isinstance(default, bool) or not isinstance(default, int):
            parser.error(f"switch: no integer {args.switch!r} in the forward's modules")
        try:
            values = tuple(int(x) for x in args.values.split(","))
        except ValueError:
            values = ()
        if len(values) != 2:
            parser.error(f"--values: two integers OFF,ON, not {args.values!r}")
    run_cases(args.cases, lambda case: compare(args.switch, case, args.rounds, args.window, values))
    setattr(owner(args.switch), args.switch, default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
