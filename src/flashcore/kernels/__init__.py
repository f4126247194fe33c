"""Triton kernels. This package imports triton only, never torch.

Modules are imported lazily by ``flashcore.ops`` at the first launch, so Triton's interpreter flag
(``TRITON_INTERPRET=1``) may be set any time before the first attention call.
"""
