"""Block, warp and pipeline-depth choices for the kernels.

Each choice is a frozen dataclass so it can key caches and print in reports. Heuristics that pick
a config say, next to the choice, which measurement justifies it (docs/performance*.md have the
runs).

The device's compute capability is an input. Every timed table here is an H100 (sm_90)
measurement. Other GPUs: sm_90 and newer take the same tables (untimed beyond the H100); GPUs
before Hopper (sm_8x: A100, Ada) have no tensor descriptors and 100-164 KB of shared memory a
block, so they get ``PRE_HOPPER`` tiles that fit 99 KB with two pipeline stages, a starting point
from Triton's Ampere flash-attention tutorial that has not been timed here (no such GPU is lent).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class FwdConfig:
    """Launch configuration of the forward kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = True
    """Move tiles with tensor descriptors (Hopper's bulk-copy engine) where alignment allows."""


HOPPER = (9, 0)


def _pre_hopper_fwd(block_d: int) -> FwdConfig:
    """Half-precision forward tiles before Hopper (module docstring: untimed)."""
    if block_d <= 64:
        return FwdConfig(128, 64, 4, 3, use_tma=False)
    if block_d <= 128:
        return FwdConfig(128, 64, 8, 2, use_tma=False)
    return FwdConfig(64, 32, 4, 2, use_tma=False)


# The interpreter runs every program in numpy on the CPU: tiles small enough that odd lengths
# (45, 77, 83, 129) cover several blocks in both directions, and BLOCK_M != BLOCK_N so the causal
# diagonal crosses tile borders at every alignment.
INTERPRETER_FWD = FwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)


def head_block(head_dim: int) -> int:
    """Head dim padded to the power of two the kernels tile with (at least 16 for tl.dot)."""
    return max(16, 1 << (head_dim - 1).bit_length())


# Below this many FLOPs a forward moves its tiles with plain pointers, not tensor descriptors.
# Descriptors make the kernel 3-20% faster on the GPU (D=64: 3-6%, D=128: 10-20%) but cost the
# host 55-70 us a call on the H100 machine (four TensorDescriptor objects, and Triton encoding
# each into a tensor map at launch): (1, 8, 512, 64) causal took 28.4 us a call with them, 12.7
# without (do_bench). 2**34 FLOPs is about 40 us of kernel time, under the ~50-70 us the host
# needs for a call even without descriptors, so below it the host sets the pace either way
# (docs/performance_host.md, "Descriptors or pointers").
TMA_MIN_FLOPS = 2**34


def fwd_config(
    head_dim: int,
    elem_size: int,
    *,
    interpreted: bool,
    seqlen_q: int = 1 << 30,
    causal: bool = False,
    flops: float = float("inf"),
    capability: tuple[int, int] = HOPPER,
    graph: bool = False,
) -> FwdConfig:
    """Forward config for a padded head dim, element size in bytes, query length and mask.

    Starting points from the Triton Hopper flash-attention tutorial's search space; tuned per
    shape class in docs/performance.md. ``seqlen_q`` (the longest query sequence) and ``causal``
    pick smaller tiles for short causal problems; the defaults give the long-sequence config.
    ``flops`` (``4 * B * H * Sq * Sk * D``, halved when causal) at or below ``TMA_MIN_FLOPS``
    is a small problem: its own tiles, and no tensor descriptors unless ``graph`` (a call
    captured into a CUDA graph, whose replay costs the host nothing: there descriptors are
    faster at every size measured, docs/performance_host.md).
    """
    if interpreted:
        return INTERPRETER_FWD
    if capability < HOPPER and elem_size < 4:
        return _pre_hopper_fwd(head_block(head_dim))
    small = flops <= TMA_MIN_FLOPS
    cfg = _fwd_tiles(head_block(head_dim), elem_size, seqlen_q, causal, small)
    return replace(cfg, use_tma=False) if small and not graph else cfg


def _fwd_tiles(block_d: int, elem_size: int, seqlen_q: int, causal: bool, small: bool) -> FwdConfig:
    if elem_size >= 4:
        # fp32 tiles are twice the bytes and the IEEE dot is FMAs, not wgmma: keep tiles small.
        # At 64x32 with D=128 ptxas spilled 11.8 KB per thread (tests/sm90_compile.py). No TMA:
        # with the fp64 P @ V sum (common.pv_start) the TMA variants spilled 5.5-17 KB and ran
        # up to 4.7x slower than pointer loads (H200, docs/performance.md "fp32 accuracy").
        if block_d <= 64:
            return FwdConfig(64, 32, 4, 2, use_tma=False)
        return FwdConfig(32, 32, 4, 1, use_tma=False)
    # Picked from scripts/fwd_sweep.py on the H100 (fp16, the tables are in docs/performance.md):
    # the fastest config of each head-dim class at S=4096, and for short problems the fastest
    # replayed from CUDA graphs (``--graph``) at S=512-2048: with 128-row tiles a 2048-long causal
    # sequence at B*H=16 gives 256 programs of 1-16 tile pairs, too few to balance on 132 SMs.
    short_causal = causal and seqlen_q <= 2048
    if block_d <= 64:
        if short_causal:
            # S=2048 (B2 H8): 244 vs 202 TF/s; S=1024 (B4 H16): 241 vs 226; S=512: 37 vs 32.
            return FwdConfig(64, 64, 4, 3)
        if seqlen_q <= 512 and small:
            # S=512, B1 H8: 81 vs 56 TF/s (7 vs 10 us); at B64 H32 (not small) 298 vs 326.
            return FwdConfig(64, 128, 4, 3)
        return FwdConfig(128, 64, 8, 3)  # 404 TF/s non-causal, 376 causal (D=64, S=4096)
    if block_d <= 128:
        if short_causal or seqlen_q <= 512:
            # causal S=2048 (B2 H8): 313 vs 281 TF/s, S=1024: 311 vs 266; non-causal S=512:
            # 371 vs 353.
            return FwdConfig(64, 64, 4, 3)
        return FwdConfig(128, 128, 8, 3)  # 463 / 407 TF/s (D=128, S=4096)
    return FwdConfig(128, 64, 8, 2)  # 482 / 391 TF/s (D=256)


