"""A/B of the Hopper forward's configs on windowed problems, in one process on the GPU machine:

    PYTHONPATH=src:scripts python scripts/fwd_window_config_ab.py --window 127,0 \
        [--configs one,one3,two-n64] [--rounds 3] [--cases 128:4096:1,64:16384:1]

Each case (``D:S:causal[:Dv[:B[:H]]]``, bf16, by default 16k tokens of 2048 / D heads, as
``fwd_module_ab.py``'s) runs through ``flashcore.attention`` under ``use_tier("sm90")`` with the
launcher's own config ("auto") against each named config that its head dim can take
(``pick_config`` replaced, the kept plans dropped at each switch): "one" (one consumer a CTA,
``ONE``), "one3" (D = 64, three CTAs an SM, ``ONE_D64_THREE_CTAS``), "two" (``CONFIGS``, the
launcher's choice of grid), "two-n64" (two consumers on 64-key tiles, four slots). Prints
TFLOP/s of the visible pairs, the ratio (auto / config time: > 1, the config is faster) and
whether the outputs are bit for bit equal (other tiles round differently).
"""

from __future__ import annotations

import argparse
import sys

from fwd_module_ab import ab, case_options, run_cases

from flashcore.ops import fwd, fwd_sm90_configs

NAMED = {
    "one": fwd_sm90_configs.ONE,
    "one3": {64: fwd_sm90_configs.ONE_D64_THREE_CTAS},
    "two": fwd_sm90_configs.CONFIGS,
    "two-n64": {d: fwd_sm90_configs.Sm90Config(2, 64, 4, 240, 168) for d in (64, 128)},
}
CASES = "128:4096:1,128:16384:1,64:4096:1,64:16384:1"


def compare(case: str, name: str, rounds: int, window) -> str | None:
    config = NAMED[name].get(int(case.split(":")[0]))
    if config is None:
        return None
    chosen = fwd_sm90_configs.pick_config

    def select(side: str) -> None:
        fwd_sm90_configs.pick_config = chosen if side == "auto" else (lambda *a, **kw: config)
        fwd.forget()

    try:
        return f"{name} " + ab(case, "auto", name, select, rounds, f"auto/{name}", window)
    finally:
        fwd_sm90_configs.pick_config = chosen
        fwd.forget()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    case_options(parser, 3, CASES)
    parser.add_argument("--configs", default="one,one3", help=f"of {', '.join(NAMED)}")
    args = parser.parse_args()
    names = args.configs.split(",")
    for name in names:
        if name not in NAMED:
            parser.error(f"configs: {name!r} is not one of {', '.join(NAMED)}")

    def lines(case: str) -> str:
        rows = (compare(case, name, args.rounds, args.window) for name in names)
        return "\n".join(row for row in rows if row) or f"{case}: no named config takes it"

    run_cases(args.cases, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
