"""The sm_90 compile scripts split over processes.

Each compile script (``sm90_compile.py``, ``test_compile_hopper*.py`` run as scripts) compiles
its kernel variants one after another and prints one JSON line a variant. With a cold Triton
cache that is minutes a script on one core, so ``run`` starts the script in several processes at
once (``workers``: ``FLASHCORE_COMPILE_JOBS`` or the CPUs), each taking every n-th job
(``Shard.take``), and merges their lines back into the jobs' order. Run by hand, a script is
one shard of one and prints what it always printed, plus each row's ``job``.

``ptxas_sm90a`` is the scripts' one call of ptxas (and cuobjdump) on a kernel's PTX, kept in a
cache beside Triton's own: Triton's cache skips its own compile of a kernel that did not change,
but not the checks' second assembly (for ptxas's report, which Triton keeps nowhere) nor the
disassembly, which were most of a warm run of the four compile suites.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SHARD_ENV = "FLASHCORE_COMPILE_SHARD"
JOBS_ENV = "FLASHCORE_COMPILE_JOBS"
TOOL_CACHE_ENV = "FLASHCORE_TOOL_CACHE"


class Shard:
    """This process's share of a script's jobs: ``FLASHCORE_COMPILE_SHARD=i/n`` (default
    ``0/1``) takes jobs i, i + n, i + 2n, ... in the order the script meets them."""

    def __init__(self) -> None:
        spec = os.environ.get(SHARD_ENV, "0/1")
        try:
            index, count = (int(x) for x in spec.split("/"))
        except ValueError:
            raise ValueError(f"{SHARD_ENV} must be 'i/n', got {spec!r}") from None
        if not 0 <= index < count:
            raise ValueError(f"{SHARD_ENV} must be 'i/n' with 0 <= i < n, got {spec!r}")
        self.index, self.count, self.job = index, count, -1

    def take(self) -> bool:
        """Move to the next job; whether it is this shard's."""
        self.job += 1
        return self.job % self.count == self.index

    def emit(self, row: dict) -> None:
        """Print one row of the current job."""
        print(json.dumps({**row, "job": self.job}), flush=True)


def emit_variants(variants, compile_variant) -> None:
    """A compile script's main loop: ``compile_variant(v)``'s row for each of ``variants`` that
    is this process's share."""
    shard = Shard()
    for variant in variants:
        if shard.take():
            shard.emit(compile_variant(variant))


def workers() -> int:
    """Processes a script is split over: ``FLASHCORE_COMPILE_JOBS``, else the CPUs this process
    may run on (at most 8)."""
    if os.environ.get(JOBS_ENV):
        return max(1, int(os.environ[JOBS_ENV]))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, 8))


def run(script: str | Path, env: dict[str, str], timeout: float) -> list[dict]:
    """Run ``script`` in ``workers()`` processes at once (each with its shard in the
    environment) and return the rows of all, in the order of their jobs (a job's rows in the
    order printed). Raises ``AssertionError`` with the stderr tail of a process that failed."""
    count = workers()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for index in range(count):
            out = open(Path(tmp) / f"{index}.out", "w+")  # noqa: SIM115 (closed below)
            err = open(Path(tmp) / f"{index}.err", "w+")  # noqa: SIM115
            shard_env = {**env, SHARD_ENV: f"{index}/{count}"}
            proc = subprocess.Popen(
                [sys.executable, str(script)], env=shard_env, stdout=out, stderr=err, text=True
            )
            procs.append((proc, out, err))
        rows = []
        try:
            for proc, out, err in procs:
                proc.wait(timeout=timeout)
                out.seek(0)
                err.seek(0)
                assert proc.returncode == 0, err.read()[-4000:]
                rows += [json.loads(line) for line in out if line.startswith("{")]
        finally:
            for proc, out, err in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                out.close()
                err.close()
    # sorted() is stable: a job's rows come from one process, in the order it printed them.
    return sorted(rows, key=lambda row: row["job"])


@functools.cache
def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def ptxas_sm90a(ptx: str, sass: bool = True) -> tuple[str, str | None]:
    """Assemble ``ptx`` for sm_90a with the ptxas Triton uses for sm_90 (``-v``): ptxas's report
    (stderr: registers, spills, warnings) and, with ``sass``, ``cuobjdump -sass`` of the cubin.

    Both are kept, compressed, under Triton's cache directory (``flashcore-ptxas/``), keyed by
    the PTX, the arguments and the bytes of both tools, so a repeat reads what the same tools
    made of the same PTX; ``FLASHCORE_TOOL_CACHE=0`` runs them every time. A new
    ``TRITON_CACHE_DIR`` is a cold run, as for Triton's own cache."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    cuobjdump = str(Path(ptxas).with_name("cuobjdump"))
    args = ["-arch=sm_90a", "-v"]
    entry = None
    if os.environ.get(TOOL_CACHE_ENV, "1") != "0":
        from triton import knobs

        tools = [_file_digest(ptxas), _file_digest(cuobjdump) if sass else None]
        key = hashlib.sha256(json.dumps([tools, args, ptx]).encode()).hexdigest()
        entry = Path(knobs.cache.dir) / "flashcore-ptxas" / f"{key}.json.gz"
        if entry.is_file():
            kept = json.loads(gzip.decompress(entry.read_bytes()))
            return kept["log"], kept["sass"]
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(src).write_text(ptx)
        run = functools.partial(subprocess.run, capture_output=True, text=True, check=True)
        log = run([ptxas, *args, src, "-o", cubin]).stderr
        listing = run([cuobjdump, "-sass", cubin]).stdout if sass else None
    if entry is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # Written whole, then renamed: the shards (and a second CI stack) share the directory.
        fd, part = tempfile.mkstemp(dir=entry.parent, suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(gzip.compress(json.dumps({"log": log, "sass": listing}).encode(), 6))
        os.replace(part, entry)
    return log, listing
