"""What the Hopper compile tests read from a compiled kernel (``test_compile_hopper.py``,
``test_compile_hopper_bwd.py``, ``test_compile_hopper_bwd256.py``): the build assembled for sm_90a
with Triton's ptxas (``assemble``), the scripts run in a subprocess (``compiled_rows``), and the
readers of PTX and SASS the schedule checks share (step loops, waits under products, barriers,
register splits)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import compile_shards


def step_loops(sass: str) -> list[list[str]]:
    """The instructions of each step loop of the SASS, in address order: a loop being a
    conditional backward branch whose body holds tensor-core products (the mbarrier waits' retry
    loops hold none; their unconditional jumps back are not loops), the innermost where loops
    nest."""
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2).strip()))
    loops = []
    for addr, text in code:
        m = re.match(r"@!?U?P\d+\s+BRA\S*\s+(?:`\(\S+\)\s*)?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        body = [t for a, t in code if int(m.group(1), 16) <= a <= addr]
        if sum("HGMMA" in t for t in body) >= 8:
            loops.append((int(m.group(1), 16), addr, body))
    return [
        body
        for lo, hi, body in loops
        if not any(lo <= a <= b <= hi and (a, b) != (lo, hi) for a, b, _ in loops)
    ]


def named_barriers(sass: str) -> list[list]:
    """The named barriers of the SASS: ``[op, id, threads, count]`` for each ``BAR.SYNC`` and
    ``BAR.ARV`` with an immediate id (threads 0 where the instruction names none: all of them)."""
    found: dict[tuple, int] = {}
    for op, bar, threads in re.findall(
        r"BAR\.(SYNC|ARV)[.A-Z_]* (0x[0-9a-f]+)(?:, (0x[0-9a-f]+))?\s*;", sass
    ):
        key = (op, int(bar, 16), int(threads, 16) if threads else 0)
        found[key] = found.get(key, 0) + 1
    return [[*key, n] for key, n in sorted(found.items())]


def assemble(src, maxnreg: int) -> tuple[str, str, dict]:
    """Compile a Gluon kernel source for sm_90a (register cap ``maxnreg`` at entry), assemble its
    PTX with Triton's ptxas and disassemble the cubin: ``(ptx, sass, facts)``, the facts every
    Hopper kernel here is held to (shared memory, registers, spills, ptxas warnings, the
    setmaxnreg split, products with their A operand in registers or shared memory)."""
    import triton
    from triton.backends.compiler import GPUTarget

    compiled = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg}
    )
    ptx = compiled.asm["ptx"]
    log, sass = compile_shards.ptxas_sm90a(ptx)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (
        ptx,
        sass,
        {
            "shared": compiled.metadata.shared,
            "registers": int(re.search(r"Used (\d+) registers", log).group(1)),
            "spill_bytes": int(spills.group(1)) + int(spills.group(2)),
            "ptxas_warnings": sorted(set(re.findall(r"C75\d\d", log))),
            "setmaxnreg": sorted(
                {
                    (op, int(n))
                    for op, n in re.findall(
                        r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx
                    )
                }
            ),
            "hgmma_register_a": len(re.findall(r"HGMMA\.64x\d+x16\.F32[.\w]* R\d+, R\d+", sass)),
            "hgmma_shared_a": len(re.findall(r"HGMMA\.64x\d+x16\.F32[.\w]* R\d+, gdesc", sass)),
        },
    )


# The Tritons whose compiled code these checks (spill allowances, the order of waits and products,
# the register split) were written against. The tier also runs on 3.8 and 3.9 (ops/runtime.py:
# SM90_TRITON, verified on a GPU), whose register allocation differs build by build (some spill
# where 3.6's do not, more spill less; 3.9 compiles sm_90 with CUDA 13's ptxas): docs/
# maintainers.md, "Other Tritons".
COMPILE_CHECKED = ("3.6.",)


def compiled_rows(script: str, expected: int) -> list[dict]:
    """Run a compile script (this file or its backward sibling) in a subprocess without
    TRITON_INTERPRET, with ``src`` on the path, and parse its JSON lines; skipped where the sm90
    tier is not verified."""
    pytest.importorskip("triton.experimental.gluon", reason="triton without Gluon")
    import triton

    if not triton.__version__.startswith(COMPILE_CHECKED):
        # Gluon's API and its code generation move between releases: the checks run on the
        # version whose code they read (one the tier is enabled on, ops/runtime.py).
        pytest.skip(f"the schedule checks read the code Triton {COMPILE_CHECKED} compiles")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    # The head-dim-256/MLA backward's builds take over 180 s with a cold Triton cache on one of
    # CI's two cores: the script runs split over the CPUs (compile_shards).
    rows = compile_shards.run(script, env, timeout=900)
    assert len(rows) == expected, [row.get("variant") for row in rows]
    return rows


def q_freed_after_store_read(ptx: str) -> int:
    """How many ``cp.async.bulk.wait_group.read 1`` (every store read but the one just issued)
    are followed, within a few dozen instructions and before any other bulk copy or mbarrier
    operation, by a ``bar.sync`` and then an ``mbarrier.arrive``: a consumer freeing the previous
    tile's Q slot once the copy engine has read that tile's O out of it, all its threads past
    the wait, while its own store is still in flight."""
    count, state, seen = 0, None, 0
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line.startswith("."):
            continue
        seen += 1
        if re.search(r"cp\.async\.bulk\.wait_group\.read\s+1;", line):
            state, seen = "waited", 0
        elif state and seen > 32:
            state = None
        elif state == "waited" and re.search(r"\bbar\.sync\b", line):
            state = "synced"
        elif state == "synced" and "mbarrier.arrive" in line:
            count, state = count + 1, None
        elif state and re.search(r"mbarrier\.|cp\.async\.bulk\.tensor", line):
            state = None
    return count


def releases_after(ptx: str, wait: str) -> list[int]:
    """For each PTX instruction matching ``wait``: how many ``mbarrier.arrive`` follow it, each
    behind a ``bar.sync`` of the warpgroup, before any other product, bulk copy or mbarrier wait
    (within 24 instructions)."""
    found, count, seen, synced = [], None, 0, False
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line.startswith("."):
            continue
        seen += 1
        if re.search(wait, line):
            if count is not None:
                found.append(count)
            count, seen, synced = 0, 0, False
        elif count is None:
            continue
        elif seen > 24 or re.search(r"wgmma\.mma_async|cp\.async\.bulk|mbarrier\.try_wait", line):
            found.append(count)
            count = None
        elif re.search(r"\bbar\.sync\b", line):
            synced = True
        elif synced and "mbarrier.arrive" in line:
            count, synced = count + 1, False
    if count is not None:
        found.append(count)
    return found


def store_reads_under_products(ptx: str) -> int:
    """How many waits for the copy engine's read of every bulk store (``wait_group.read 0``)
    come while a product is in flight: after a ``wgmma.commit_group`` and before the next
    ``wgmma.wait_group``."""
    found, in_flight = 0, False
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if "wgmma.commit_group" in line:
            in_flight = True
        elif "wgmma.wait_group" in line:
            in_flight = False
        elif in_flight and re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", line):
            found += 1
    return found


# (wait leaving one wgmma group running, wait for all, exponential) in SASS.
PTX_WAITS = (
    r"wgmma\.wait_group\.sync\.aligned\s+1;",
    r"wgmma\.wait_group\.sync\.aligned\s+0;",
    "ex2.approx",
)


SASS_WAITS = (
    r"WARPGROUP\.DEPBAR\.LE gsb0, 0x1\b",
    r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0\b",
    "MUFU.EX2",
)


def ptx_exp2_while_product_runs(ptx: str) -> int:
    """Static ``ex2`` instructions of the PTX that execute, on every path, while at least one
    wgmma group is still running: a must-dataflow over the PTX's basic blocks of the number of
    committed, not yet waited-for groups (``commit_group`` adds one, ``wait_group N`` caps at N).
    The CFG matters: LLVM places the softmax block after its branch targets, not in line."""
    blocks, order, succ = {}, [], {}
    current = "entry"
    blocks[current], order = [], ["entry"]
    pending_targets, collecting = [], False
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if collecting or ".branchtargets" in line:
            pending_targets += re.findall(r"\$L__\w+", line)
            collecting = not line.endswith(";")
            continue
        label = re.match(r"^(\$L__\w+):", line)
        if label:
            name = label.group(1)
            if current is not None:
                succ.setdefault(current, []).append(name)  # fall through
            current = name
            blocks[current], order = [], [*order, name]
            continue
        if current is None or not line:
            continue
        blocks[current].append(line)
        jump = re.match(r"^(@!?%p\d+\s+)?bra(\.uni)?\s+(\$L__\w+);", line)
        if jump:
            succ.setdefault(current, []).append(jump.group(3))
            if not jump.group(1):
                current = None  # unconditional: no fall through
        elif line.startswith("brx.idx"):
            succ.setdefault(current, []).extend(pending_targets)
            current = None
        elif line in ("ret;", "exit;"):
            current = None
    # A block takes the count n to min(n + a, c) (each commit adds one, each wait caps): read
    # once per block, then swept to the fixpoint (counts only fall).
    inf = float("inf")
    effect = {}
    for name in order:
        add, cap = 0, inf
        for line in blocks[name]:
            if "wgmma.commit_group" in line:
                add, cap = add + 1, cap + 1
            wait = re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", line)
            if wait:
                cap = min(cap, int(wait.group(1)))
        effect[name] = (add, cap)
    state = {name: inf for name in order}
    state["entry"] = 0
    changed = True
    while changed:
        changed = False
        for name in order:
            if state[name] == inf:
                continue
            add, cap = effect[name]
            n = min(state[name] + add, cap)
            for nxt in succ.get(name, []):
                if nxt in state and n < state[nxt]:
                    state[nxt], changed = n, True
    count = 0
    for name in order:
        n = state[name]
        if n == inf:
            continue
        for line in blocks[name]:
            if "wgmma.commit_group" in line:
                n += 1
            wait = re.search(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", line)
            if wait:
                n = min(n, int(wait.group(1)))
            if line.startswith("ex2.approx") and n >= 1:
                count += 1
    return count


def exp2_while_product_runs(code: str, waits: tuple[str, str, str]) -> int:
    """The most exponentials found between a wait that leaves one wgmma group running (tile t's
    ``Q K^T`` done, ``P_{t-1} V_{t-1}`` in flight) and the next wait for all, in program order."""
    leave_one, wait_all, exp2 = waits
    best, count, open_window = 0, 0, False
    for line in code.splitlines():
        if re.search(leave_one, line):
            open_window, count = True, 0
        elif re.search(wait_all, line):
            open_window = False
        elif open_window and exp2 in line:
            count += 1
            best = max(best, count)
    return best


def lazy_rescale_branches(sass: str) -> int:
    """How many warp votes (``VOTE.ANY``) are followed, before any other instruction but
    independent ones, by a branch over at least 32 ``FMUL`` and nothing else: a consumer's O
    rescale behind a warp-uniform branch (``kernels/hopper/common.py: rescale`` with LAZY)."""
    lines = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass)]
    count = 0
    for i, line in enumerate(lines):
        if not line.startswith("VOTE.ANY P"):
            continue
        for j in range(i + 1, min(i + 128, len(lines))):
            branch = re.match(r"@!P\d BRA 0x([0-9a-f]+)", lines[j])
            if branch:
                body = lines[j + 1 : j + 1 + 256]
                muls = 0
                for op in body:
                    if not op.startswith("FMUL"):
                        break
                    muls += 1
                count += muls >= 32
                break
    return count


def fenced_arrives(ptx: str) -> int:
    """How many ``fence.proxy.async.shared::cta`` are followed, within a few instructions and
    before any bulk copy, by a plain ``mbarrier.arrive``: shared memory written by threads and
    handed to the tensor cores through a barrier (the producer's bounded V load,
    ``fwd_load._load_v_bounded``; the O stores' fences lead to a TMA store instead)."""
    count, seen = 0, None
    for raw in ptx.splitlines():
        line = raw.split("//")[0].strip()
        if not line or line.startswith("."):
            continue
        if "fence.proxy.async.shared::cta" in line:
            seen = 0
        elif seen is not None:
            seen += 1
            if "cp.async.bulk" in line or seen > 8:
                seen = None
            elif re.search(r"mbarrier\.arrive\.shared::cta\.b64", line):
                count, seen = count + 1, None
    return count


def assert_register_split(rows: list[dict]) -> None:
    """The producer warp drops to 24 registers, the consumer warpgroups rise to theirs (240 with
    two, 160 with three, 232 or 136 with one), and ptxas warned of nothing (C7508 if it ignored
    setmaxnreg, C7515 if it serialised the wgmmas)."""
    for row in rows:
        pairs = {tuple(p) for p in row["setmaxnreg"]}
        assert ("dec", 24) in pairs, f"{row['variant']}: {pairs}"
        assert ("inc", row.get("consumer_regs", 240)) in pairs, f"{row['variant']}: {pairs}"
        assert row["ptxas_warnings"] == [], f"{row['variant']}: {row['ptxas_warnings']}"
