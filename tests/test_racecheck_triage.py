"""``scripts/racecheck_triage.py``: which racecheck reports are the partition-state ones.

The logs here are written in racecheck's format (compute-sanitizer 2025.3.1,
``--racecheck-report hazard``) at the lines of the kernels as they are now, so a kernel that
moves keeps the triage honest: a report counts as on the partition state only at the kernel's
``def`` line, never at a line of its partitions.
"""

import re
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent

triage = load_script("racecheck_triage")

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


def test_default_partitions_live_beside_their_kernels():
    """Each warp-specialized kernel's default partition (the first function of its
    ``gl.warp_specialize`` list) is defined in the kernel's own module. Triton 3.6's line info
    gives the default partition's own lines the kernel's file: with the backward's consumer
    (``bwd_steps.consumer``) as the default partition, racecheck (H200) named consumer 0's loads
    ``bwd.py`` at ``bwd_steps.py``'s line numbers, and the triage could not match them to their
    marks. ``bwd.py`` calls it through ``_consumer_0`` for that reason."""
    import ast

    checked = set()
    for path in triage.SOURCES:
        tree = ast.parse(path.read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        for call in ast.walk(tree):
            if not (
                isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "warp_specialize"
            ):
                continue
            partitions = call.args[0]
            first = partitions.elts[0].elts[0] if isinstance(partitions, ast.List) else None
            assert isinstance(first, ast.Name), (path.name, ast.dump(partitions)[:200])
            assert first.id in defined, (path.name, first.id)
            checked.add(path.name)
    assert {"fwd.py", "bwd.py", "bwd256.py", "bwd256_dq.py", "bwd_mla.py"} <= checked, checked


def test_partition_state_reports_are_clean():
    _, _, last = KERNELS["attn_fwd_sm90_kernel"]
    reports = [
        state_report(reader=r, address=0x1C560 + i) for i, r in enumerate((128, 160, 192))
    ] + [state_report(line=last - 2, writer=0, reader=224, address=0x1C563)]
    clean, line = triage.triage(log(*reports), KERNELS)
    assert clean, line
    assert "4 on the partition state (attn_fwd_sm90_kernel 0x1c560-0x1c563), 0 on" in line
    assert line.endswith(", 0 other")


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


TAGS = triage.hand_over_lines()


def tagged(file, name, op):
    """The first line of ``file`` marked as hand-over ``name`` whose code does ``op``."""
    source = next((ROOT / "src/flashcore/kernels/hopper").glob(file), None)
    source = source or ROOT / "scripts" / file
    lines = source.read_text().splitlines()
    return next(
        line for (f, line), tag in sorted(TAGS.items())
        if f == file and tag == name and f".{op}(" in lines[line - 1]
    )  # fmt: skip


def test_hand_over_marks_sit_on_shared_memory_accesses():
    """Every line marked as a hand-over is a shared-memory store or load, and each name has both."""
    assert set(TAGS.values()) == {"work item", "row stats", "zeroed rows", "handoff buffer"}
    for file, line in TAGS:
        path = next((ROOT / "src/flashcore/kernels/hopper").glob(file), None)
        text = (path or ROOT / "scripts" / file).read_text().splitlines()[line - 1]
        assert ".store(" in text or ".load(" in text, (file, line, text)
    for file, name in (
        ("common.py", "work item"),
        ("bwd_mla.py", "row stats"),
        ("ws_racecheck_probe.py", "handoff buffer"),
    ):
        assert tagged(file, name, "store") and tagged(file, name, "load")  # fmt: skip
    # The Hopper backward's row stats: stored by its producer warp (bwd_load.py), loaded by its
    # consumers (bwd_steps.py).
    assert tagged("bwd_load.py", "row stats", "store")
    assert tagged("bwd_steps.py", "row stats", "load")
    # The packed backward's K and V rows past a sequence's end: zeroed by the producer
    # (common.zero_rows), loaded into registers by the consumers (D = 64, KV_REGS).
    assert tagged("common.py", "zeroed rows", "store")
    assert tagged("bwd_steps.py", "zeroed rows", "load")


def test_hand_over_reports_are_clean():
    """The forward's dynamic deal (the producer posts an item, a consumer reads it: WAR against
    the next post), the MLA backward's row stats on a packed batch (RAW) and the packed D = 64
    backward's zeroed K rows (RAW), as measured (H200: docs/maintainers.md), beside a
    partition-state report."""
    fwd = "attn_fwd_sm90_kernel"
    post, read = tagged("common.py", "work item", "store"), tagged("common.py", "work item", "load")
    mla = "attn_bwd_mla_sm90_kernel"
    store = tagged("bwd_mla.py", "row stats", "store")
    load = tagged("bwd_mla.py", "row stats", "load")
    # The packed D = 64 backward's K rows past a sequence's end, zeroed by its producer (thread
    # 456) and loaded into registers by consumer 1 (thread 225), as measured (H200).
    bwd = "attn_bwd_sm90_kernel"
    zeroed, k_regs = (
        tagged("common.py", "zeroed rows", "store"),
        tagged("bwd_steps.py", "zeroed rows", "load"),
    )
    reports = [
        state_report(),
        hazard(0x385C0, (320, fwd, "common.py", post), (95, fwd, "common.py", read), kind="WAR"),
        hazard(0x38408, (321, mla, "bwd_mla.py", store), (65, mla, "bwd_mla.py", load)),
        hazard(0x38409, (321, mla, "bwd_mla.py", store), (130, mla, "bwd_mla.py", load)),
        hazard(0x1BC90, (456, bwd, "common.py", zeroed), (225, bwd, "bwd_steps.py", k_regs)),
    ]
    clean, line = triage.triage(log(*reports), KERNELS, TAGS)
    assert clean, line
    assert "1 on the partition state" in line
    assert (
        "4 on mbarrier hand-overs (attn_bwd_mla_sm90_kernel row stats: 2; attn_bwd_sm90_kernel "
        "zeroed rows: 1; attn_fwd_sm90_kernel work item: 1), 0 other" in line
    )


@pytest.mark.parametrize("case", ["other-name", "same-warpgroup", "unmarked", "waw", "kernels"])
def test_other_hand_over_like_reports_are_not_clean(case):
    fwd = "attn_fwd_sm90_kernel"
    post, read = tagged("common.py", "work item", "store"), tagged("common.py", "work item", "load")
    write, reader, kind = (320, fwd, "common.py", post), (95, fwd, "common.py", read), "WAR"
    if case == "other-name":  # a store of one hand-over against a load of another
        reader = (95, fwd, "bwd_mla.py", tagged("bwd_mla.py", "row stats", "load"))
    elif case == "same-warpgroup":  # one partition's own threads: a barrier of theirs is missing
        write = (100, fwd, "common.py", post)
    elif case == "unmarked":
        write = (320, fwd, "common.py", post - 1)
    elif case == "waw":
        kind = "WAW"
    else:
        reader = (95, "attn_bwd_mla_sm90_kernel", "common.py", read)
    clean, line = triage.triage(log(hazard(0x100, write, reader, kind=kind)), KERNELS, TAGS)
    assert not clean and "0 on mbarrier hand-overs" in line and "1 other" in line, line


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


PROBE_VARIANTS = (
    "plain", "regs", "init", "init-regs", "arrive", "thread-barrier", "init-sync", "pingpong",
    "default-bar5", "worker-barrier", "handoff",
)  # fmt: skip


def load_probe():
    """The probe script, where its SASS is the code the checks read (Triton 3.6, as the other
    compile checks: test_compile_hopper.COMPILE_CHECKED)."""
    pytest.importorskip("triton.experimental.gluon", reason="triton without Gluon")
    import triton

    from hopper_compile import COMPILE_CHECKED

    if not triton.__version__.startswith(COMPILE_CHECKED):
        pytest.skip(f"the SASS checks read the code Triton {COMPILE_CHECKED} compiles")
    probe = load_script("ws_racecheck_probe")
    assert probe.VARIANTS == PROBE_VARIANTS
    return probe


# A barrier of 128 threads with an id the default partition uses (0: Triton's own; 5: the
# probe's inline one); Triton gives a 4-warp worker partition ids from 2 on (worker-barrier: 2).
_DEFAULT_PARTIAL = re.compile(r"BAR\.SYNC\.DEFER_BLOCKING 0x[05], 0x80")


@pytest.mark.parametrize("variant", PROBE_VARIANTS)
def test_probe_reports_follow_the_default_partitions_barriers(variant):
    """The racecheck reports measured on each probe variant (``REPORTS_H200``) come exactly with a
    barrier of the default partition's 128 threads in its sm_90a SASS, and every variant keeps
    the handshake: the state stored, then barrier 1 of the whole CTA, then each worker's load."""
    probe = load_probe()
    code = probe.sass(variant)
    lines = code.splitlines()
    bar1 = [i for i, line in enumerate(lines) if "BAR.SYNC.DEFER_BLOCKING 0x1 ;" in line]
    loads = [i for i, line in enumerate(lines) if "LDS.U8" in line]
    assert len(loads) == 1 and bar1 and bar1[0] < loads[0], code
    if variant == "handoff":
        # Data through shared memory, ordered by mbarriers: stores, arrivals, waits, loads.
        assert "SYNCS.ARRIVE" in code and "SYNCS.PHASECHK" in code and "LDSM" in code, code
    if variant == "pingpong":
        assert "BAR.ARV 0x9, 0x100" in code and "BAR.SYNC.DEFER_BLOCKING 0x9, 0x100" in code
    if variant == "worker-barrier":
        assert "BAR.SYNC.DEFER_BLOCKING 0x2, 0x80" in code
    partial = bool(_DEFAULT_PARTIAL.search(code))
    assert partial == (probe.REPORTS_H200[variant] > 0), code
