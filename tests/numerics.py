"""FlashAttention's error rule, shared by every numerical test.

``max|out - ref64| <= 2 * max|pt - ref64| + floor``

- ``ref64``: the reference in float64 (the truth);
- ``pt``: the same reference run in the inputs' dtype (what plain PyTorch math gets);
- ``floor``: rounding noise at the output's scale, one unit roundoff of the output dtype times the
  largest reference magnitude. It only matters where pt happens to be exact.

Non-finite entries of ref64 (the -inf LSE of rows that see no key) must be matched exactly.
"""

from __future__ import annotations

import torch


def rounding_floor(dtype: torch.dtype, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item() if ref.numel() else 0.0
    return torch.finfo(dtype).eps * max(scale, 1.0)


def assert_fa_rule(name: str, out: torch.Tensor, pt: torch.Tensor, ref64: torch.Tensor) -> None:
    """Assert the rule for one tensor; the message names the tensor and the numbers."""
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN in output"
    out64 = out.detach().to(torch.float64).cpu()
    pt64 = pt.detach().to(torch.float64).cpu()
    ref = ref64.detach().to(torch.float64).cpu()
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(out64), finite), f"{name}: non-finite entries differ"
    assert torch.equal(out64[~finite], ref[~finite]), f"{name}: infinite entries differ"
    if not finite.any():
        return
    err = (out64 - ref)[finite].abs().max().item()
    pt_err = (pt64 - ref)[finite & torch.isfinite(pt64)].abs().max().item()
    floor = rounding_floor(out.dtype, ref[finite])
    bound = 2 * pt_err + floor
    assert err <= bound, (
        f"{name}: max|out - ref64| = {err:.3e} > 2 * {pt_err:.3e} (pt error) + {floor:.3e} (floor)"
    )