@dataclass(frozen=True)
class BwdConfig:
    """Launch configuration of the backward kernels.

    ``block_m1 x block_n1``: the dK/dV kernel (``num_warps``, ``num_stages``) holds a block_n1-row
    K/V tile and streams block_m1-row query tiles. ``block_m2 x block_n2``: the dQ kernel
    (``dq_warps``, ``dq_stages``; it also computes delta) holds a block_m2-row query tile and
    streams block_n2-row key tiles. The held tile is the larger one, as
    in FlashAttention-2: it amortises the streamed loads, while the fp32 accumulators
    (2 x block_n1 x D for dK/dV, block_m2 x D for dQ) bound it from above.
    """

    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    num_warps: int
    num_stages: int
    num_warps2: int | None = None
    """Warps of the dQ kernel (None: ``num_warps``)."""
    num_stages2: int | None = None
    """Pipeline stages of the dQ kernel (None: ``num_stages``)."""

    @property
    def dq_warps(self) -> int:
        return self.num_warps if self.num_warps2 is None else self.num_warps2

    @property
    def dq_stages(self) -> int:
        return self.num_stages if self.num_stages2 is None else self.num_stages2


# Non-square tiles in both kernels so that odd lengths (17, 45, 77, 83) span several tiles both ways
# and the causal diagonal crosses tile borders; each kernel holds the larger tile, as on the GPU.
INTERPRETER_BWD = BwdConfig(
    block_m1=16, block_n1=32, block_m2=32, block_n2=16, num_warps=4, num_stages=1
)


def bwd_config(
    head_dim: int,
    elem_size: int,
    *,
    interpreted: bool,
    causal: bool = False,
    seqlen_q: int = 1 << 30,
    capability: tuple[int, int] = HOPPER,
    head_dim_v: int | None = None,
    panels: bool = False,
) -> BwdConfig:
    """Backward config for a padded head dim (the wider of Q/K's and V's), element size in
    bytes, mask and (longest) query length; ``head_dim_v``: V's head dim when it differs;
    ``panels``: Q and K tiled in two column panels (``ops/bwd.py: d_panels``).

    Half precision: each kernel's config picked on its own (the two are separate launches, so the
    fastest pair is the fastest of each) by ``scripts/bwd_kernel_sweep.py`` on the H100, fp16,
    S = 1024, 4096 and 8192, causal and not (docs/performance_backward.md, "Backward configs per
    kernel").
    """
    if interpreted:
        return INTERPRETER_BWD
    block_d = head_block(head_dim)
    if elem_size >= 4:
        # IEEE fp32 inputs: the score products and the gradient sums on the fp64 tensor cores
        # (kernels/common.py: dot_nt, sum_dot), small tiles, one stage. 32x32 for dK/dV: with
        # the fp64 sums, 16x64 ran 1.06-1.29x slower (H200, D 64/128; docs/performance.md).
        if block_d <= 128:
            return BwdConfig(32, 32, 64, 16, 8, 1)
        return BwdConfig(16, 32, 16, 16, 8, 1)
    if capability < HOPPER and block_d <= 128:
        # Before Hopper (module docstring: untimed): the short-sequence sm_90 tiles, two stages.
        return BwdConfig(64, 64, 64, 64, 4, 2)
    if block_d <= 64:
        # dK/dV 64x64, 4 warps (non-causal 3 stages); dQ 128x64, 8 warps, 3 stages. Interleaved
        # A/B against 64x64, 4 warps, 2 stages in both kernels, bf16, 16k tokens: 2.03 vs 2.16 ms
        # (S=2048), 7.91 vs 8.47 (8192), 15.6 vs 17.1 (16384); causal 1.22 vs 1.25, 4.36 vs
        # 4.43, 8.58 vs 8.74.
        return BwdConfig(64, 64, 128, 64, 4, 2 if causal else 3, 8, 3)
    if block_d <= 128:
        # dQ 128x128, 8 warps (249 registers, no spills): interleaved A/B against the 64x64 4-warp
        # tile both kernels used before, bf16, 16k tokens: 1.88 vs 1.90 ms (S=2048), 6.97 vs
        # 7.23 (8192), 14.47 vs 14.47 (16384). Causal also takes dK/dV 64x128, 8 warps:
        # 1.16 vs 1.21, 3.85 vs 4.04, 7.59 vs 7.90 ms.
        # Causal up to 1024 queries keeps 64x64 tiles, 4 warps in both kernels: the FA sweep's
        # S=512 point ran 0.97-0.98x SDPA with the larger tiles, 1.03-1.04x with these (fewer,
        # larger programs leave SMs idle), and the dQ 64x64 tile was the fastest at S=1024.
        if causal and seqlen_q <= 1024:
            return BwdConfig(64, 64, 64, 64, 4, 2)
        if causal:
            return BwdConfig(64, 128, 128, 128, 8, 2, 8, 2)
        return BwdConfig(64, 64, 128, 128, 4, 2, 8, 2)
    if capability >= HOPPER and head_dim_v is not None and head_block(head_dim_v) <= 128:
        # MLA (Q/K 192, padded to 256 in the kernels; V 128): dK/dV 32x128, 8 warps; dQ 128x64,
        # 8 warps; both 2 stages. scripts/bwd_kernel_sweep.py --shape 2,16,4096,192:128 (H100,
        # fp16, each kernel timed alone over 12 dK/dV and 11 dQ candidates): 2.90 ms against
        # 5.31 for the D=256 tiles below non-causal (308 against 168 TFLOP/s), 1.53 against 2.78
        # causal; the same pair was the fastest both ways.
        if panels:
            # Q/K in 128 + 64 column panels (192): the same tiles fit a third stage (dQ 205 KB of
            # shared memory, 222 registers; dK/dV non-causal 144 KB, 245, no spills). H100, bf16,
            # (2, 16, 4096) and (1, 16, 8192), rotated rounds in one process: 375-391 TFLOP/s
            # non-causal against 330-336 with two stages each and 309-315 in one 256-wide tile;
            # causal 310-342 against 293-325 in one tile, where a third dK/dV stage measured
            # slower (282-309) (docs/performance_features.md, "MLA backward in column panels").
            return BwdConfig(32, 128, 128, 64, 8, 2 if causal else 3, 8, 3)
        return BwdConfig(32, 128, 128, 64, 8, 2, 8, 2)
    # D=256: dK/dV 32x32, 4 warps: 4.98 vs 8.19 ms (16x64, 8 warps, the earlier untimed pick;
    # S=4096 non-causal); dQ 128x32, 8 warps: 1.98 vs 4.39 ms. Backward 1.8x faster.
    return BwdConfig(32, 32, 128, 32, 4, 2, 8, 2)


