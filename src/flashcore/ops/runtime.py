"""What the process runs on: kernel modules, Triton's interpreter, the device's capabilities.

Importing flashcore does not import triton: the kernel modules are imported at the first launch
(``kernel``), so ``TRITON_INTERPRET=1`` may be set any time before triton is first imported
(triton reads it when its own modules are defined). Every answer here is fixed for the process
once it is given, and cached.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from flashcore.ops.launch import Launcher


@functools.cache
def kernel(module: str, name: str, num_pointers: int) -> Launcher:
    """The launcher (``ops.launch``) of kernel ``name`` of ``flashcore.kernels.<module>``, whose
    first ``num_pointers`` arguments are pointers; the module is imported (with triton) here."""
    fn = getattr(importlib.import_module(f"flashcore.kernels.{module}"), name)
    return Launcher(fn, num_pointers)


@functools.cache
def is_interpreted() -> bool:
    """True when the kernels are defined under Triton's interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel("fwd", "attn_fwd_kernel", 8).fn, InterpretedFunction)


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device``; (0, 0) for the CPU (the interpreter)."""
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def has_tma(device: torch.device) -> bool:
    """Tensor descriptors need the bulk-copy engine of Hopper (sm_90) or newer."""
    return capability(device)[0] >= 9


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_on(t: torch.Tensor) -> Any:
    """Triton launches on the current CUDA device, not on the tensors': make it ``t``'s (a no-op
    context on the CPU)."""
    return torch.cuda.device_of(t)
