"""Sort a compute-sanitizer racecheck log: the partition state, mbarrier hand-overs, all others.

Triton's lowering of ``gl.warp_specialize`` keeps each worker warp's partition number in a few
bytes of shared memory: the default warps store them and pass named barrier 1 (every thread of the
CTA), and each worker warp passes barrier 1 and loads its byte, in code that the line table puts on
the kernel's ``def`` line (the load) and on lines of the kernel's own body (the stores). The
barrier orders the accesses, yet racecheck (compute-sanitizer 2025.3.1) reports them as RAW hazards
whenever the default partition also runs a barrier of its own 128 threads (``bar.sync N, 128``,
whatever N): ``scripts/ws_racecheck_probe.py`` shows it on kernels of a few lines
(docs/maintainers.md, the sanitizer section). Every Hopper kernel here has such barriers.

A report is counted as on the partition state when it is a RAW hazard whose read is by a worker
thread (128 and up: the default partition is four warps) at the ``def`` line of a kernel that
calls ``gl.warp_specialize`` and whose write is by a default thread (below 128) at a line of that
kernel's own body.

From the same barrier on, racecheck also reports data that one partition hands another through
shared memory ordered by mbarriers alone (a plain store, the writer's arrive, the reader's wait,
its load; and back for the buffer's next use): ``ws_racecheck_probe.py handoff``. The kernels mark
each such store and load with a comment line ``# racecheck hand-over: NAME`` right above it. A
report is counted as a hand-over when it is RAW or WAR, its write and its read are both at lines
marked with the same NAME, in one kernel, by threads of different warpgroups. What orders them
(the mbarrier protocol) is what synccheck and the GPU tests exercise; racecheck cannot judge it.
Everything else is reported as a hazard to look at.

    compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 0 CMD > racecheck.log
    python scripts/racecheck_triage.py racecheck.log

Exit status 0 when every report is on the partition state or a hand-over and every report was
displayed (``--print-limit 0``), 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (
    *sorted((ROOT / "src" / "flashcore" / "kernels" / "hopper").glob("*.py")),
    ROOT / "scripts" / "ws_racecheck_probe.py",
)
DEFAULT_THREADS = 128  # the default partition: four warps (num_warps=4 at every Gluon launch)

_HEAD = re.compile(
    r"(Error|Warning): Potential (RAW|WAR|WAW) hazard detected at __shared__ (0x[0-9a-f]+) "
    r"in block \((\d+),(\d+),(\d+)\)"
)
_ACCESS = re.compile(
    r"(Write|Read) Thread \((\d+),(\d+),(\d+)\) at (\w+)\+0x[0-9a-f]+ in (\S+):(\d+)"
)
_SUMMARY = re.compile(
    r"RACECHECK SUMMARY: (\d+) hazards displayed \((\d+) errors, (\d+) warnings\)"
)
_TAG = re.compile(r"^\s*#\s*racecheck hand-over:\s*(.+?)\s*$")


class Access(NamedTuple):
    kind: str  # Write or Read
    thread: int
    kernel: str
    file: str
    line: int


class Hazard(NamedTuple):
    kind: str  # RAW, WAR or WAW
    address: int
    accesses: tuple[Access, ...]


def ws_kernels(sources=SOURCES) -> dict[str, tuple[str, int, int]]:
    """Kernels that call ``gl.warp_specialize``: name -> (file name, def line, last line)."""
    kernels = {}
    for path in sources:
        tree = ast.parse(Path(path).read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "warp_specialize"
                for call in ast.walk(node)
            ):
                kernels[node.name] = (Path(path).name, node.lineno, node.end_lineno)
    return kernels


def hand_over_lines(sources=SOURCES) -> dict[tuple[str, int], str]:
    """Lines marked as a store or load of a hand-over: (file name, line) -> NAME, the line being
    the first code line under a ``# racecheck hand-over: NAME`` comment line."""
    tags = {}
    for path in sources:
        lines = Path(path).read_text().splitlines()
        for i, text in enumerate(lines):
            tag = _TAG.match(text)
            if tag is None:
                continue
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or lines[j].lstrip().startswith("#")):
                j += 1
            tags[(Path(path).name, j + 1)] = tag.group(1)
    return tags


