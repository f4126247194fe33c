"""Device-side: one backward of a ``flashcore-bench`` provider between ``cudaProfilerStart`` and
``cudaProfilerStop``, for ncu beside another library's kernel:

    PYTHONPATH=src ncu --profile-from-start off --clock-control none \\
        -k regex:"attn_bwd_sm90_kernel|FlashAttentionBackwardSm90" --metrics ... \\
        python scripts/bwd_profile_one.py PROVIDER B,H,S,D CAUSAL WINDOW

``PROVIDER`` a bench name (``flashcore``, ``fa4``, ...), ``CAUSAL`` 0 or 1, ``WINDOW``
``LEFT,RIGHT`` or ``none``. bf16; one forward kept, two backwards of it before the profiled one.
"""

import sys

import torch
from bwd_kernel_times import inputs, provider

from flashcore.bench.cases import Case, Shape, parse_window


def main() -> int:
    name, spec, causal, window = sys.argv[1:5]
    b, h, s, d = (int(x) for x in spec.split(","))
    win = None if window == "none" else parse_window(window)
    case = Case(Shape(b, h, s, d, h, s, d), causal == "1", window=win)
    torch.manual_seed(0)
    leaves, dout = inputs((b, h, s, d))
    out = provider(name, case)(*leaves)
    for _ in range(2):
        torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.autograd.grad(out, leaves, dout, retain_graph=True)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
