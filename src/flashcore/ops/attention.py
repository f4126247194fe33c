"""``torch.library`` registration of the attention ops under the ``flashcore::`` namespace.

``custom_op`` (not ``triton_op``) keeps the ops opaque to ``torch.compile`` and lets
``torch.library.opcheck`` run them through Triton's interpreter on the CPU.
"""

from __future__ import annotations

import torch

from flashcore.ops import fwd


@torch.library.custom_op("flashcore::attn_fwd", mutates_args=())
def attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward: ``(out, lse)`` for validated ``(B, H, Sq, D)`` / ``(B, Hkv, Sk, D)`` inputs."""
    return fwd.attn_fwd(q, k, v, causal, scale)


@attn_fwd.register_fake
def _attn_fwd_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seqlen_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, heads, seqlen_q), dtype=torch.float32)
