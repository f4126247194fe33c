"""Driver for scripts/sanitize.sh: FlashCore's kernels on small shapes, for compute-sanitizer.

Runs the forward and the backward (unless ``--no-backward``) on every case of
``tests/shapes.py``'s SANITIZE tier (``--mla``: SANITIZE_MLA, v at its own head dim;
``--varlen``: SANITIZE_VARLEN, packed batches through ``attention_varlen``; ``--cases`` some of
them by index; ``--deal``: SANITIZE_DEAL, the Hopper forward's dynamically dealt causal grid,
forward only, in place of the others), for each dtype, both masks and each set of score
options (``--options``: none by default; softcap, ALiBi, a window, a window with softcap, which
the Hopper kernels build as their own variants), cycling through the memory layouts;
``--head-dims`` keeps the cases of the head dims given. Each result is checked against the
float64 reference computed on the CPU, so the sanitized process runs FlashCore's kernels and a
few PyTorch fills and copies, no cuBLAS. Every CUDA tensor is released before exit, so memcheck's
leak check sees only what leaked for real.

Exits 1 when a result is wrong (the sanitizer's --error-exitcode reports memory errors).
``--device cpu`` with TRITON_INTERPRET=1 runs the same cases through the interpreter (a smoke test
of this script; slow).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import sys
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import flashcore
from helpers import (
    alibi_slopes,
    check_forward,
    check_grads,
    check_varlen_results,
    make_qkv,
    make_varlen,
    record_backward_tiers,
    record_sm90_forwards,
    run_varlen,
)
from shapes import (
    DTYPES,
    SANITIZE,
    SANITIZE_DEAL,
    SANITIZE_MLA,
    SANITIZE_MLA_DV,
    SANITIZE_VARLEN,
    Case,
    VarlenCase,
)

LAYOUTS = ["bhsd", "bshd", "sliced"]

# Score options by name. The window is causal (left, 0) under a causal mask and two-sided
# otherwise; softcap 5 bends scores of unit-variance inputs (30 would leave them nearly linear).
OPTIONS = ("none", "softcap", "alibi", "window", "window-softcap")


def score_options(name: str, case: Case | VarlenCase, causal: bool, device: str) -> dict:
    opts: dict = {}
    if "window" in name:
        opts["window"] = (7, 0) if causal else (7, 5)
    if "softcap" in name:
        opts["softcap"] = 5.0
    if name == "alibi":
        opts["alibi_slopes"] = alibi_slopes(case.heads, None, device)
    return opts


def tiers_ran(monkeypatch) -> dict:
    """Lists that gain an entry per launch, by tier, through the tests' recorders (the quick
    paths, which a repeated signature would take around them, are off): the forward "sm90" or
    else "portable" (``attention`` runs one of the two), the backward "sm90" or "portable" (its
    kernels; head dim 256's or MLA's backward leaves it empty)."""
    forwards = record_sm90_forwards(monkeypatch)
    return {"sm90 forwards": forwards, "bwd": record_backward_tiers(monkeypatch)}


def tiers_label(ran: dict, backward: bool) -> str:
    label = "fwd " + ("sm90" if ran["sm90 forwards"] else "portable")
    if backward:
        label += ", bwd " + ("+".join(sorted(set(ran["bwd"]))) or "other")
    return label


def run_case(
    case: Case,
    dtype: torch.dtype,
    causal: bool,
    layout: str,
    backward: bool,
    device: str,
    options: str = "none",
    head_dim_v: int | None = None,
) -> None:
    qkv = make_qkv(case, dtype, device, layout=layout, head_dim_v=head_dim_v)
    q, k, v = (t.requires_grad_(backward) for t in qkv)
    masks = score_options(options, case, causal, device)
    out, lse = flashcore.attention(q, k, v, causal=causal, return_lse=True, **masks)
    grads = None
    if backward:
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    if device != "cpu":
        torch.cuda.synchronize(device)  # a launch error shows here, attributed to this case
    cpu = [t.detach().cpu() for t in (q, k, v)]
    masks = {key: val.cpu() if torch.is_tensor(val) else val for key, val in masks.items()}
    check_forward(out.detach().cpu(), lse.cpu(), *cpu, causal=causal, **masks)
    if grads is not None:
        named = {name: g.cpu() for name, g in zip("qkv", grads, strict=True)}
        check_grads(named, *cpu, dout.cpu(), causal=causal, **masks)


def run_varlen_case(
    case: VarlenCase,
    dtype: torch.dtype,
    causal: bool,
    backward: bool,
    device: str,
    options: str = "none",
) -> None:
    """One packed batch through ``attention_varlen`` (and its gradients through out and lse),
    checked on the CPU against the per-sequence float64 reference."""
    q, k, v, cu_q, cu_k = make_varlen(case, dtype, device)
    q, k, v = (t.requires_grad_(backward) for t in (q, k, v))
    masks = score_options(options, case, causal, device)
    out, lse, grads, dout, dlse = run_varlen(case, q, k, v, cu_q, cu_k, causal=causal, **masks)
    if device != "cpu":
        torch.cuda.synchronize(device)

    def cpu(t):
        return None if t is None else t.detach().cpu()

    masks = {key: cpu(val) if torch.is_tensor(val) else val for key, val in masks.items()}
    check_varlen_results(
        *(cpu(t) for t in (q, k, v, cu_q, cu_k, out, lse)),
        None if grads is None else [cpu(g) for g in grads],
        cpu(dout),
        cpu(dlse),
        causal=causal,
        **masks,
    )


def run_on_tier(tier: str, run, backward: bool, *args) -> str:
    """``run(*args)`` (``run_case`` or ``run_varlen_case``) under ``flashcore.use_tier(tier)``;
    returns the label of the tiers it ran."""
    with flashcore.use_tier(tier), pytest.MonkeyPatch.context() as patch:
        ran = tiers_ran(patch)
        run(*args)
    return tiers_label(ran, backward)


def attempt(label: str, run) -> bool:
    """Run one case (``run()`` returns the tiers' label), print its line; whether it passed."""
    try:
        tiers = run()
    except Exception:  # report every case, then fail
        print(f"FAIL {label}\n{traceback.format_exc()}", flush=True)
        return False
    print(f"ok   {label} [{tiers}]", flush=True)
    return True


def run_deal_case(case: Case, dtype: torch.dtype, device: str, head_dim_v: int | None) -> str:
    """One ``SANITIZE_DEAL`` case (v at ``head_dim_v``): the causal forward on the Hopper tier,
    which must deal its persistent grid dynamically (``ops.fwd_sm90_configs.dynamic_deal``), checked
    against the float64 reference; returns the tier's label."""
    from flashcore.ops import fwd_sm90_configs

    dealt = []
    real = fwd_sm90_configs.dynamic_deal

    def spy(*args, **kwargs):
        dealt.append(real(*args, **kwargs))
        return dealt[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fwd_sm90_configs, "dynamic_deal", spy)
        q, k, v = make_qkv(case, dtype, device, head_dim_v=head_dim_v)
        with flashcore.use_tier("sm90"):
            out, lse = flashcore.attention(q, k, v, causal=True, return_lse=True)
        torch.cuda.synchronize(device)
    if not any(dealt):
        raise AssertionError(f"{case.id}: the forward's grid was not dealt dynamically")
    cpu = [t.cpu() for t in (q, k, v)]
    check_forward(out.cpu(), lse.cpu(), *cpu, causal=True)
    return "fwd sm90"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dtypes", default=",".join(DTYPES), help="comma-separated: fp16,bf16,fp32"
    )
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument(
        "--tier",
        default="auto",
        choices=["auto", "portable", "sm90"],
        help="flashcore.use_tier for every case (sm90: the Gluon kernels wherever they run, "
        "which 'auto' leaves to longer problems than these)",
    )
    parser.add_argument(
        "--options",
        default="none",
        help=f"comma-separated score options, each run on every case: {', '.join(OPTIONS)}",
    )
    parser.add_argument(
        "--head-dims", default="", help="comma-separated: only the cases of these head dims"
    )
    parser.add_argument(
        "--mla",
        action="store_true",
        help=f"the MLA cases instead (q and k at 192, v at {SANITIZE_MLA_DV}; tests/shapes.py)",
    )
    parser.add_argument(
        "--varlen",
        action="store_true",
        help="the SANITIZE_VARLEN cases instead: packed batches through attention_varlen "
        "(tests/shapes.py)",
    )
    parser.add_argument(
        "--cases", default="", help="comma-separated indices into the case list: only those"
    )
    parser.add_argument(
        "--deal",
        action="store_true",
        help="the SANITIZE_DEAL cases instead: the Hopper forward's dynamically dealt causal "
        "grid, forward only (tests/shapes.py)",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to smoke-test")
    parser.add_argument(
        "--no-tma",
        action="store_true",
        help="forward through plain pointers, not tensor descriptors (for initcheck, which does "
        "not see the bulk-copy engine's stores and reports every later read of them)",
    )
    args = parser.parse_args(argv)
    options = args.options.split(",")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        parser.error(f"--options: unknown {unknown}; known: {', '.join(OPTIONS)}")
    if args.deal and (args.mla or args.varlen or args.cases or args.device == "cpu"):
        parser.error(
            "--deal: the Hopper forward's own cases, on a GPU, without --mla, --varlen or --cases"
        )
    if args.mla and args.varlen:
        parser.error("--mla and --varlen: one case list at a time (SANITIZE_VARLEN has MLA's)")
    try:
        head_dims = {int(d) for d in args.head_dims.split(",") if d}
    except ValueError:
        parser.error(f"--head-dims: integers separated by commas, not {args.head_dims!r}")
    cases = SANITIZE_MLA if args.mla else SANITIZE_VARLEN if args.varlen else SANITIZE
    try:
        picked = {int(c) for c in args.cases.split(",") if c}
    except ValueError:
        parser.error(f"--cases: integers separated by commas, not {args.cases!r}")
    if not picked <= set(range(len(cases))):
        parser.error(f"--cases: indices 0..{len(cases) - 1}, not {sorted(picked)}")
    if args.no_tma:
        from flashcore.ops import runtime

        runtime.has_tma = lambda device: False
    else:
        # These shapes are small enough that the forward would take plain pointers
        # (tuning.TMA_MIN_FLOPS): force descriptors wherever the layout allows, so memcheck and
        # racecheck see the descriptor path (the "sliced" layout still takes pointers).
        from flashcore import tuning

        tuning.TMA_MIN_FLOPS = 0
    if args.device != "cpu" and not torch.cuda.is_available():
        print("sanitize_cases: needs a CUDA device", file=sys.stderr)
        return 2
    on_gpu = args.device != "cpu"
    backward = not (args.no_backward or args.deal)
    where = torch.cuda.get_device_name(args.device) if on_gpu else "CPU (interpreter)"
    print(f"flashcore {flashcore.__version__} on {where}; "
          f"backward: {'yes' if backward else 'no (forward only)'}; tier: {args.tier}")  # fmt: skip
    # (label, run) for every case: run() checks it and returns the label of the tiers it ran.
    jobs = []
    if args.deal:
        for case, dv in SANITIZE_DEAL:
            for dtype_name in args.dtypes.split(","):
                run = functools.partial(run_deal_case, case, DTYPES[dtype_name], args.device, dv)
                jobs.append((f"{case.id} {dtype_name} causal dealt", run))
    head_dim_v = SANITIZE_MLA_DV if args.mla else None
    for i, case in enumerate([] if args.deal else cases):
        if head_dims and case.head_dim not in head_dims:
            continue
        if picked and i not in picked:
            continue
        layout = "packed" if args.varlen else LAYOUTS[i % len(LAYOUTS)]
        for dtype_name, causal, opt in itertools.product(
            args.dtypes.split(","), (False, True), options
        ):
            label = f"{case.id} {dtype_name} {'causal' if causal else 'full'} {layout}"
            if head_dim_v is not None:
                label += f" dv{head_dim_v}"
            if opt != "none":
                label += f" {opt}"
            dtype = DTYPES[dtype_name]
            if args.varlen:
                args_ = (run_varlen_case, backward, case, dtype, causal, backward, args.device, opt)
            else:
                args_ = (run_case, backward, case, dtype, causal, layout, backward, args.device,
                         opt, head_dim_v)  # fmt: skip
            jobs.append((label, functools.partial(run_on_tier, args.tier, *args_)))
    failures = 0
    for n, (label, run) in enumerate(jobs, 1):
        torch.manual_seed(n)  # each case's inputs the same on every run
        failures += not attempt(label, run)
        gc.collect()
    gc.collect()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print(f"sanitize_cases: {len(jobs) - failures}/{len(jobs)} cases right")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