def parse(log: str) -> tuple[list[Hazard], tuple[int, int, int] | None]:
    """The hazard reports of a racecheck log (``--racecheck-report hazard``) and its summary
    (hazards displayed, errors, warnings), None where the log has none."""
    hazards, current = [], None
    for line in log.splitlines():
        head = _HEAD.search(line)
        if head:
            current = (head.group(2), int(head.group(3), 16), [])
            hazards.append(current)
            continue
        access = _ACCESS.search(line)
        if access and current is not None:
            kind, x, _, _, kernel, file, lineno = access.groups()
            current[2].append(Access(kind, int(x), kernel, Path(file).name, int(lineno)))
    summary = _SUMMARY.findall(log)
    return (
        [Hazard(kind, address, tuple(acc)) for kind, address, acc in hazards],
        tuple(int(n) for n in summary[-1]) if summary else None,
    )


def read_write(hazard: Hazard, kinds: tuple[str, ...]) -> tuple[Access, Access] | None:
    """``(read, write)`` of a hazard of one of ``kinds`` made of one read and one write of one
    kernel, else None."""
    if hazard.kind not in kinds or sorted(a.kind for a in hazard.accesses) != ["Read", "Write"]:
        return None
    read = next(a for a in hazard.accesses if a.kind == "Read")
    write = next(a for a in hazard.accesses if a.kind == "Write")
    return (read, write) if read.kernel == write.kernel else None


def on_partition_state(hazard: Hazard, kernels: dict[str, tuple[str, int, int]]) -> bool:
    """Whether ``hazard`` is the report racecheck makes on the warp-specialize handshake."""
    pair = read_write(hazard, ("RAW",))
    if pair is None or pair[0].kernel not in kernels:
        return False
    read, write = pair
    file, first, last = kernels[read.kernel]
    return (
        read.file == file == write.file
        and read.line == first
        and first <= write.line <= last
        and read.thread >= DEFAULT_THREADS > write.thread
    )


def hand_over(hazard: Hazard, tags: dict[tuple[str, int], str]) -> str | None:
    """The NAME of the hand-over ``hazard`` is on (module docstring), or None."""
    pair = read_write(hazard, ("RAW", "WAR"))
    if pair is None:
        return None
    read, write = pair
    name = tags.get((write.file, write.line))
    if (
        name is None
        or tags.get((read.file, read.line)) != name
        or read.thread // DEFAULT_THREADS == write.thread // DEFAULT_THREADS
    ):
        return None
    return name


def ranges(addresses: list[int]) -> str:
    """Sorted byte addresses as runs of consecutive bytes: ``0x10-0x13, 0x20``."""
    runs = []
    for address in addresses:
        if runs and address == runs[-1][1] + 1:
            runs[-1][1] = address
        else:
            runs.append([address, address])
    return ", ".join(f"0x{a:x}" if a == b else f"0x{a:x}-0x{b:x}" for a, b in runs)


def triage(log: str, kernels=None, tags=None) -> tuple[bool, str]:
    """``(clean, one-line summary)`` of a racecheck log."""
    kernels = ws_kernels() if kernels is None else kernels
    tags = hand_over_lines() if tags is None else tags
    hazards, summary = parse(log)
    if summary is None:
        return False, "no RACECHECK SUMMARY line: the run did not finish"
    displayed, errors, warnings = summary
    state, handed, other = [], {}, []
    for h in hazards:
        if on_partition_state(h, kernels):
            state.append(h)
        elif (name := hand_over(h, tags)) is not None:
            key = (h.accesses[0].kernel, name)
            handed[key] = handed.get(key, 0) + 1
        else:
            other.append(h)
    where = "; ".join(
        f"{kernel} {ranges(sorted({h.address for h in state if h.accesses[0].kernel == kernel}))}"
        for kernel in sorted({h.accesses[0].kernel for h in state})
    )
    which = "; ".join(f"{kernel} {name}: {n}" for (kernel, name), n in sorted(handed.items()))
    line = (
        f"{len(hazards)} reports read ({displayed} displayed, {errors} errors, {warnings} "
        f"warnings): {len(state)} on the partition state ({where or 'none'}), "
        f"{sum(handed.values())} on mbarrier hand-overs ({which or 'none'}), {len(other)} other"
    )
    complete = len(hazards) == displayed == errors + warnings
    if not complete:
        line += "; not every report was read (run with --racecheck-report hazard --print-limit 0)"
    for h in other[:5]:
        line += f"\n  other: {h.kind} at 0x{h.address:x}: " + "; ".join(
            f"{a.kind} thread {a.thread} {a.kernel} {a.file}:{a.line}" for a in h.accesses
        )
    return complete and not other, line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="a racecheck log (--racecheck-report hazard --print-limit 0)")
    args = parser.parse_args(argv)
    clean, line = triage(Path(args.log).read_text(errors="replace"))
    print(f"racecheck_triage: {line}")
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
