"""Which Hopper-tier compile variants a change leaves bit for bit the same, on the CPU.

    python scripts/sass_compare.py BASE_REV [--suite fwd,bwd,bwd256]

For each variant of ``tests/test_compile_hopper.py`` (fwd), ``tests/test_compile_hopper_bwd.py``
(bwd) and ``tests/test_compile_hopper_bwd256.py`` (bwd256: head dim 256's and MLA's backward),
compiles the Gluon kernel for sm_90a twice, with the working tree and with the tree of git
revision ``BASE_REV`` (each side with its own test file, so each variant is built as that side's
launcher builds it), and prints whether the two SASS listings are identical. A change meant to
touch some builds only (a new constexpr path, a refactor) should leave every other variant
identical: a variant that differs where nothing should have changed is a bug to find before any
GPU time. Needs Triton with Gluon (the wheel's ptxas and cuobjdump); no GPU.

``--ignore-params``: compare the listings with the kernel parameters' constant-bank offsets
(``c[0x0][0x...]``) and the instructions' encodings blanked, for a change that adds kernel
arguments: the same instructions reading their parameters from shifted offsets count as
identical.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITES = {
    "fwd": "test_compile_hopper",
    "bwd": "test_compile_hopper_bwd",
    "bwd256": "test_compile_hopper_bwd256",
}

# Run in a subprocess with one side's src and tests on the path: writes each variant's SASS.
DUMP = """
import sys
from pathlib import Path
name, out = sys.argv[1], Path(sys.argv[2])
mod = __import__(name)
real = mod.assemble
sass = {}
def spy(src, maxnreg):
    ptx, listing, report = real(src, maxnreg)
    sass["last"] = listing
    return ptx, listing, report
mod.assemble = spy
for variant in mod.VARIANTS:
    mod.compile_variant(variant)
    (out / (variant[0] + ".sass")).write_text(sass["last"])
"""


def dump(tree: Path, suite: str, out: Path) -> None:
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{tree / 'src'}{os.pathsep}{tree / 'tests'}"
    subprocess.run(
        [sys.executable, "-c", DUMP, SUITES[suite], str(out)], env=env, cwd=tree, check=True
    )


def without_params(sass: str) -> str:
    """``sass`` with parameter offsets and instruction encodings blanked (``--ignore-params``)."""
    sass = re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][param]", sass)
    return re.sub(r"/\* 0x[0-9a-f]{16} \*/", "", sass)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="git revision to compare the working tree with")
    parser.add_argument("--suite", default="fwd,bwd")
    parser.add_argument("--ignore-params", action="store_true")
    args = parser.parse_args()
    norm = without_params if args.ignore_params else (lambda text: text)
    differ = 0
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(
            ["git", "archive", args.base, "src", "tests"], cwd=ROOT, check=True,
            capture_output=True,
        ).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        for suite in args.suite.split(","):
            dump(ROOT, suite, Path(tmp) / suite / "tree")
            dump(base, suite, Path(tmp) / suite / "base")
            for path in sorted((Path(tmp) / suite / "tree").iterdir()):
                other = Path(tmp) / suite / "base" / path.name
                if not other.exists():
                    print(f"{suite} {path.stem}: new (no such variant at {args.base})")
                elif norm(other.read_text()) == norm(path.read_text()):
                    print(f"{suite} {path.stem}: identical")
                else:
                    differ += 1
                    print(f"{suite} {path.stem}: differs")
    print(f"{differ} variant(s) differ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