# The Hopper backward (ops/bwd_sm90.py) under the "auto" tier: from these many queries and keys
# on. H100, bf16, 32k tokens (scripts/hopper_bwd.py bench, docs/performance_backward.md): the
# kernel runs 1.13-1.31x the portable backward at D=128 from S = 1024 on, 1.04-1.20x at D=64
# except causal S = 1024 (0.98x). Through autograd (flashcore-bench --mode bwd, the FA sweep's
# shapes, two runs, after the leaner launch path; docs/performance_backward.md, "Shorter
# sequences on the Hopper backward"): D=128 non-causal 1.15x at S = 512 and 1.22x at 1024, causal
# 1.15x at 1024 but 0.96x at 512; D=64 non-causal 1.05x at 1024 but 0.68-0.91x at 512, causal
# 0.96x at 1024 and 0.85x at 512. With dQ on a warpgroup of its own at D=64 (docs/
# performance_backward.md, "dQ on a warpgroup of its own", two runs): causal 1.05x at 1024,
# 0.91x at 512; non-causal 0.97x at 512; a window (256, 0) 1.01-1.05x at 2048 and 8192. Since
# then K and V as register operands at D=64, dQ beside dK and the dQ conversion kernel; H200,
# bf16, the FA sweep's shapes through autograd (flashcore-bench --providers
# flashcore-portable,flashcore-sm90, two runs; docs/performance_backward.md, "The dQ conversion
# and the short floors"): Hopper / portable at 512 1.16x (D=64), 1.08-1.09x (D=64 causal),
# 1.28x (D=128), 1.13-1.14x (D=128 causal); at 1024 1.22-1.33x. So every dense problem from 512
# on, whatever its head dim or mask (the H100 was not measured again).
SM90_BWD_MIN_SEQLEN = 512
# Packed (varlen) batches, judged by their mean lengths, from these floors on. H100, bf16, 16
# heads, about 32k tokens of lengths uniform in [m/2, 3m/2] for a mean m (scripts/
# varlen_bench.py --mode bwd --set short, both tiers through autograd in one process, two
# rounds, two device calls; docs/performance_backward.md, "The Hopper backward under auto:
# packed floors and the host's cost"), Hopper / portable speed: D=128 non-causal 1.07x at a
# mean of 128, 1.36-1.37x at 256, 1.64-1.66x at 511; causal 0.85x at 128, 0.98x at 256, 1.10x
# at 511; D=64 (first call) non-causal 0.77x at 128, 1.00x at 256, 1.24x at 511; causal 0.79x
# at 128, 0.93x at 256, 1.04x at 511. So D=128 non-causal from 256 on, and the others from
# 384, between the means where the tiers were level and where the Hopper one led. (The dense
# floors above came from the FA sweep's 16k-token batches through autograd, where the host's
# cost still shows.)
SM90_BWD_MIN_SEQLEN_VARLEN_D128 = 256
SM90_BWD_MIN_SEQLEN_VARLEN_D128_CAUSAL = 384
SM90_BWD_MIN_SEQLEN_VARLEN_D64 = 384
# An eager call takes the Hopper backward from this much work on (``sm90_backward_work``: the
# forward's 4 B H Sq Sk D, halved for causal, plus what the kernel's grid spends besides). Its
# host path costs about twice the portable one's (three launches, the main one carrying nine
# tensor maps, the dQ conversion, the fp32 buffers): 432 against 216 us a call on the H100
# machine's host at (1, 4, 256, 128), so a smaller problem, whose kernels take less than that,
# runs at the host's pace. H100, bf16, autograd.grad of one forward through each tier, three
# rounds in one process (scripts/bwd_tier_floor.py), sm90 / portable time: D=128 (1, 16, 1024)
# 1.22x and causal 1.21x, (2, 16, 1024) 1.52x / 2.11x, (1, 16, 2048) 1.37x / 1.72x, (2, 16,
# 2048) 1.03x / 1.27x, (4, 16, 2048) 0.77x / 0.74x, (1, 32, 4096) on 8 kv heads 0.75x / 0.57x;
# D=64 (2, 8, 2048) 1.61x / 1.70x, (4, 16, 2048) non-causal 1.55x, (8, 16, 2048) 0.81x, (4, 32,
# 1024) 0.96x / 1.29x; packed batches of 4k tokens 1.7-3.3x. Captured into a CUDA graph only the
# kernels count, and there the Hopper backward was ahead at every size measured from the length
# floors on (flashcore-bench --cuda-graph --mode fwdbwd, graph ms per forward + backward, each on
# one tier, sm90 / portable: D=128 (1, 16, 1024) 0.92x and causal 0.86x, (2, 8, 2048) 0.78x /
# 0.55x; D=64 (2, 8, 2048) 0.87x / 0.59x, (1, 32, 1024) 0.96x / 0.71x), so a capture has no
# floor.
# Since the quick backwards (ops/bwd.py: a repeated signature's launches kept and called below
# the launcher), the Hopper path's host cost a call fell from 134-224 to 42-75 us and the
# portable one's from 77-114 to 40-64 (H200 machine, bwd.launch with an idle GPU, medians of six
# rounds; docs/performance_host.md, "Quick backwards"), and the floor came down from 6e10 to
# 3e10: scripts/bwd_tier_floor.py, one H200 call, bf16, sm90 / portable time with both quick:
# 0.97-1.32x (median 1.06) at 17 problems of 1e9-2.1e10 work, 1.00x at 2.5e10 ((4, 16, 1024,
# 128) causal), 0.59-0.74x at 3.7e10-7.4e10 ((2, 8, 2048, 128), (4, 16, 1024, 128), (2, 16,
# 2048, 128) causal and not).
SM90_BWD_MIN_FLOPS = 3e10
SM90_BWD_MIN_FLOPS_GRAPH = 0.0
# What a program of the Hopper backward (one 128-key block of one kv head) costs besides its
# steps, in steps of 64 query rows: 9000-11000 clocks of launch, setup, the first K/V load and
# the tail (the last dQ, the dK/dV stores), two to three steps' time (H200 trace, docs/
# performance_backward.md, "Where a program's time goes outside its steps"). Many short programs
# make the kernels' time outgrow the FLOP count: H200, bf16, scripts/bwd_tier_floor.py, two
# device calls, sm90 / portable time at 3.4e10 FLOPs: (32, 16, 512, 128) causal 0.98x / 0.88x
# and (32, 32, 512, 64) causal 0.93x / 0.97x (2048-4096 programs; this work 6.4e10), against
# (2, 16, 2048, 128) causal 1.13x and (2, 8, 2048, 128) 1.63x (128-512 programs; 3.7-4.2e10);
# every problem measured from 6.1e10 of this work on was 0.72-0.98x (20 of 20); under 5e10 9 of
# 12 were 1.02-1.91x (docs/performance_backward.md, "The eager floor counts programs").
SM90_BWD_PROGRAM_STEPS = 2.5


