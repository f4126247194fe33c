"""``scripts/racecheck_triage.py``: which racecheck reports are the partition-state ones.

The logs here are written in racecheck's format (compute-sanitizer 2025.3.1,
``--racecheck-report hazard``) at the lines of the kernels as they are now, so a kernel that
moves keeps the triage honest: a report counts as on the partition state only at the kernel's
``def`` line, never at a line of its partitions.
"""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "racecheck_triage", ROOT / "scripts" / "racecheck_triage.py"
)
triage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(triage)

KERNELS = triage.ws_kernels()


def hazard(address, write, read, kind="RAW", block=0):
    """One report; ``write`` and ``read`` are (thread, kernel, file, line)."""
    lines = [f"========= Error: Potential {kind} hazard detected at __shared__ 0x{address:x} "
             f"in block ({block},0,0) :"]  # fmt: skip
    for what, (thread, kernel, file, line) in (("Write", write), ("Read", read)):
        where = f"{kernel}+0x1590 in {file}:{line}"
        lines.append(f"=========     {what} Thread ({thread},0,0) at {where}")
    lines.append("=========     Current Value : 1")
    return "\n".join(lines)


def log(*hazards, displayed=None, errors=None):
    n = len(hazards)
    summary = (
        f"========= RACECHECK SUMMARY: {n if displayed is None else displayed} hazards displayed "
        f"({n if errors is None else errors} errors, 0 warnings)"
    )
    return "\n".join(["========= COMPUTE-SANITIZER", *hazards, summary])


def state_report(kernel="attn_fwd_sm90_kernel", address=0x1C560, reader=128, writer=31, line=None):
    file, first, _ = KERNELS[kernel]
    write_line = first if line is None else line
    return hazard(address, (writer, kernel, file, write_line), (reader, kernel, file, first))


def test_finds_every_warp_specialized_kernel():
    for name in ("attn_fwd_sm90_kernel", "ws_probe_kernel"):
        assert name in KERNELS
    file, first, last = KERNELS["attn_fwd_sm90_kernel"]
    assert file == "fwd.py" and first < last
    source = (ROOT / "src/flashcore/kernels/hopper/fwd.py").read_text().splitlines()
    assert source[first - 1].startswith("def attn_fwd_sm90_kernel(")
    # Every Hopper kernel module that launches a warp-specialized kernel is seen.
    files = {file for file, _, _ in KERNELS.values()}
    assert {"fwd.py", "bwd.py", "bwd256.py", "ws_racecheck_probe.py"} <= files


def test_partition_state_reports_are_clean():
    _, _, last = KERNELS["attn_fwd_sm90_kernel"]
    reports = [
        state_report(reader=r, address=0x1C560 + i) for i, r in enumerate((128, 160, 192))
    ] + [state_report(line=last - 2, writer=0, reader=224, address=0x1C563)]
    clean, line = triage.triage(log(*reports), KERNELS)
    assert clean, line
    assert "4 on the partition state (attn_fwd_sm90_kernel 0x1c560-0x1c563), 0 other" in line


@pytest.mark.parametrize(
    "case",
    ["read-in-partition", "reader-default", "writer-worker", "war", "other-kernel", "other-file"],
)
def test_other_reports_are_not_clean(case):
    kernel = "attn_fwd_sm90_kernel"
    file, first, last = KERNELS[kernel]
    write, read = (31, kernel, file, first), (128, kernel, file, first)
    kind = "RAW"
    if case == "read-in-partition":  # a worker's read of a buffer, at a partition's own line
        read = (128, kernel, "fwd_steps.py", 120)
    elif case == "reader-default":
        read = (64, kernel, file, first)
    elif case == "writer-worker":
        write = (130, kernel, file, first)
    elif case == "war":
        kind = "WAR"
    elif case == "other-kernel":  # a kernel that does not warp-specialize
        write, read = (31, "attn_fwd", "fwd.py", 10), (128, "attn_fwd", "fwd.py", 10)
    else:
        write = (31, kernel, file, last + 5)
    reports = [state_report(), hazard(0x100, write, read, kind=kind)]
    clean, line = triage.triage(log(*reports), KERNELS)
    assert not clean
    assert "1 on the partition state" in line and "1 other" in line
    assert "\n  other: " in line


def test_every_report_must_be_read():
    # --print-limit cut the list: the reports not shown could be anything.
    clean, line = triage.triage(log(state_report(), errors=44), KERNELS)
    assert not clean and "not every report was read" in line
    clean, line = triage.triage(log(state_report(), displayed=6), KERNELS)
    assert not clean and "not every report was read" in line


def test_no_summary_is_not_clean():
    clean, line = triage.triage("========= COMPUTE-SANITIZER\n" + state_report(), KERNELS)
    assert not clean and "did not finish" in line


def test_no_reports_is_clean():
    clean, line = triage.triage(log(), KERNELS)
    assert clean and "0 reports read" in line


def test_command_line(tmp_path):
    path = tmp_path / "racecheck.log"
    path.write_text(log(state_report()))
    assert triage.main([str(path)]) == 0
    path.write_text(log(state_report(), errors=3))
    assert triage.main([str(path)]) == 1
