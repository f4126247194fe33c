"""``flashcore-demo``: run flashcore.attention on a few shapes and print its error table.

On a GPU the kernels are compiled; without one they run through Triton's interpreter on the CPU
(set here, before the first kernel is defined), on smaller shapes.
"""

from __future__ import annotations

import argparse
import os

import torch

# (batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, causal)
GPU_SHAPES = [
    (2, 16, 16, 2048, 2048, 128, False),
    (2, 16, 16, 2048, 2048, 128, True),
    (2, 32, 8, 1024, 4096, 64, True),
    (1, 8, 8, 3001, 1000, 256, True),
    (4, 8, 1, 1, 4096, 128, False),
]
CPU_SHAPES = [
    (1, 2, 2, 113, 113, 64, False),
    (1, 2, 2, 113, 113, 64, True),
    (1, 4, 2, 65, 203, 80, True),
    (1, 2, 1, 203, 65, 128, True),
    (2, 2, 1, 1, 257, 64, False),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashcore-demo", description=__doc__)
    parser.add_argument("--cpu", action="store_true", help="use the interpreter even with a GPU")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.cpu
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"

    import flashcore
    from flashcore import reference

    device = "cuda" if on_gpu else "cpu"
    where = torch.cuda.get_device_name() if on_gpu else "CPU (Triton interpreter)"
    print(f"flashcore {flashcore.__version__} on {where}")
    print("error = max|x - ref64| (reference in float64); pt = plain PyTorch math in the dtype")
    header = f"{'shape (B,H,Hkv,Sq,Sk,D)':<28}{'causal':>7}{'dtype':>6}{'out err':>10}"
    header += f"{'pt err':>10}{'lse err':>10}{'ok':>4}"
    print(header)
    print("-" * len(header))
    torch.manual_seed(0)
    failures = 0
    for b, h, hkv, sq, sk, d, causal in GPU_SHAPES if on_gpu else CPU_SHAPES:
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(b, h, sq, d, dtype=dtype, device=device)
            k = torch.randn(b, hkv, sk, d, dtype=dtype, device=device)
            v = torch.randn(b, hkv, sk, d, dtype=dtype, device=device)
            out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True)
            ref = reference.attention(q, k, v, causal=causal, dtype=torch.float64)
            pt = reference.attention(q, k, v, causal=causal, dtype=dtype)
            err = (out.double() - ref.out).abs().max().item()
            pt_err = (pt.out.double() - ref.out).abs().max().item()
            finite = torch.isfinite(ref.lse)
            lse_err = (lse.double() - ref.lse)[finite].abs().max().item()
            ok = err <= 2 * pt_err + torch.finfo(dtype).eps * ref.out.abs().max().item()
            failures += not ok
            shape = f"({b},{h},{hkv},{sq},{sk},{d})"
            name = str(dtype).removeprefix("torch.").replace("float", "fp").replace("bfp", "bf")
            row = f"{shape:<28}{causal!s:>7}{name:>6}{err:>10.2e}{pt_err:>10.2e}{lse_err:>10.2e}"
            print(row + f"{'yes' if ok else 'NO':>4}")
    print("all within FlashAttention's error rule" if not failures else f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