def sm90_backward_work(
    batch: int,
    heads: int,
    kv_heads: int,
    seqlen_q: float,
    seqlen_k: float,
    head_dim: int,
    causal: bool,
    rows: int,
    keys: int,
) -> float:
    """The Hopper backward's work in the forward's FLOP count, as its grid does it: the products
    (``4 B H Sq Sk D``, halved for causal), ``SM90_BWD_PROGRAM_STEPS`` steps of ``rows`` query
    rows for each program (``keys`` keys of one kv head) and, causal, one more step for each
    query head's key block (its diagonal tile, computed whole). Packed batches pass their mean
    lengths."""
    step = 4.0 * rows * keys * head_dim
    blocks = -(-seqlen_k // keys)
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim / (2 if causal else 1)
    steps = batch * blocks * (kv_heads * SM90_BWD_PROGRAM_STEPS + (heads if causal else 0))
    return flops + steps * step


def sm90_backward(
    seqlen_q: float,
    seqlen_k: float,
    head_dim: int,
    work: float,
    causal: bool = False,
    graph: bool = False,
    *,
    varlen: bool = False,
) -> bool:
    """Whether "auto" takes the Hopper backward for this problem (where it measured faster);
    ``work``: its FLOPs as ``sm90_backward_work`` counts them; ``graph``: the call is being
    captured into a CUDA graph (the kernels' time alone counts); ``varlen``: a packed batch,
    whose lengths are its mean ones. A sliding window measured 1.01-1.05x the portable backward
    at D=64 (S = 2048, 8192) and 1.09-1.14x at D=128; softcap 1.29-1.56x, ALiBi 1.00-1.34x
    (docs/performance_backward.md): none of them changes the choice."""
    if work < (SM90_BWD_MIN_FLOPS_GRAPH if graph else SM90_BWD_MIN_FLOPS):
        return False
    if not varlen:
        floor = SM90_BWD_MIN_SEQLEN
    elif head_dim == 128:
        floor = (
            SM90_BWD_MIN_SEQLEN_VARLEN_D128_CAUSAL if causal else SM90_BWD_MIN_SEQLEN_VARLEN_D128
        )
    else:
        floor = SM90_BWD_MIN_SEQLEN_VARLEN_D64
    return min(seqlen_q, seqlen_k) >= floor


# The Hopper forward (kernels/hopper/fwd.py) under "auto". H100, bf16, the FA sweep's shapes,
# scripts/hopper_fwd.py bench and flashcore-bench (docs/performance.md, docs/hopper_fwd.md):
# - D=128: 1.04-1.26x the portable forward from S = 1024 on (one causal 1024 point 0.92 in one
#   run), 0.96-1.08x cuDNN from 2048 on; at S = 512 (persistent) 1.30x the portable forward
#   non-causal and 1.10x causal (0.99x and 0.85x cuDNN; before the K/V release fix it was
#   0.72-1.09x the portable one).
#   Since then, causal D=128 at S <= 512 takes one consumer a CTA and two CTAs an SM
#   (ops/fwd_sm90_configs.py: ONE; before it, 64-key tiles with two consumers at 0.92-0.94x cuDNN).
# - D=64, two consumer warpgroups (persistent at these lengths): 1.04-1.10x the portable forward
#   non-causal at S = 512, about equal at 1024; causal 1.04x at 2048, equal at 1024, 0.84x at
#   512. Three consumer warpgroups (ops/fwd_sm90_configs.py: pick_config): 1.06-1.12x cuDNN
#   non-causal from S = 2048 on; causal from 4096 on 1.01-1.11x the two-consumer kernel
#   (0.94-1.11x cuDNN). (Causal ones on few heads later took one consumer a CTA:
#   fwd_sm90_configs.three_consumers_fill.)
# The window, softcap and ALiBi variants were checked for numerics but not timed, so they stay
# portable under "auto".
# Host cost: an eager forward through attention() costs 87 us of host time a call on this tier
# against 54 us on the portable one (H100 machine, (1, 4, 256, 128) bf16, best of 5 x 3000 calls,
# after the leaner launch path; 140-165 against 80-100 before it), so a problem whose kernel takes
# less than that stays portable: below SM90_FWD_MIN_FLOPS (about 110 us at the 265 TFLOP/s the
# sweep's smallest causal D=128 point runs at; its points at S = 512 have 6.9e10 FLOPs, 3.4e10
# causal). Through flashcore-bench (two runs, bf16, the sweep's shapes) the tier ran 1.07x the
# portable forward at D=128 causal S = 512 and 1.04-1.05x at D=64 causal S = 1024, 0.86x at D=64
# causal S = 512.
SM90_FWD_MIN_SEQLEN = 512
SM90_FWD_MIN_SEQLEN_D64 = 512
# Causal D=64 up to 1024 queries and keys runs one consumer a CTA, two CTAs an SM
# (ops/fwd_sm90_configs.py: ONE): at the FA sweep's batch 249 TFLOP/s against the portable forward's
# 220 at S = 512 and 298 against 287 at 1024, and 275 against 202 at (2, 16, 1024) (H100, bf16,
# CUDA-graph replays, three rounds in one process), so it takes the same floor as non-causal.
# The MLA head dims (Q/K 192, V 128; ops/fwd_sm90.py: MLA_HEAD_DIMS): at 4096 and 8192 (H100,
# bf16, one run, scripts/feature_bench.py --cases mla) 1.84-1.95x the portable forward, 1.11-1.17x
# SDPA; from 512 on (H200, bf16, 16k tokens of 16 heads, three rounds, with the persistent causal
# grid) 1.72-1.83x non-causal and 1.74-1.96x causal, level with or ahead of SDPA (0.99-1.18x).
SM90_FWD_MIN_SEQLEN_MLA = 512
# Eagerly, the MLA head dims take the Hopper forward from fewer FLOPs than SM90_FWD_MIN_FLOPS: the
# portable forward runs them at about half the rate, so its kernel outlasts the Hopper tier's
# extra host cost sooner. H200, bf16, 16 heads, wall time per eager call (loops of 200 calls, one
# synchronise; us, portable / Hopper / SDPA; FLOPs as counted here): (16, 16, 512) causal, 2.6e10,
# 122 / 68 / 72; (8, 16, 512) 2.6e10, 86 / 72 / 51; (2, 16, 1024) 2.6e10, 74 / 70 / 41; at 1.3e10
# 69 / 67 / 42, 54 / 67 / 26 and 66 / 69 / 39; below it the portable tier's host floor (52-55
# against 65-70) wins.
SM90_FWD_MIN_FLOPS_MLA = 2e10
# Head dim 256 (ops/fwd_sm90.py: WIDE_HEAD_DIMS, 64-key tiles, flat): timed at 1024, 4096 and
# 16384 (H100, bf16, two runs, 32k tokens, scripts/hopper_fwd.py bench --head-dims 256): 1.25-1.33x
# the portable forward non-causal (0.98-1.13x cuDNN), 1.13-1.24x causal (0.92-0.99x cuDNN). At
# 512 and 256 (H200, bf16, flashcore-bench --providers flashcore-portable,flashcore-sm90,sdpa,
# TFLOP/s portable / Hopper / SDPA): (32, 16, 512, 256) 362 / 558 / 534 and 362 / 542 / 534,
# causal 257 / 368 / 372 and 257 / 367 / 369; (64, 16, 256, 256) 277 / 421 / 423, causal 168 /
# 216 / 243; head dim 160 (run as 256) at 512 234 / 374 / 423, causal 165 / 255 / 289. So from
# 256 on (shorter was not timed), the FLOP floor still keeping small problems portable.
SM90_FWD_MIN_SEQLEN_D256 = 256
SM90_FWD_MIN_FLOPS = 3e10
# Re-measured on the H200 with both tiers' repeated calls on ops.express (two runs, eager us,
# Hopper / portable; docs/performance_host.md, "Eager calls by signature"): at 1.7e10 mixed,
# (2, 8, 2048, 64) 41.6-42.8 / 47.4-47.5 and causal (2, 8, 2048, 128) 51.6-65.4 / 69.9-70.8
# but (1, 8, 2048, 128) 56.5 / 41.3 and (4, 16, 1024, 64) 57.2 / 50.6; kept.
# With a sliding window, softcap or ALiBi, from these many queries and keys on. H100, bf16, both
# tiers through use_tier in one process, three rounds (docs/hopper_fwd_configs.md,
# "Softcap's tanh in five instructions"; portable / Hopper time): window (1024, 0) causal 1.21x
# at (8, 16, 2048, 128), 1.12x at (2, 16, 8192, 128), 1.09x at (4, 32, 4096, 64), 1.27x at (4, 8,
# 4096, 256), window (512, 512) 1.18x at (2, 16, 8192, 128), but (128, 128) 0.72x at (32, 32, 512,
# 64); softcap 30 1.36x at (4, 16, 4096, 128), 1.18x causal, 1.17x at (4, 32, 4096, 64), 1.50x
# causal at (4, 8, 4096, 256), but causal 0.77x at (16, 16, 1024, 128) and 0.64x at (32, 16, 512,
# 128). ALiBi (since its distance is taken in fp32, docs/hopper_fwd_configs.md, "ALiBi's
# distance in fp32"): 1.15-1.17x at (4, 16, 4096, 128) causal and not, 1.03x causal at (16, 16,
# 1024, 128), but 0.96x causal at (4, 32, 4096, 64) and 1.00x at (2, 32, 8192, 64): head dim 128
# from 4096 on.
SM90_FWD_MIN_SEQLEN_WINDOW = 2048
# ... except windows of few keys a row, which the Hopper forward gives one consumer a CTA on
# 64 x 64 tiles (ops/fwd_sm90_configs.py: WINDOW_ONE, ``takes_window_one``; ``short_window``): from
# the general floors on, but captured only from SM90_FWD_MIN_FLOPS_GRAPH (at D = 64 too). H200,
# bf16, flashcore-bench --cuda-graph, flashcore-portable / flashcore-sm90 in one process, graph time
# (eager do_bench in brackets): causal (127, 0), two runs, (32, 32, 512, 64) 1.56 (1.52-1.53),
# (16, 32, 1024, 64) 1.38-1.49 (1.50-1.51), (32, 16, 512, 128) 1.57 (1.46), (16, 16, 1024, 128)
# 1.57 (1.50), but captured (2, 8, 1024, 64) (2.7e8 FLOPs) 0.90-0.91; non-causal (255, 255), one
# run, (32, 32, 512, 64) 1.13 (1.17), (16, 32, 1024, 64) 1.22 (1.24). (A window of 511 keys at
# D = 128 keeps the floor: (32, 16, 512, 128) 0.97, (16, 16, 1024, 128) 1.29.)
SM90_FWD_MIN_SEQLEN_SOFTCAP = 4096
SM90_FWD_MIN_SEQLEN_ALIBI = 4096
# A call captured into a CUDA graph costs no host time at replay, so there the floor is where
# the kernels themselves cross (H100, bf16, CUDA-graph replays of both tiers and SDPA in one
# process, two rounds, us; Hopper / portable): 1.1e9 FLOPs (1, 8, 512, 128) 10.8 / 8.6 and
# causal (1, 16, 512, 128) 11-12.5 / 8.7; 2.1e9 causal (1, 8, 1024, 128) 17.2 / 13.8 and
# (1, 16, 1024, 64) 14.2 / 14.6; 4.3e9 causal (2, 8, 1024, 128) 17.3 / 19.0, (1, 8, 2048, 64)
# 23.4 / 24.9 and non-causal (1, 8, 1024, 128) 16.6 / 18.0; 8.6e9 causal (2, 8, 2048, 64) 25.9 /
# 35.3 (SDPA 36.3), non-causal (2, 16, 1024, 64) 23.8 / 23.9; 1.7e10 causal (2, 8, 2048, 128)
# 33.0-34.3 / 54.6-55.3 (SDPA 52.6-53.5), non-causal (2, 8, 2048, 64) 41.5 / 43.0.
SM90_FWD_MIN_FLOPS_GRAPH = 3e9
# At D=64 the captured Hopper forward (one consumer a CTA at these sizes, ops/fwd_sm90_configs.py:
# ONE) beat the portable one at every size measured from the length floor on, so captured D=64
# calls have no FLOP floor: H100, bf16, CUDA-graph replays, three rounds in one process,
# TFLOP/s Hopper / portable: (1, 1, 512) 11.4 / 10.8 and causal (3.4e7 FLOPs) 5.3 / 4.8, (1, 2,
# 512) causal 10.8 / 9.4, (1, 4, 512) 44.5 / 41.3 and causal 21.0 / 18.8, (1, 8, 512) 87.4 / 82.4
# and causal 41.4 / 37.1, (2, 4, 768) causal 71.9 / 64.9, (1, 2, 1024) causal 28.0 / 24.0, (1, 8,
# 1024) causal 107 / 94.
SM90_FWD_MIN_FLOPS_GRAPH_D64 = 0.0
# A packed (varlen) batch at head dim 64 from this mean length on (queries and keys; the other
# floors above apply to the mean lengths too). H100, bf16, 16 heads, both tiers in one process
# (docs/hopper_fwd_configs.md, "Packed batches"; portable / Hopper time): 24 sequences of
# 512-2048 tokens (mean 1277) 0.87x and causal 0.76x with the config it took (two consumers,
# flat), the best of five configs tried 0.96x and 0.91x; 16 x 2048 1.09-1.16x and causal
# 1.04-1.09x, 16 of 256-4096 (mean 2475) 1.05-1.09x and causal 0.90-1.02x, two of 8192 with
# three short ones 1.16-1.18x.
SM90_FWD_MIN_SEQLEN_VARLEN_D64 = 2048


def sm90_forward(
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    flops: float,
    causal: bool = False,
    graph: bool = False,
    *,
    window: bool = False,
    softcap: bool = False,
    alibi: bool = False,
    varlen: bool = False,
    short_window: bool = False,
) -> bool:
    """Whether "auto" takes the Hopper forward for this problem (where it measured faster);
    ``flops``: the forward's ``4 B H Sq Sk D`` (halved for causal); ``window``, ``softcap``,
    ``alibi``: those options are on (``short_window``: a window of few enough keys a row for the
    one-consumer configs, ``fwd_sm90_configs.takes_window_one``); ``varlen``: a packed batch, whose
    lengths are its mean ones; ``graph``: the call is being captured into a CUDA graph (the
    kernels' time alone counts)."""
    if graph:
        min_flops = SM90_FWD_MIN_FLOPS_GRAPH_D64 if head_dim == 64 else SM90_FWD_MIN_FLOPS_GRAPH
    else:
        min_flops = SM90_FWD_MIN_FLOPS_MLA if head_dim == 192 else SM90_FWD_MIN_FLOPS
    if flops < min_flops:
        return False
    shortest = min(seqlen_q, seqlen_k)
    if window and shortest < SM90_FWD_MIN_SEQLEN_WINDOW:
        short = short_window and not varlen
        if not short or (graph and flops < SM90_FWD_MIN_FLOPS_GRAPH):
            return False
    if softcap and shortest < SM90_FWD_MIN_SEQLEN_SOFTCAP:
        return False
    if alibi and (head_dim != 128 or shortest < SM90_FWD_MIN_SEQLEN_ALIBI):
        return False
    if varlen and head_dim == 64 and shortest < SM90_FWD_MIN_SEQLEN_VARLEN_D64:
        return False
    if head_dim == 128:
        floor = SM90_FWD_MIN_SEQLEN
    elif head_dim == 64:
        floor = SM90_FWD_MIN_SEQLEN_D64
    elif head_dim == 192:
        floor = SM90_FWD_MIN_SEQLEN_MLA  # reached only with V's head dim 128 (supports)
    elif head_dim == 256:
        floor = SM90_FWD_MIN_SEQLEN_D256
    else:
        return False
    return shortest >= floor


@dataclass(frozen=True)
class DecodeConfig:
    """Launch configuration of the split-KV decode kernel (``kernels/decode.py``).

    ``block_n``: keys per tile. The M dimension is not configured: it is the GQA group times Sq,
    padded to a power of two >= 16 (``decode_block_m``).
    """

    block_n: int
    num_warps: int
    num_stages: int


# Several tiles per split at the test tier's cache lengths (<= ~100), and ragged ends everywhere.
INTERPRETER_DECODE = DecodeConfig(block_n=16, num_warps=4, num_stages=1)
# Splits the interpreter aims for with num_splits=None: enough for the split path to run.
INTERPRETER_SMS = 2
# A split streams at least this many tiles: below that the combine pass and the per-program
# setup outweigh the extra parallelism (FlashAttention's num_splits_heuristic reasons the same way).
MIN_TILES_PER_SPLIT = 4
MAX_SPLITS = 64  # also caps an explicit num_splits: the combine holds (splits, D) in registers


def decode_combine_warps(block_s: int, block_d: int) -> int:
    """Warps of the decode combine for its ``(block_s, block_d)`` fp32 tile of partials: as few
    as hold it at 64 elements a thread, at most 4. Fewer warps, fewer of the tile's
    reductions over splits cross warps through shared memory: H200, bf16, D = 128, 32 query heads
    over 8 kv heads, CUDA-graph replays of whole decode calls, one warp against four: B = 4 at
    4096 keys (4 splits) 23.93 against 24.26 us, B = 2 at 8192 (8 splits) 24.14 against 24.32,
    within 0.1 us elsewhere (docs/performance_host.md, "Decode: the key tile by the split's
    length")."""
    return max(1, min(4, block_s * block_d // (64 * 32)))


# Rows of one decode tile at most; a longer chunk of queries takes several tiles.
MAX_DECODE_ROWS = 128


def decode_block_m(kv_group: int, seqlen_q: int) -> int:
    """Rows of the decode tile: every query head of one kv head x every query, >= 16 for tl.dot,
    at most MAX_DECODE_ROWS (more rows take more tiles)."""
    return min(MAX_DECODE_ROWS, max(16, 1 << (kv_group * seqlen_q - 1).bit_length()))


# attention_with_kvcache: a chunk of at least this many new queries a sequence runs as a packed
# batch through the forward kernels (ops/decode.py: packed_prefill_wanted), on an sm_90 GPU. One
# H200, bf16, 32 query heads on 8 kv heads, D = 128, causal, the chunk's packing copies included
# (.scratch timing, do_bench medians): at 512 and 1024 queries the packed route took 0.50-0.69x
# the decode kernel's time (B = 4 and 16, caches of 2048-8192 keys, dense and 256-key pages) and
# the portable forward on the same packed batch 0.63-1.02x; at 128 and 256 queries the forward's
# "auto" keeps the portable kernel, 0.68-1.10x; at 16-64 the decode kernel is 1.2-3.6x faster.
KVCACHE_PACKED_MIN_SEQLEN_Q = 512


# A dense cache at least this long streams 128-key tiles (decode_config); with many (batch, kv
# head) pairs it splits over half a wave of programs, a shorter one over a full wave
# (decode_num_splits).
DECODE_LONG_CACHE = 8192
# A dense cache whose splits each stream at least this many keys also takes 128-key tiles.
DECODE_LONG_SPLIT = 2048


# The Triton versions whose ptxas compiles the paged decode at 4 warps and 2 stages without
# spills (3.6: the wheel's and the H200 machine's, where it was timed). Triton 3.8's spilled 8
# bytes at 96 registers there (fp16, 16-key pages, no score flags; tests/test_compile_sm90.py)
# and none with 3 stages, which other versions take (not timed on them).
PAGED_DECODE_TWO_STAGES = ("3.6.",)


def decode_config(
    head_dim: int,
    elem_size: int,
    *,
    interpreted: bool,
    paged: bool = False,
    rows: int = 16,
    capacity: int = 0,
    keys_per_split: int = 0,
    triton_version: str | None = None,
) -> DecodeConfig:
    """Decode config for a padded head dim, element size in bytes and row tile (``rows``, from
    ``decode_block_m``); ``triton_version`` (the running Triton's if None) picks the paged
    config's stages (``PAGED_DECODE_TWO_STAGES``).

    Decoding is bound by reading the cache. A dense cache of at least DECODE_LONG_CACHE keys
    (``capacity``), or whose splits each stream at least DECODE_LONG_SPLIT keys
    (``keys_per_split``: the capacity over the split count), at D = 128 (padded) with a row tile
    of at most 32 (a GQA group of up to 32 query heads, one query) streams 128-key tiles with 4
    warps and 3 stages: from CUDA-graph replays on the H100 (scripts/decode_sweep.py, bf16, D=128,
    32 query heads over 8 kv heads) it reads 3.04 TB/s at B=8, 32k keys (SDPA 3.06; 64-key tiles
    2.79); on the H200 B=8 at 4k keys (two splits of 2048) 38.9 us against 39.7 with 64-key tiles
    (docs/performance_host.md, "Decode: the key tile by the split's length"). A shorter cache
    over more splits is latency-bound and keeps 64-key tiles (B=1, 4k keys, 16 splits of 256:
    9.6 us against 11.6 with 128-key tiles on the H100, 10.3 against 12.2 on the H200); larger
    row tiles (prefill chunks) keep them too (half the score registers). tests/sm90_compile.py
    reports registers and spills of each pick.
    """
    if interpreted:
        return INTERPRETER_DECODE
    block_d = head_block(head_dim)
    if elem_size >= 4:
        return DecodeConfig(32, 4, 1)
    if block_d <= 128:
        if paged and rows > 64:
            # A prefill chunk's 128-row tile: 8 warps halve the per-thread tiles of the paged
            # gather, which addresses each key row through its own block. At 4 warps it spilled
            # 128-288 bytes (H200 machine) though it ran 1.14-1.32x faster (64 and 128 queries
            # on GQA groups of 4, 2048-16384 keys, pages of 16 and 256: 155-205 us against
            # 188-271); the decode builds stay spill-free.
            return DecodeConfig(64, 8, 3)
        if paged:
            # 4 warps and 2 stages: CUDA-graph replays on the H200 (scripts/decode_sweep.py
            # --page-size 256 and 16, bf16, D=128, 32 query heads over 8 kv heads, shuffled
            # pages) 26-27 / 40.7 / 251 us against 35.1 / 53.3 / 322 with 8 warps and 3 stages
            # at (B, keys) (1, 16384) / (8, 4096) / (8, 32768), 256-key pages; 29.6 / 43.4 / 259
            # against 39.3 / 58.2 / 346 with 16-key pages; the fastest or within 3% of it over
            # 64/128-key tiles, 4/8 warps, 2-4 stages. With softcap, a window or ALiBi 1.03-1.43x
            # faster than 8 warps too, and with 64-row tiles (16 queries of a group of 4, B = 4,
            # 8192 keys) 1.08-1.16x; 8 warps had been taken because a build with every score
            # flag spilled 36 bytes at 4 warps and 3 stages on the H100 machine's ptxas
            # (tests/test_compile_sm90.py holds these builds to no spills)
            # (docs/performance_features.md, "Paged decoding: four warps").
            if triton_version is None:
                import triton

                triton_version = triton.__version__
            return DecodeConfig(
                64, 4, 2 if triton_version.startswith(PAGED_DECODE_TWO_STAGES) else 3
            )
        # Measured at D=128; at D=64 the 128-key tile spilled 8 bytes with Triton 3.9's ptxas
        # (128 registers), so smaller head dims keep 64-key tiles.
        streams = capacity >= DECODE_LONG_CACHE or keys_per_split >= DECODE_LONG_SPLIT
        long = streams and rows <= 32 and block_d == 128
        return DecodeConfig(128 if long else 64, 4, 3)
    return DecodeConfig(32, 4, 2)


def decode_num_splits(
    batch_kv_heads: int,
    max_seqlen: int,
    block_n: int,
    num_sms: int,
    *,
    paged: bool = False,
    head_dim: int = 128,
) -> int:
    """Splits per (batch, kv head) so that the grid covers enough of the GPU.

    A dense cache over at most half as many (batch, kv head) pairs as SMs: a program an SM, the
    count rounded down (a program past the wave is a second round for its SM). CUDA-graph replays
    on the H100 (bf16, 32 query heads over 8 kv heads, D=128; us, against the rule before, which
    aimed at half the SMs from DECODE_LONG_CACHE keys on and at all of them, rounded up, below):
    B=1 16 splits at 8k / 16k / 32k keys 12.5 / 29.9 / 51.7 against 16.8 / 31.1 / 53.3 with 9
    (SDPA 11.6 / 29.4 / 50.9); B=2 8 splits 29.9 / 51.3 / 94.8 against 30.5 / 52.9 / 98.3 with 5
    (SDPA 29.4 / 50.6 / 93.9; 9 splits, 144 programs, 58.2 / 113 at 16k / 32k); B=4 4 splits
    29.3 / 95.1 at 4k / 16k against 30.7 / 100.2 with 5 / 3 (SDPA 28.9 / 94.3); B=8, 4k: 2
    splits 50.5 against 54.2 with 3 (SDPA 50.8). More pairs than that: a dense cache of at least
    DECODE_LONG_CACHE keys, half the SMs (one program streams its split at ~47 GB/s, so 64 of
    them already read at the copy bandwidth); a shorter one a full wave, rounded up. A paged
    cache: three waves (its gathers read slower per program: at B=8, 32k keys two splits read
    0.67-0.76x SDPA's bandwidth, seven 0.85-0.93x); twice that at a padded ``head_dim`` of 64
    or less, whose programs each read half as much a tile (H200, bf16, 16-key pages, 4 warps:
    B=8 at 32k and 4k keys 133 / 26.6 us with 14 splits against 155 / 29.3 with 7; at D=128 7
    splits stay ahead of 14 and 28, 258-261 / 43.4-49.0 us; scripts/decode_sweep.py
    --page-size).
    ``max_seqlen`` is the cache capacity (the true lengths live on the device; reading them would
    synchronise). Fewer splits when each would stream fewer than MIN_TILES_PER_SPLIT tiles.
    """
    pairs = max(batch_kv_heads, 1)
    if paged:
        want = -(-3 * num_sms // pairs) * (2 if head_dim <= 64 else 1)
    elif pairs <= num_sms // 2:
        # A program an SM, rounded down: one past the wave would be a second round for its SM.
        want = num_sms // pairs
    elif max_seqlen < DECODE_LONG_CACHE:
        want = -(-num_sms // pairs)
    else:
        want = -(-(num_sms // 2) // pairs)
    by_length = max(1, max_seqlen // (block_n * MIN_TILES_PER_SPLIT))
    return max(1, min(want, by_length, MAX_SPLITS))
