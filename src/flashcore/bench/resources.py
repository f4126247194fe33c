"""Resource report: what each compiled flashcore kernel variant of this run costs on the chip.

For every ``@triton.jit`` kernel defined in ``flashcore.kernels.*`` that was compiled in this
process (Triton 3.6 keeps them in ``JITFunction.device_caches[device][0]``, a dict from
specialisation key to ``CompiledKernel``), it lists the constexpr configuration (block sizes and
feature flags), ``num_warps`` and ``num_stages`` from the kernel's metadata, registers per thread
and spills (``CompiledKernel.n_regs`` / ``n_spills``, read from the CUDA driver when the binary is
loaded; ``n_spills`` is the local-memory size in 32-bit words per thread) and the shared memory
the kernel asks for (``metadata.shared``, bytes). Kernels launched through an autotuner or
heuristics wrapper are found through its ``.fn``.

Under Triton's interpreter nothing is compiled, so there is nothing to report.
"""

from __future__ import annotations

import contextlib
import sys
from typing import NamedTuple

KERNEL_PACKAGE = "flashcore.kernels"


class KernelResources(NamedTuple):
    kernel: str
    config: dict
    """Upper-case constexpr arguments (BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, IS_CAUSAL, ...)."""
    num_warps: int
    num_stages: int
    registers: int | None
    """Per thread."""
    spills: int | None
    """Local memory per thread, in 32-bit words."""
    shared_bytes: int

    def as_row(self) -> dict:
        return {"record": "resources", **self._asdict()}


def _jit_functions() -> list:
    from triton.runtime.jit import JITFunction, KernelInterface

    found: dict[int, JITFunction] = {}
    for name, module in sorted(sys.modules.items()):
        if module is None or not name.startswith(KERNEL_PACKAGE + "."):
            continue
        for obj in vars(module).values():
            # Autotuner / Heuristics are KernelInterfaces whose .fn is the next wrapper or the
            # JITFunction itself.
            while not isinstance(obj, JITFunction) and isinstance(obj, KernelInterface):
                obj = getattr(obj, "fn", None)
            if isinstance(obj, JITFunction):
                found.setdefault(id(obj), obj)
    return list(found.values())


def _value(v: object) -> object:
    v = getattr(v, "value", v)  # tl.constexpr
    return v if isinstance(v, bool | int | float | str) or v is None else str(v)


def collect() -> list[KernelResources] | None:
    """Every compiled flashcore kernel variant in this process; None under the interpreter."""
    from triton import knobs

    if knobs.runtime.interpret:
        return None
    result = []
    for fn in _jit_functions():
        for caches in list(fn.device_caches.values()):
            for compiled in list(caches[0].values()):
                if hasattr(compiled, "result"):  # a future, under async compilation
                    compiled = compiled.result()
                if getattr(compiled, "n_regs", None) is None:
                    # Loading the binary sets n_regs / n_spills; one that cannot load shows "?".
                    with contextlib.suppress(Exception):
                        compiled._init_handles()
                constants = getattr(compiled.src, "constants", {})
                config = {
                    fn.arg_names[path[0]]: _value(v)
                    for path, v in sorted(constants.items())
                    if len(path) == 1 and fn.arg_names[path[0]].isupper()
                }
                meta = compiled.metadata
                result.append(
                    KernelResources(
                        kernel=compiled.name,
                        config=config,
                        num_warps=meta.num_warps,
                        num_stages=meta.num_stages,
                        registers=getattr(compiled, "n_regs", None),
                        spills=getattr(compiled, "n_spills", None),
                        shared_bytes=meta.shared,
                    )
                )
    result.sort(key=lambda r: (r.kernel, sorted(r.config.items(), key=str)))
    return result


def _config_text(config: dict) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in config.items())


def format_report(resources: list[KernelResources] | None) -> tuple[str, list[str]]:
    """The report text and the spill warnings."""
    if resources is None:
        return (
            "Resources: unavailable under the Triton interpreter (nothing is compiled on the CPU); "
            "run on a GPU to see registers, spills and shared memory.",
            [],
        )
    if not resources:
        return "Resources: no flashcore kernel was compiled in this run.", []
    head = f"{'kernel':<26}{'warps':>6}{'stages':>7}{'regs':>6}{'spills':>7}{'smem KiB':>9}  config"
    lines = ["Compiled flashcore kernels (per variant used in this run):", head, "-" * len(head)]
    warnings = []
    for r in resources:
        regs = "?" if r.registers is None else str(r.registers)
        spills = "?" if r.spills is None else str(r.spills)
        lines.append(
            f"{r.kernel:<26}{r.num_warps:>6}{r.num_stages:>7}{regs:>6}{spills:>7}"
            f"{r.shared_bytes / 1024:>9.1f}  {_config_text(r.config)}"
        )
        if r.spills:
            warnings.append(
                f"WARNING: {r.kernel} [{_config_text(r.config)}] spills {r.spills} 32-bit words "
                f"per thread to local memory ({r.registers} registers/thread)"
            )
    lines.append("regs: per thread; spills: local memory per thread (32-bit words); smem: shared.")
    return "\n".join(lines), warnings
