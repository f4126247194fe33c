"""FlashAttention-3-style backward for Hopper (sm_90a) in Gluon: one pass per key block, dQ by
TMA reduce-add. Compiled for sm_90a on the CPU (``tests/test_compile_hopper_bwd.py``) and checked
on the H100 (``scripts/hopper_bwd.py check``, the GPU tests of ``tests/test_backward.py``).

Algorithm. The gradients of ``kernels/bwd.py`` (same LSE base, same masks), in five products per
step instead of the portable tier's seven (no P recomputed for dQ):

    S^T  = K Q^T                    P^T = exp2(S^T * qk_scale - lse2)     (lse2 = LSE * log2(e))
    dP^T = V dO^T                   dS^T = P^T * (dP^T - delta)
    dV  += P^T dO                   dK  += dS^T Q                         dQ += dS K

with ``qk_scale = scale * log2(e)``; ``scale`` is applied once to dK here and to dQ by the
launcher's conversion. The products are taken transposed (keys on the rows) so that P^T and dS^T,
in registers, are directly the A operands of ``dV`` and ``dK``. ``lse2`` (+inf for a row with no
key and for padding rows, so their P is exactly 0) and ``delta = rowsum(dO * O) - dlse`` come from
``bwd_prep_kernel`` (``kernels/bwd_delta.py:tile_delta``, ``common.load_lse2``) in fp32 buffers
``(B, H, Sq_pad)``, ``Sq_pad = cdiv(Sq, 64) * 64``, with zeros (delta) and +inf (lse2) past Sq.

Grid. 1-D, ``cdiv(Sk, 128) * B * Hkv`` programs; program ``(n, b, hk)`` owns keys
``[128 n, 128 n + 128)`` of kv head hk and walks, for each query head ``h = hk * G + g`` of its
group (``G = H // Hkv``, GQA/MQA summed in registers as the portable kernel does), the query
blocks of 64 rows that can see the block (``q_blocks``: causal from the diagonal on). dK and dV
are written once, by this program (no atomics); dQ is accumulated in an fp32 ``(B, H, Sq, D)``
buffer (zeroed by ``bwd_prep_kernel``) by ``cp.reduce.async.bulk.tensor ... .add`` (TMA
reduce-add). The launcher's group split (``ops/bwd_sm90.py: split_group``) runs a GQA/MQA
problem with one program per query head instead: ``kv_heads = H``, ``kv_group = 1``, and
``kv_share = G``, so that program ``(n, b, h)`` loads K and V of kv head ``h // G`` and writes
its dK, dV into a per-query-head buffer ``(B, H, Sk, D)`` that the launcher sums over each
group; ``kv_share`` is 1 otherwise (Triton specialises the 1, so the division compiles away).
Programs map to (key block, head) by ``common.interleave``: groups of ``lpt_heads`` heads take
their key blocks in turn, block 0 first, which causal makes the heaviest (it sees every query);
``lpt_heads = 1`` (the launcher's choice without causal) is each head's blocks in order.

Schedule (one CTA, ``gl.warp_specialize``): two consumer warpgroups (the default partition and
worker 0; 240 registers each after ``setmaxnreg``) and a producer warp (worker 1, 24 registers).
Consumer c owns keys ``[64 c, 64 c + 64)`` of the block: its own K_c, V_c (shared memory, loaded
once), its own dK_c, dV_c (fp32 registers, 64 x D each), its own dS^T tiles (two, alternating by
step) and fp32 dQ staging tile. The two consumers share the Q / dO / lse2 / delta ring, read each
other's dS^T and K for dQ, and stay within a step of each other (``ds_ready``, ``ds_free``).

- Producer: K_c and V_c (four ``(1, 1, 64, D)`` TMA boxes) onto ``kv_ready`` (count 1, armed with
  ``expect`` of all four; one phase, waited with parity 0). Then for step t (query head g, query
  block m): slot ``t % NUM_STAGES``; wait ``qd_empty[slot]`` with parity ``((t // NUM_STAGES) &
  1) ^ 1`` (the first pass through the ring does not block); arm ``qd_ready[slot]`` with the
  bytes of Q, dO (``(1, 1, 64, D)`` boxes of the 4-D ``(B, H, Sq, D)`` views: rows past Sq arrive
  as zeros) and lse2, delta (``(64,)`` boxes of the flat padded buffers); issue the four loads.
- Consumer c, step t (slot ``t % NUM_STAGES``, parity ``(t // NUM_STAGES) & 1``; dS^T buffer
  ``b = t % 2``)::

      wait qd_ready[slot]
      S^T  = wgmma(K_c, Q^T)    async         # group 1
      dP^T = wgmma(V_c, dO^T)   async         # group 2
      wgmma.wait_group 1                      # S^T done, dP^T running
      lse2 from the slot; causal mask (diagonal blocks only); P^T = exp2(...)
      wgmma.wait_group 0                      # dP^T done
      delta from the slot; dS^T = P^T * (dP^T - delta)
      dV  += wgmma(P^T (registers), dO) async
      wait ds_free[b]                         # both consumers' dQ of step t - 2 read tile [b, *]
      dS^T -> shared (tile [b, c])
      dK  += wgmma(dS^T (registers), Q) async
      fence.proxy.async; wgmma.wait_group 0   # dV, dK done: every reader of the slot is done
      arrive qd_empty[slot]                   # count 2: both consumers
      arrive ds_ready[b]                      # count 2: this consumer's dS^T tile written
      dQ of step s = t - 1 (DQ_LAG) or s = t:
          wait ds_ready[s % 2]                # both dS^T tiles of step s written
          dQ_c = wgmma(dS_0, K_0[:, cols c]) + wgmma(dS_1, K_1[:, cols c]); wait
          arrive ds_free[s % 2]
          cp.async.bulk.wait_group.read 0     # the staging tile's previous reduce has read it
          dQ_c -> shared (fp32 staging tile c); fence.proxy.async
          TMA reduce-add into dQ[b, h_s, m_s:m_s+64, cols c]

  with ``cols c = [c D/2, (c + 1) D/2)``: each consumer computes half the columns of the step's
  dQ over all 128 keys (a 64 x D/2 accumulator, 32 registers at D=128) and reduce-adds it, so the
  step sends 64 x D fp32 to L2 once. (Each consumer reducing its own keys' full-width dQ sent it
  twice: at D=128 the L2 ran at 86% of its throughput (ncu) and the backward 10-14% slower.) dQ
  is issued after dV and dK have completed (or, with DQ_BESIDE_DK below, beside one of them at a
  time): with all three in flight ptxas serialised the wgmmas (C7512) and spilled at D=128.
  lse2 and delta are read from shared memory where they are used (a row vector in the score
  layout takes 16 registers a thread).

  DQ_LAG (every variant but softcap or ALiBi at D=128 without LAG_OPTIONS, which the launcher
  sets for softcap and causal ALiBi, ``ops/bwd_sm90.py: lag_options``; before FRESH_DESC took
  the causal builds, the two carried indices made ptxas spill more there and the kernel measured
  2-15% slower): the dQ of step t runs in step t + 1, after
  that step's dV and dK, and the last one after the loop. Waiting in step t for the other
  consumer's dS^T of the same step made the two consumers run in lockstep, their elementwise
  work and the dQ staging at the same time with the tensor cores idle; with a step of slack they
  drift apart (D=128, H100: 6% fewer cycles at a fixed clock, 4-10% faster at the boost clock;
  docs/performance_backward.md, "dQ a step late"). At t = 0 the lagged call is of "step -1": its
  products read whatever the tiles hold and it reduces nothing (``live`` false), since a
  run-time branch around the products made ptxas crash; it still takes part in the barrier
  phases below. The staging tile's shared layout is a launcher choice (``ops/bwd_sm90.py:
  dq_layout``): for dense problems (``rows_permuted``: at D=128 not with a window, and causal
  only on long problems) the rows of each 8-row group stored permuted and the dQ descriptor a
  view that walks them in that order (``PERMUTED_ROWS``, ``bwd_dq.stage_dq``, ``dq_rows``):
  conflict-free stores with the 128-byte swizzle's full-width copies; otherwise rows in order,
  where the 128-byte swizzle (D=128) takes two wavefronts a store half-warp where one would do
  and the 32-byte one (D=64) four times the reduce's L2 requests.

  DQ_BESIDE_DK (with DQ_LAG; the launcher's choice, ``ops/bwd_sm90.py: dq_beside_dk``: at D=128
  without causal, and causal from 4096 query rows on): the step's tail runs as FlashAttention-3
  orders it, so that the dQ products and the staging store are not alone on the consumer::

      dV  += wgmma(P^T (registers), dO) async
      wait ds_free[b]; dS^T -> shared (tile [b, c]); fence.proxy.async
      arrive ds_ready[b]                      # announced at once, dV in flight
      wait ds_ready[(t - 1) % 2]
      dQ_c of step t - 1: two wgmmas async    # beside dV
      wgmma.wait_group 2                      # dV done
      dK  += wgmma(dS^T (registers), Q) async
      wgmma.wait_group 1                      # the dQ products done, dK in flight
      arrive ds_free[(t - 1) % 2]; wait the staging tile's read; stage dQ_c; fence; reduce-add
      wgmma.wait_group 0                      # dK done
      arrive qd_empty[slot]

  At most two accumulators are in flight at a time (dV and dQ, then dQ and dK), which ptxas
  12.8 compiles without serialising. The ``ds_ready`` / ``ds_free`` operations of a consumer's
  step come in the same order as without it, so their phases below hold unchanged; the slot's
  release moves to the step's end, behind the wait for the other consumer's dS^T of step t - 1,
  which that consumer wrote in its step t - 1 after its own wait on the slot of step t - 1 (a
  release this consumer made NUM_STAGES steps before): no cycle. The slot is freed later in the
  step (after the staging store): causal problems shorter than 4096 query rows measured 1-5%
  slower with it, longer ones and every non-causal length 1-5% faster (H200, bf16;
  docs/performance_backward.md, "dQ beside dK").

  After the loop each consumer waits (``ds_free``) until the other's last dQ products, which read
  this consumer's K tile, have completed. Epilogue: dK_c * scale and dV_c, cast, written into
  K_c's and V_c's slots, fence, TMA stores (rows past Sk dropped by the copy engine), then
  ``store_wait(0)`` so that no bulk copy still reads shared memory when the CTA exits.

DQ_WARPGROUP (the launcher's choice at D=64, ``ops/bwd_sm90.py: CONFIGS``): the dQ phase leaves the
consumers' steps for a third warpgroup (worker 1; the producer becomes worker 2). Registers a
thread: consumer 1 200, the dQ warpgroup 96, the producer 24, and consumer 0 (the default
partition) what they leave of 512: 192 (Gluon counts the producer warp as a warpgroup). A
consumer's step ends at its ``ds_ready`` arrive; ``ds_free`` (count 1) is arrived by the dQ
warpgroup alone, and a consumer writes dS^T tile ``[t % 2, c]`` after waiting it with parity
``((t // 2) & 1) ^ 1`` (step t - 2's dQ products done; the first two pass). The dQ warpgroup,
step t::

      wait ds_ready[t % 2] with parity (t // 2) & 1    # both dS^T tiles of step t written
      dQ = wgmma(dS_0, K_0) + wgmma(dS_1, K_1); wait   # all D columns
      arrive ds_free[t % 2]
      cp.async.bulk.wait_group.read 1                  # staging tile t % 2: step t - 2's reduce
      dQ -> shared (staging tile t % 2); fence.proxy.async   # has read it
      TMA reduce-add into dQ[b, h_t, m_t:m_t+64, :]

  then arrives ``dq_done`` (count 1), which the consumers wait (parity 0) before their epilogue
  overwrites K. Phases: ``ds_ready[b]``'s k-th completion is step 2k + b, and it cannot complete
  again before the dQ warpgroup's wait for it (the consumers' next arrivals on it follow their
  ``ds_free`` wait for this step's products); ``ds_free[b]``'s k-th completion is step 2k + b's
  dQ, which needs both consumers' ``ds_ready`` arrival for that step, made after their wait for
  the previous completion. The consumers' lockstep with each other goes (no dQ of the other's
  keys in their steps); ``qd_empty`` still bounds the ring. At D=64 (H100, bf16, 32k tokens) it
  measured 4-10% faster than the dQ in the consumers' steps (docs/performance_backward.md, "dQ on
  a warpgroup of its own"); at D=128 the consumers need their 240 registers and the split does
  not fit (``setmaxnreg`` totals within the 64K of an SM).

KV_REGS (the launcher's choice at D=64 without window, softcap or ALiBi, ``ops/bwd_sm90.py:
kv_in_registers``): each consumer loads its K_c and V_c once, after ``kv_ready``, into the A-operand
layout of ``S^T`` and ``dP^T`` (16 registers a thread each at D=64), so that those two products
read only Q and dO from shared memory: 32 KB fewer a step of the 192 KB the step's products,
copies, staging and dS^T tiles move through shared memory, the bound at D=64
(docs/performance_backward.md, "K and V as register operands at D = 64"). The shared K and V
tiles stay: the dQ warpgroup reads K from them, and the epilogue stores dK, dV through them. At
D=128 the two tiles would take 64 registers a thread beside the consumers' 224 of accumulators.
With softcap or ALiBi at D=64 ptxas 12.8 spilled 268-1156 B or crashed (SIGSEGV), and with a
window the build measured 1-4% slower, so those variants keep K and V in shared memory.

mbarrier phases (why nothing deadlocks). ``kv_ready`` completes once (the producer's first act,
unconditional: a block whose keys no query sees still gets its K/V loaded, so both consumers'
single wait with parity 0 returns). ``qd_ready[s]`` completes once per use of slot s, by the
transaction count of its four loads; ``qd_empty[s]`` (count 2) once per use, when both consumers
have arrived. Step t uses slot ``t % NUM_STAGES`` for the ``(t // NUM_STAGES)``-th time: the
consumers wait ``qd_ready`` with parity ``(t // NUM_STAGES) & 1``, the producer waits ``qd_empty``
with the opposite parity, i.e. for the completion of step ``t - NUM_STAGES``'s use (before any, the
barrier's initial phase counts as completed with parity 1, so the first NUM_STAGES waits pass).
Neither barrier can run two phases ahead of its waiter: ``qd_ready[s]`` completes again only after
the producer's wait on ``qd_empty[s]``, which needs both consumers' arrivals for the previous use,
which come after their wait on that ``qd_ready`` phase; and symmetrically. ``ds_ready[b]`` (count
2) completes at steps t = b, b + 2, ..., its k-th time for step ``2k + b``; the dQ of step s >= 0
waits it with parity ``(s // 2) & 1``, step -1 with parity 1 (the initial phase counts as
completed). It cannot complete twice before a consumer's wait: a consumer's own arrival for step s
+ 2 follows its wait for step s. ``ds_free[b]`` (count 2) completes once per dQ computed from tile
set b, both consumers' products done: the k-th time for step ``2k + b - DQ_LAG * b`` (with DQ_LAG,
step -1's call is buffer 1's first). Step t waits for step t - 2's, i.e. parity ``(t // 2 + 1 +
DQ_LAG * b) & 1`` (t < 2: the initial phase); after the loop, for step n - 1's (n steps; n = 0: the
initial phase or, with DQ_LAG, step -1's). Again no barrier runs two phases ahead of a waiter,
since each completion needs the waiter's own arrival from a later point of its program. No
deadlock: the other consumer's dQ of step t - 2 comes in its step t - 1 (or t - 2) after it waited
ds_ready for a step this consumer has already written; its dS^T of step s needs only its own
ds_free wait for step s - 2, which this consumer passed two steps before. So the consumers stay
within a step of each other, and ``qd_empty`` (both arrivals) bounds the ring as before. The
consumers' only other waits are on their own bulk copies (``store_wait``), which complete without
anyone's help.

Flags (``gl.constexpr``): IS_CAUSAL (bottom-right aligned: row i sees key j iff ``j <= i + Sk -
Sq``; query blocks before the block's diagonal are skipped, blocks crossing it are masked at run
time, later ones are not; the causal mask also hides keys past Sk). EVEN_N (Sk a multiple of
128): without it and without IS_CAUSAL, the consumer whose keys cross Sk masks them on every
step (a run-time branch on a loop invariant). Their K and V rows arrive as zeros, so their dS
would reach dQ only times K = 0, but unmasked their P = exp2(-lse2) can overflow fp16 to inf
(LSE below about -11) and inf * 0 is NaN. Their dK/dV rows are never stored (the copy engine
clips at Sk). Query rows past Sq have Q = dO = 0 and lse2 = +inf: P = 0, dS = 0. HAS_WINDOW,
SOFTCAP, HAS_ALIBI: the scores exactly as the forward forms them (``ops/problem.py:scores``
folds the units: ``qk_scale`` is ``scale / c`` with a softcap, ``softcap`` is ``c log2(e)``;
softcap, then ALiBi, then the masks); the window's query-block range in ``q_blocks`` and its
masks on every step; with SOFTCAP dS is multiplied by ``1 - tanh^2`` (the gradient with respect
to ``scale q.k``); the ALiBi slope is read once a step (its query head). FRESH_DESC (the
launcher's ``ops/bwd_sm90.fresh_desc``: on where DQ_BESIDE_DK is and in the causal builds with a
window, softcap, ALiBi or packed rows): the consumer's K_c,
V_c and dQ K-column views taken each step through a zero LLVM cannot see, so that their wgmma
descriptors are formed in the step loop rather than every k-step's before it, held in vector
registers and moved to uniform ones (``R2UR``) at each use (``kernels/hopper/bwd_mla.py``). ABLATE
(measurement only, wrong dQ): 1 computes dQ but does not reduce it; 2 skips the dQ products
(Triton 3.6's ptxas crashes on that variant; with DQ_WARPGROUP it is 1). SKIP_MASKED (the
launcher's ``ops/bwd_sm90.SKIP_MASKED``, causal, with DQ_LAG): when a program's first step has no
row that sees a key of consumer 1's (its rows start at or below the diagonal of the block's first
key: every program of a causal problem with Sq = Sk), consumer 1 skips that step's
products: it waits the step's ``qd_ready`` and ``ds_free`` phases, writes a zero dS^T tile (its P
and dS are 0) for both consumers' dQ products, and arrives ``qd_empty`` and ``ds_ready`` (and, with
the dQ in the consumers, ``ds_free[1]`` for the loop's "step -1"), then runs the loop from step 1.
The step is peeled off the loop because a run-time branch around the products made ptxas 12.8
crash (SIGSEGV); with GQA only the group's first head's step is skipped. Every phase of
``qd_ready`` is still waited in turn: without the peeled wait, the parity wait of step NUM_STAGES
can pass on the slot's first phase before it completes (before that wait was in, one A/B on an
H200 read dK and dV 0.16 apart at D=64 causal 1024 keys; with it, 60 repeated backwards on five
shapes gave bit-identical dK and dV). H200, bf16: causal 1.01-1.05x at 512-2048 keys, window
1.06x (docs/performance_backward.md). SKIP_WINDOW (``ops/bwd_sm90.SKIP_MASKED_WINDOW``) does the
same at a window's edges: consumer 1's first step at the right edge when not causal (the same
peeled step), and consumer 0's last step at the left edge, run after its loop in a loop of at most
one step (its waits, a zero dS^T tile, its arrives and the previous step's dQ). H200, bf16: causal
windows 1.01-1.02x, a non-causal (256, 256) window 1.09-1.10x. BAND_MASK
(``ops/bwd_sm90.BAND_MASK``, causal with a window): the diagonal's mask and the window's as one
unsigned comparison, ``0 <= i + diag - j <= left``, on every step (the diagonal's alone is on the
steps it crosses): fewer instructions and spills; H200, bf16: D=64 1.03x, D=128 1.00-1.02x.

Invariants. Head dim 64 or 128 and unit stride on D; every descriptor stride is 16-byte aligned
(launcher). Shared memory at D=128: K, V 32 KB each, Q/dO ring 2 x 2 x 16 KB, dS^T 2 x 2 x 8 KB,
fp32 dQ staging 2 x 16 KB, row stats 1 KB, barriers: 198048 B; at D=64 with the dQ warpgroup
132600 B (its two staging tiles are 64 x 64 fp32).

Compiled (CPU, ptxas of Triton 3.6's wheel, sm_90a; ``tests/test_compile_hopper_bwd.py``):
``setmaxnreg`` 240 / 24 (D=64: 192, 200 / 96 / 24), no C75xx warning; spills 0 B without score
options except 24-36 B (scalars) for D=128 fp16 causal with ragged Sk and 16 B (two scalars, once
in a consumer's epilogue) at D=64 with KV_REGS; with window, softcap or ALiBi at D=128 160-516 B
(see the test's allowance); at D=64 16 B with all three at once. A
run-time branch around the dQ products (one consumer computing the whole dQ of a step, alternating)
made ptxas crash (SIGSEGV), and so did a consumer step with no dQ phase and nothing after its
``ds_ready`` arrive: ptxas 12.8's optimizer (Triton 3.6's wheel), at -O1 and above; the consumers
then wait for no bulk copy (``tma.store_wait(0)``) there, and ptxas 13.0 compiles the step either
way.

VARLEN (packed batches, FlashAttention-2's varlen): the descriptors are ``(1, heads, total, D)``
views of the packed tensors (batch coordinate 0), the grid is sized by the longest sequence
(``key_block``: a program whose block starts past its own sequence's keys returns at entry), and
each program reads its sequence's first rows and lengths from CU_Q, CU_K (``common.sequence``).
The row stats and the dQ accumulator are those of one sequence of ``total_q`` rows (the prep
kernel runs as for a dense batch of one). What a dense problem gets from the copy engine's zero
fill past Sq and Sk, a packed one gets by hand, since the rows past a sequence's end are the next
sequence's (or unset memory; a NaN or inf there must not reach this sequence's gradients, and
``0 * inf`` is NaN):

- the producer loads the row stats itself (a fp32 box of the copy engine must start 16-byte
  aligned, and a sequence's rows start anywhere: an unaligned 1-D box faulted with an illegal
  instruction on the H100), with a row mask: lse2 = +inf and delta = 0 past the sequence, so P
  and dS are 0 there; it stores them into the slot and arrives on ``qd_ready`` (count 2: the
  copies' expect and this arrival);
- a query block that crosses the sequence's end lands on the producer's own ``fix_bar``, which
  zeroes its Q and dO rows past the end (else ``P^T dO`` and ``dS^T Q`` would take ``0 * inf``)
  and then arrives on ``qd_ready`` in place of the copies' expect; a key block that crosses it
  likewise has its K and V rows past the end zeroed before ``kv_ready`` completes (``fix_bar``'s
  phases count those uses, ``n_fix``);
- the dQ rows of a step past the sequence's end are zeroed before the reduce-add
  (``bwd_dq.rows_of_sequence``; their dS is 0, but ``0 * K`` with an inf key is NaN), so the next
  sequence's dQ receives exact zeros;
- the consumer whose keys cross the end stores its dK and dV rows with a row mask
  (``common.store_rows``) instead of the TMA store, which would overwrite the next sequence's.

Dependent launch (``PDL``, the launcher's ``ops/bwd_sm90.PDL``): the main kernel is launched
with programmatic dependent launch after ``bwd_prep_kernel``, which lets it launch at the prep's
entry (``griddepcontrol.launch_dependents``). Its programs set up and load K and V (inputs,
written before the prep started) while the prep runs; the producer then waits for the prep's
grid (``griddepcontrol.wait``) before its first Q/dO/lse2/delta load, and every consumer's first
reduce-add into the zeroed accumulator follows that load. A packed batch's program that returns
at entry waits too, so that no program, and so no grid, completes before the prep. The main
kernel lets ``bwd_dq_kernel`` launch at its own entry; that kernel waits before reading the
accumulator. Under CUDA graphs this took 2.4-7.4 us off a backward (the launch gaps and the main
kernel's setup); in long problems it is within the spread.

Not covered (the launcher's ``supports`` says no): a value head dim different from Q/K's, head
dims other than 64 and 128 (and the padded ones). Sinks need nothing here (the launcher's
caller).
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashcore.kernels.bwd_delta import tile_delta
from flashcore.kernels.common import load_lse2
from flashcore.kernels.hopper.bwd_dq import (
    dq_finish,
    dq_issue,
    dq_row,
    dq_rows,
    dq_step,
    permuted_box,
    reduce_dq,
    rows_of_sequence,
    stage_dq,
)
from flashcore.kernels.hopper.common import (
    LOG2E,
    interleave,
    opaque,
    sequence,
    store_rows,
    tanh,
    tma_load,
    tma_store,
    zero_rows,
)

ROWS = gl.constexpr(64)  # query rows per step, and keys per consumer warpgroup (one m64 wgmma)
BLOCK_N = gl.constexpr(128)  # keys per program: two consumers x 64


@triton.jit
def row_tile(rows_per_head, num_heads, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's tile of a kernel over ``(B, H, rows_per_head, D)`` rows, one (BLOCK_M,
    BLOCK_D) tile a program, grid ``cdiv(rows_per_head, BLOCK_M) * B * H``: ``(off_bh, off_b,
    off_h, offs_m, offs_d)``, the batch and head as int64."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(rows_per_head, BLOCK_M)
    off_bh = pid // n_tiles
    start_m = (pid % n_tiles) * BLOCK_M
    off_b = (off_bh // num_heads).to(tl.int64)
    off_h = (off_bh % num_heads).to(tl.int64)
    return off_bh, off_b, off_h, start_m + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)


@triton.jit
def bwd_prep_kernel(
    O,
    DO,
    DLSE,
    LSE,
    DELTA,
    LSE2,
    DQ_ACC,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dlb,
    stride_dlh,
    stride_lb,
    stride_lh,
    num_heads,
    seqlen_q,
    seqlen_pad,
    acc_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row stats of the backward, one (BLOCK_M, D) tile a program: ``delta = rowsum(dO * O) -
    dlse`` (``tile_delta``, as the portable dQ kernel) and ``lse2`` (``load_lse2``: +inf for a row
    with no key and past Sq), written to ``(B, H, seqlen_pad)`` fp32 buffers (delta 0 past Sq);
    and the same rows of the fp32 dQ accumulator ``DQ_ACC`` (contiguous ``(B, H, acc_rows,
    D)``, ``acc_rows`` Sq or, with the dQ rows permuted, ``seqlen_pad``) zeroed, for the
    main kernel's reduce-adds (launched after it on the same stream; one kernel fewer than a
    separate fill). Grid ``cdiv(seqlen_pad, BLOCK_M) * B * H``. ``BLOCK_D``: the
    main kernel's head dim, a power of two of at least ``HEAD_DIM`` (the tensors')."""
    if PDL:
        # The main kernel may launch now; it waits for this grid before reading what it writes.
        gdc_launch_dependents()
    off_bh, off_b, off_h, offs_m, offs_d = row_tile(seqlen_pad, num_heads, BLOCK_M, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]  # Sq x row stride may pass 2**31
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh + rows * stride_om + offs_d
    do_ptrs = DO + off_b * stride_dob + off_h * stride_doh + rows * stride_dom + offs_d
    in_tile = offs_m[:, None] < seqlen_q
    if HEAD_DIM < BLOCK_D:
        in_tile = in_tile & (offs_d[None, :] < HEAD_DIM)
    do = tl.load(do_ptrs, mask=in_tile, other=0.0)
    dlse_ptrs = DLSE + off_b * stride_dlb + off_h * stride_dlh + offs_m
    delta = tile_delta(
        o_ptrs, do, dlse_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, False, HEAD_DIM == BLOCK_D,
        HAS_DLSE,
    )  # fmt: skip
    lse2 = load_lse2(LSE + off_b * stride_lb + off_h * stride_lh + offs_m, offs_m, seqlen_q, False)
    out = off_bh.to(tl.int64) * seqlen_pad + offs_m
    tl.store(DELTA + out, tl.where(offs_m < seqlen_q, delta, 0.0))
    tl.store(LSE2 + out, lse2)
    acc = DQ_ACC + (off_bh.to(tl.int64) * acc_rows + rows) * HEAD_DIM + offs_d
    in_acc = offs_m[:, None] < acc_rows
    if HEAD_DIM < BLOCK_D:
        in_acc = in_acc & (offs_d[None, :] < HEAD_DIM)
    tl.store(acc, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), mask=in_acc)


@triton.jit
def bwd_dq_kernel(
    DQ_ACC,
    DQ,
    scale,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    num_heads,
    seqlen_q,
    acc_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """dQ out of the fp32 accumulator the main kernel reduce-added it into (unscaled):
    ``DQ = scale * DQ_ACC`` rounded to DQ's dtype, one (BLOCK_M, D) tile a program, grid
    ``cdiv(seqlen_q, BLOCK_M) * B * H``. ``DQ_ACC`` as ``bwd_prep_kernel`` takes it (contiguous
    ``(B, H, acc_rows, HEAD_DIM)``; a packed batch's ``(1, H, total_q, HEAD_DIM)``); ``DQ`` by its
    strides (a packed batch's ``(total_q, H, D)`` as batch stride 0, head and row strides). The
    product and the rounding are those of ``torch.mul(acc, scale, out=dq)``, which this replaced:
    PyTorch's mixed-dtype elementwise path moves one element at a time, this 16-byte pieces; 66.3
    against 49.0 us at 16k tokens, 16 heads, D = 128 (H200; docs/performance_backward.md, "The
    dQ conversion and the short floors")."""
    off_bh, off_b, off_h, offs_m, offs_d = row_tile(seqlen_q, num_heads, BLOCK_M, BLOCK_D)
    rows = offs_m.to(tl.int64)[:, None]
    if PDL:
        # Launched while the main kernel runs: its reduce-adds complete before DQ_ACC is read.
        gdc_wait()
    mask = offs_m[:, None] < seqlen_q
    if HEAD_DIM < BLOCK_D:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    acc = tl.load(DQ_ACC + (off_bh.to(tl.int64) * acc_rows + rows) * HEAD_DIM + offs_d, mask=mask)
    dq = DQ + off_b * stride_qb + off_h * stride_qh + rows * stride_qm + offs_d * stride_qd
    tl.store(dq, (acc * scale).to(DQ.dtype.element_ty), mask=mask)


@gluon.jit
def q_blocks(
    start_n,
    seqlen_q,
    seqlen_k,
    window_left,
    window_right,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    KEYS: gl.constexpr = BLOCK_N,
):
    """``(lo, n_m)``: the query blocks of ROWS rows that see any key of ``[start_n, start_n +
    KEYS)`` start at ``lo`` (a multiple of ROWS), ``n_m`` of them (0 when none). Row i sees key
    j iff ``j - d - right <= i <= j - d + left`` (``d = Sk - Sq``; right = 0 when causal, a side
    without a bound arrives as ``Sq + Sk``). ``KEYS``: the program's keys (``bwd256.py``: 64)."""
    diag = seqlen_k - seqlen_q
    if IS_CAUSAL:
        # The block's first key is seen from row start_n - diag on.
        lo = (gl.maximum(start_n - diag, 0) // ROWS) * ROWS
    elif HAS_WINDOW:
        lo = (gl.maximum(start_n - diag - window_right, 0) // ROWS) * ROWS
    else:
        lo = start_n * 0
    if HAS_WINDOW:
        # The block's last key is seen up to row start_n + BLOCK_N - 1 - diag + window_left.
        hi = gl.minimum(gl.maximum(start_n + KEYS - diag + window_left, 0), seqlen_q)
    else:
        hi = seqlen_q
    n_m = gl.maximum(gl.cdiv(hi - lo, ROWS), 0)
    return lo, n_m


@gluon.jit
def key_block(
    CU_Q,
    CU_K,
    kv_heads,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    total_q,
    total_k,
    VARLEN: gl.constexpr,
):
    """``(start_n, off_b, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b)`` of this program:
    its key block's first key, batch (VARLEN: sequence) and kv head (``interleave``, heaviest key
    blocks first when causal), and its sequence's first rows, lengths and batch coordinate in the
    descriptors (``common.sequence``: VARLEN's ``(1, heads, total, D)`` views take 0). With VARLEN
    the grid is sized by the longest sequence (``seqlen_k``): a block may start past its own."""
    n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
    block, off_bh = interleave(gl.program_id(0), n_blocks, lpt_heads)
    off_b = off_bh // kv_heads
    q_start, k_start, seqlen_q, seqlen_k, desc_b = sequence(
        CU_Q, CU_K, off_b, seqlen_q, seqlen_k, total_q, total_k, VARLEN
    )
    return block * BLOCK_N, off_b, off_bh % kv_heads, q_start, k_start, seqlen_q, seqlen_k, desc_b


@gluon.jit
def _load_kv(k_desc, v_desc, off_b, kv_head, key, bar, k_smem, v_smem):
    """K and V of the block's two 64-key halves from key ``key`` on, by TMA onto ``bar``."""
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for c in gl.static_range(2):
        tma_load(k_desc, [off_b, kv_head, key + c * ROWS, 0], bar, k_smem.index(c))
        tma_load(v_desc, [off_b, kv_head, key + c * ROWS, 0], bar, v_smem.index(c))


@gluon.jit
def _load_step(
    q_desc,
    do_desc,
    lse_desc,
    delta_desc,
    off_b,
    off_h,
    q_row,
    row,
    bar,
    q_smem,
    do_smem,
    lse_smem,
    delta_smem,
    slot,
    STATS: gl.constexpr = True,
):
    """A step's Q and dO (query rows from ``q_row`` on) and, with STATS, its lse2 and delta (from
    flat index ``row``) into ring slot ``slot``, by TMA onto ``bar``."""
    if STATS:
        mbarrier.expect(
            bar,
            q_desc.block_type.nbytes
            + do_desc.block_type.nbytes
            + lse_desc.block_type.nbytes
            + delta_desc.block_type.nbytes,
        )
    else:
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma_load(q_desc, [off_b, off_h, q_row, 0], bar, q_smem.index(slot))
    tma_load(do_desc, [off_b, off_h, q_row, 0], bar, do_smem.index(slot))
    if STATS:
        tma_load(lse_desc, [row], bar, lse_smem.index(slot))
        tma_load(delta_desc, [row], bar, delta_smem.index(slot))


@gluon.jit
def _store_dk_dv(dk_desc, dv_desc, k_tile, v_tile, dk, dv, off_b, off_hk, key):
    """dK and dV (scaled) of a consumer's 64 keys from key ``key`` on, through its K and V slots
    (their last readers are complete), by TMA stores (rows past the tensor's end dropped)."""
    k_tile.reshape([dk.shape[0], dk.shape[1]]).store(dk.to(dk_desc.dtype))
    v_tile.reshape([dv.shape[0], dv.shape[1]]).store(dv.to(dv_desc.dtype))
    fence_async_shared()
    tma_store(dk_desc, [off_b, off_hk, key, 0], k_tile)
    tma_store(dv_desc, [off_b, off_hk, key, 0], v_tile)


@gluon.jit
def _producer(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    lse_desc,
    delta_desc,
    q_smem,
    k_smem,
    v_smem,
    do_smem,
    lse_smem,
    delta_smem,
    kv_ready,
    qd_ready,
    qd_empty,
    fix_bar,
    CU_Q,
    CU_K,
    LSE2,
    DELTA,
    kv_heads,
    kv_group,
    kv_share,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    seqlen_pad,
    window_left,
    window_right,
    total_q,
    total_k,
    NUM_STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    VARLEN: gl.constexpr,
    PDL: gl.constexpr = False,
):
    start_n, _, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = key_block(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
    )
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
    if VARLEN:
        r_stat = gl.arange(0, ROWS, layout=gl.BlockedLayout([2], [32], [1], [0]))
    # K and V of the block, once (also for a block no query sees: the consumers wait for it),
    # from the kv head the program's heads share (itself unless the group is split).
    kv_head = off_hk // kv_share
    # VARLEN: a block that crosses its sequence's end lands on the producer's own fix_bar; the
    # rows past the end (the next sequence's, or unset memory: a NaN or inf there would reach dQ
    # through dS K and dP^T = V dO^T) are zeroed before kv_ready completes (a plain arrive).
    key = k_start + start_n
    n_fix = 0
    if VARLEN:
        n_fix = gl.to_tensor(0)
        if start_n + BLOCK_N > seqlen_k:
            _load_kv(k_desc, v_desc, desc_b, kv_head, key, fix_bar, k_smem, v_smem)
            mbarrier.wait(fix_bar, 0)
            for c in gl.static_range(2):
                keep = seqlen_k - start_n - c * ROWS
                zero_rows(k_smem.index(c).reshape([ROWS, HEAD_DIM]), keep)
                zero_rows(v_smem.index(c).reshape([ROWS, HEAD_DIM]), keep)
            fence_async_shared()
            mbarrier.arrive(kv_ready, count=1)
            n_fix = n_fix + 1
        else:
            _load_kv(k_desc, v_desc, desc_b, kv_head, key, kv_ready, k_smem, v_smem)
    else:
        _load_kv(k_desc, v_desc, desc_b, kv_head, key, kv_ready, k_smem, v_smem)
    if PDL:
        # Launched while bwd_prep_kernel may still run: K and V are inputs, but the row stats
        # and the zeroed dQ accumulator are its output (the consumers reduce into the latter
        # only after this warp's first step loads, so after this wait).
        gdc_wait()
    lo, n_m = q_blocks(
        start_n, seqlen_q, seqlen_k, window_left, window_right, IS_CAUSAL, HAS_WINDOW
    )
    for t in range(n_m * kv_group):
        off_h = off_hk * kv_group + t // n_m
        start_m = lo + (t % n_m) * ROWS
        slot = t % NUM_STAGES
        q_row = q_start + start_m
        row = (desc_b * kv_heads * kv_group + off_h) * seqlen_pad + q_row
        if VARLEN:
            # The row stats by this warp's loads: a sequence's rows start anywhere, and a copy
            # engine box of fp32 must start 16-byte aligned (an unaligned one faulted with an
            # illegal instruction on the H100). Rows past the sequence's end (the next one's,
            # or past the buffers) get lse2 = +inf (P = 0) and delta = 0 (dS = 0).
            keep = seqlen_q - start_m
            lse2 = gl.load(LSE2 + row + r_stat, mask=r_stat < keep, other=float("inf"))
            delta = gl.load(DELTA + row + r_stat, mask=r_stat < keep, other=0.0)
            mbarrier.wait(qd_empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)
            if keep < ROWS:
                # Q and dO land on fix_bar; their rows past the end are zeroed (a NaN or inf
                # there would reach dV and dK through P^T dO and dS^T Q, even with P = 0).
                _load_step(
                    q_desc, do_desc, lse_desc, delta_desc, desc_b, off_h, q_row, row, fix_bar,
                    q_smem, do_smem, lse_smem, delta_smem, slot, False,
                )  # fmt: skip
                mbarrier.wait(fix_bar, n_fix & 1)
                zero_rows(q_smem.index(slot).reshape([ROWS, HEAD_DIM]), keep)
                zero_rows(do_smem.index(slot).reshape([ROWS, HEAD_DIM]), keep)
                fence_async_shared()
                n_fix = n_fix + 1
                # qd_ready's arrival for the data (the copies' expect on the other steps).
                mbarrier.arrive(qd_ready.index(slot), count=1)
            else:
                _load_step(
                    q_desc, do_desc, lse_desc, delta_desc, desc_b, off_h, q_row, row,
                    qd_ready.index(slot), q_smem, do_smem, lse_smem, delta_smem, slot, False,
                )  # fmt: skip
            # racecheck hand-over: row stats
            lse_smem.index(slot).store(lse2)
            # racecheck hand-over: row stats
            delta_smem.index(slot).store(delta)
            # qd_ready's second arrival (count 2): the row stats.
            mbarrier.arrive(qd_ready.index(slot), count=1)
        else:
            mbarrier.wait(qd_empty.index(slot), ((t // NUM_STAGES) & 1) ^ 1)
            _load_step(
                q_desc, do_desc, lse_desc, delta_desc, desc_b, off_h, q_row, row,
                qd_ready.index(slot), q_smem, do_smem, lse_smem, delta_smem, slot,
            )  # fmt: skip


@gluon.jit
def _dq_k_cols(k_smem, i, CONSUMER: gl.constexpr):
    """The columns of K tile ``i`` that this consumer's half of dQ reads (``D / 2`` of them)."""
    HEAD_DIM: gl.constexpr = k_smem.shape[4]
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    return k_smem.index(i).reshape([ROWS, HEAD_DIM]).slice(CONSUMER * DQ_COLS, DQ_COLS, dim=1)


@gluon.jit
def _empty_step(qd_ready, ds_free, ds_smem, t, CONSUMER: gl.constexpr, NUM_STAGES: gl.constexpr,
                DQ_WARPGROUP: gl.constexpr, s_layout: gl.constexpr):  # fmt: skip
    """The front of a consumer's step ``t`` whose rows see none of its keys (SKIP_MASKED,
    SKIP_WINDOW; P = dS = 0), without its products: the waits the step's loop makes, in order
    (its Q/dO slot loaded, so that every phase of ``qd_ready`` is waited in turn; its dS^T tile
    released, with the loop's parity for runs with each dQ a step late), then a zero dS^T tile,
    fenced. Returns the step's ``(slot, buf)``; the caller makes the step's arrives."""
    slot = t % NUM_STAGES
    buf = t % 2
    mbarrier.wait(qd_ready.index(slot), (t // NUM_STAGES) & 1)
    if DQ_WARPGROUP:
        mbarrier.wait(ds_free.index(buf), ((t // 2) & 1) ^ 1)
    else:
        mbarrier.wait(ds_free.index(buf), ((t // 2) + 1 + buf) & 1)
    ds_smem.index(2 * buf + CONSUMER).store(gl.zeros([ROWS, ROWS], ds_smem.dtype, layout=s_layout))
    fence_async_shared()
    return slot, buf


@gluon.jit
def _consumer(
    q_smem,
    k_smem,
    v_smem,
    do_smem,
    lse_smem,
    delta_smem,
    ds_smem,
    dq_smem,
    kv_ready,
    qd_ready,
    qd_empty,
    ds_ready,
    ds_free,
    dq_done,
    dq_desc,
    dk_desc,
    dv_desc,
    CU_Q,
    CU_K,
    DK,
    DV,
    kv_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    seqlen_pad,
    qk_scale,
    scale,
    window_left,
    window_right,
    softcap,
    ALIBI,
    stride_ab,
    total_q,
    total_k,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    CONSUMER: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    EVEN_N: gl.constexpr,
    DQ_WARPGROUP: gl.constexpr,
    ABLATE: gl.constexpr,
    KV_REGS: gl.constexpr = False,
    VARLEN: gl.constexpr = False,
    DQ_BESIDE_DK: gl.constexpr = False,
    FRESH_DESC: gl.constexpr = False,
    SKIP_MASKED: gl.constexpr = False,
    SKIP_WINDOW: gl.constexpr = False,
    BAND_MASK: gl.constexpr = False,
    LAG_OPTIONS: gl.constexpr = False,
):
    dtype: gl.constexpr = k_smem.dtype
    # Each step's dQ a step late (docstring, "Schedule"), except at D=128 with softcap or ALiBi:
    # there the carried head and query block tipped ptxas into 20-80% more spills, and those
    # variants measured 2-15% slower with it.
    # LAG_OPTIONS (``ops/bwd_sm90.DQ_LAG_OPTIONS``): lagged there too. With FRESH_DESC in those
    # builds ptxas keeps the carried indices: sm_90a causal softcap 96 -> 24 B, causal window
    # softcap 120 -> 36 B, non-causal softcap window 136 -> 68 B (non-causal softcap 16 -> 88 B,
    # outside the loops).
    DQ_LAG: gl.constexpr = HEAD_DIM == 64 or not (SOFTCAP or HAS_ALIBI) or LAG_OPTIONS
    # S^T, dP^T: (64 keys, 64 query rows); dK, dV: (64 keys, D); dQ: (64 query rows, D).
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, ROWS, 16]
    )
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    start_n, off_b, off_hk, q_start, k_start, seqlen_q, seqlen_k, desc_b = key_block(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
    )
    key0 = start_n + CONSUMER * ROWS
    keys = gl.expand_dims(key0 + gl.arange(0, ROWS, layout=row_layout), 1)
    offs_m = gl.arange(0, ROWS, layout=col_layout)
    lo, n_m = q_blocks(
        start_n, seqlen_q, seqlen_k, window_left, window_right, IS_CAUSAL, HAS_WINDOW
    )
    diag = seqlen_k - seqlen_q
    # Query blocks starting at or past this row see every key of this consumer: no causal mask.
    full_m = key0 + ROWS - 1 - (seqlen_k - seqlen_q)

    k_tile = k_smem.index(CONSUMER)
    v_tile = v_smem.index(CONSUMER)
    k_c = k_tile.reshape([ROWS, HEAD_DIM])
    v_c = v_tile.reshape([ROWS, HEAD_DIM])
    # dQ of a step: this consumer computes its half of the columns (DQ_COLS = D / 2), over both
    # consumers' keys (K_0 and K_1 with both dS^T tiles), and reduce-adds it.
    DQ_COLS: gl.constexpr = HEAD_DIM // 2
    k0_cols = _dq_k_cols(k_smem, 0, CONSUMER)
    k1_cols = _dq_k_cols(k_smem, 1, CONSUMER)
    dq_tile = dq_smem.index(CONSUMER)
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16]
    )
    zero_s = gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout)
    zero_dq = gl.zeros([ROWS, DQ_COLS], gl.float32, layout=dq_layout)
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)

    mbarrier.wait(kv_ready, 0)
    if KV_REGS:
        ka_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        # racecheck hand-over: zeroed rows
        k_a = k_c.load(ka_layout)
        # racecheck hand-over: zeroed rows
        v_a = v_c.load(ka_layout)
    else:
        k_a = k_c
        v_a = v_c
    n_steps = n_m * kv_group
    # The dQ of step t is computed in step t + 1 (and the last one after the loop): its wait for
    # the other consumer's dS^T then has a step of slack, so the consumers need not run in
    # lockstep, and one's elementwise work can run under the other's products.
    # The dQ rows' coordinates: the descriptor's row of this program's first head's row 0, and
    # the rows between heads (both 0 unless the staging rows are permuted: ``dq_rows``).
    dq_base, dq_per_head = dq_rows(
        dq_desc, desc_b, off_hk * kv_group, kv_heads * kv_group, seqlen_pad
    )
    prev_h = off_hk * kv_group
    prev_m = dq_base + q_start + lo
    t_first = 0
    # Causal (SKIP_MASKED), or a window's right edge when not causal (SKIP_WINDOW): row i
    # sees keys up to i + diag + right (right 0 when causal).
    SKIP_FIRST: gl.constexpr = (SKIP_MASKED and IS_CAUSAL) or (SKIP_WINDOW and HAS_WINDOW)
    if SKIP_FIRST and DQ_LAG and CONSUMER == 1:
        # The first step's rows see none of this consumer's keys (the block's diagonal step,
        # when its rows start at or below the diagonal of the block's first key: P = dS = 0).
        # Its products are skipped: a zero dS^T tile for both consumers' dQ products and the
        # step's barrier operations, in the loop's order, without the products (a run-time
        # branch around wgmmas crashes ptxas 12.8, so the step is peeled off the loop). The
        # loop's lagged dQ of "step -1" at t = 0 only arrives on ds_free[1] here. The dQ of
        # step 0 (prev_h, prev_m: already its head and rows) runs in step 1 as usual.
        right = 0
        if not IS_CAUSAL:
            right = window_right
        if n_steps > 0 and lo + ROWS - 1 + diag + right < key0:
            t_first = 1
            # Step 0's qd_ready wait too: skipped, the parity wait of step NUM_STAGES could pass
            # on the slot's first phase before that phase completed.
            _empty_step(qd_ready, ds_free, ds_smem, 0, CONSUMER, NUM_STAGES, DQ_WARPGROUP, s_layout)
            mbarrier.arrive(qd_empty.index(0), count=1)
            mbarrier.arrive(ds_ready.index(0), count=1)
            if not DQ_WARPGROUP:
                mbarrier.arrive(ds_free.index(1), count=1)
    t_last = n_steps
    if SKIP_WINDOW and HAS_WINDOW and DQ_LAG and CONSUMER == 0:  # noqa: SIM102 (constexpr)
        # A window's left edge: the last step's rows (its last head's last query block) see
        # none of this consumer's keys when the block's last key lies before the first row's
        # window (P = dS = 0). That step runs after the loop without its products (below).
        if n_steps > 0 and key0 + ROWS - 1 < lo + (n_m - 1) * ROWS + diag - window_left:
            t_last = n_steps - 1
    for t in range(t_first, t_last):
        off_h = off_hk * kv_group + t // n_m
        start_m = lo + (t % n_m) * ROWS
        slot = t % NUM_STAGES
        mbarrier.wait(qd_ready.index(slot), (t // NUM_STAGES) & 1)
        q = q_smem.index(slot).reshape([ROWS, HEAD_DIM])
        do = do_smem.index(slot).reshape([ROWS, HEAD_DIM])
        if FRESH_DESC and not KV_REGS:
            # The fixed tiles' views through a zero LLVM cannot see: their wgmma descriptors are
            # formed here each step, not before the loop (kernels/hopper/bwd_mla.py, FRESH_DESC).
            z = opaque(0)
            k_op = k_smem.index(CONSUMER + z).reshape([ROWS, HEAD_DIM])
            v_op = v_smem.index(CONSUMER + z).reshape([ROWS, HEAD_DIM])
            k0_step = _dq_k_cols(k_smem, z, CONSUMER)
            k1_step = _dq_k_cols(k_smem, 1 + z, CONSUMER)
        else:
            k_op = k_a
            v_op = v_a
            k0_step = k0_cols
            k1_step = k1_cols
        s_tok = warpgroup_mma(k_op, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(v_op, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        # lse2 and delta are read from shared memory where they are used: in the score layout a
        # row vector takes 16 registers a thread, and loaded early they overlapped S^T, dP^T, dK
        # and dV (spills at D=128).
        # racecheck hand-over: row stats
        lse2 = lse_smem.index(slot).load(col_layout)
        # Scores in log2 units as the forward forms them (ops/problem.py folds the units):
        # softcap (tanh of scale q.k / c, times c log2(e)), then ALiBi, then the masks.
        s = s * qk_scale
        if SOFTCAP:
            t_cap = tanh(s)
            s = t_cap * softcap
        if HAS_ALIBI:
            slope = gl.load(ALIBI + off_b.to(gl.int64) * stride_ab + off_h) * LOG2E
            rows = gl.expand_dims(start_m + offs_m, 0)
            s = s - slope * gl.abs(rows + diag - keys).to(gl.float32)
        if IS_CAUSAL and HAS_WINDOW and BAND_MASK:
            # Causal with a window: key j is seen from row i when 0 <= i + diag - j <= left, one
            # unsigned comparison (a key past the diagonal wraps to a large lag), on every step.
            rows = gl.expand_dims(start_m + offs_m, 0)
            lag = (rows + diag - keys).to(gl.uint32, bitcast=True)
            s = gl.where(lag <= window_left.to(gl.uint32, bitcast=True), s, float("-inf"))
        elif IS_CAUSAL:
            # Only the steps the diagonal crosses, except with softcap at D=128: on every step
            # there (behind the run-time branch ptxas 12.8 kept tanh's values and the scores
            # apart on both paths and spilled 700 B, 62-64 local accesses a step; 192 B and 4-7
            # this way, 1.08x). D=64 spills 16 B either way and keeps the branch.
            if (SOFTCAP and HEAD_DIM == 128) or start_m < full_m:
                rows = gl.expand_dims(start_m + offs_m, 0)
                s = gl.where(keys <= rows + diag, s, float("-inf"))
        elif not EVEN_N:  # noqa: SIM102 (a constexpr branch around a runtime one)
            # Keys past Sk (zeros) would get P = exp2(-lse2), which overflows fp16 for a row
            # whose LSE is below about -11, and then dQ = inf * 0 = NaN. Causal masks them above.
            if key0 + ROWS > seqlen_k:
                s = gl.where(keys < seqlen_k, s, float("-inf"))
        if HAS_WINDOW and not (IS_CAUSAL and BAND_MASK):
            # Every step (the band's edges cross query blocks at any offset; masking only the
            # steps that cross an edge, a run-time branch, made ptxas spill more).
            rows = gl.expand_dims(start_m + offs_m, 0)
            s = gl.where(keys >= rows + (diag - window_left), s, float("-inf"))
            if not IS_CAUSAL:
                s = gl.where(keys <= rows + (diag + window_right), s, float("-inf"))
        p = gl.exp2(s - gl.expand_dims(lse2, 0))
        dp = warpgroup_mma_wait(0, deps=[dp_tok])
        # racecheck hand-over: row stats
        delta = delta_smem.index(slot).load(col_layout)
        # dS^T before the dV issue: P^T's fp32 and register-operand copies are never live
        # together (16 registers less at the peak).
        ds = p * (dp - gl.expand_dims(delta, 0))
        if SOFTCAP:
            # d(c tanh(x / c)) / dx = 1 - tanh^2: dS with respect to the uncapped scores.
            ds = ds * (1.0 - t_cap * t_cap)
        ds = ds.to(dtype)
        p_op = gl.convert_layout(p.to(dtype), a_layout)
        dv_tok = warpgroup_mma(p_op, do, dv, is_async=True)
        # dS^T double-buffered over steps: tile [t % 2, c] was last read by both consumers' dQ
        # products of step t - 2 (ds_free; see the docstring for the phases).
        buf = t % 2
        if DQ_WARPGROUP:
            # Freed by the dQ warpgroup's products of step t - 2 (the first two pass).
            mbarrier.wait(ds_free.index(buf), ((t // 2) & 1) ^ 1)
        else:
            mbarrier.wait(ds_free.index(buf), ((t // 2) + 1 + DQ_LAG * buf) & 1)
        ds_smem.index(2 * buf + CONSUMER).store(ds)
        ds_op = gl.convert_layout(ds, a_layout)
        if DQ_BESIDE_DK and DQ_LAG and not DQ_WARPGROUP:
            # This consumer's dS^T of step t is in shared memory: fenced and announced at once.
            fence_async_shared()
            mbarrier.arrive(ds_ready.index(buf), count=1)
            # The dQ products of step t - 1 go in beside dV, and dK beside them; the dQ staging
            # then runs under dK. (At most two accumulators in flight at a time.)
            dq_tok = dq_issue(ds_smem, ds_ready, k0_step, k1_step, zero_dq, t - 1, ABLATE)
            dv, p_op = warpgroup_mma_wait(2, deps=[dv_tok, p_op])
            dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
            if ABLATE < 2:
                dq_tok = warpgroup_mma_wait(1, deps=[dq_tok])
            dq_finish(
                ds_free, dq_tile, dq_desc, dq_tok, t - 1, t > 0, desc_b, prev_h, prev_m,
                CONSUMER, ABLATE, q_start + seqlen_q, VARLEN,
            )  # fmt: skip
            dk, ds_op = warpgroup_mma_wait(0, deps=[dk_tok, ds_op])
            # Every reader of the slot is complete: S^T, dP^T, dV, dK and the lse2/delta loads.
            mbarrier.arrive(qd_empty.index(slot), count=1)
        else:
            dk_tok = warpgroup_mma(ds_op, q, dk, is_async=True)
            fence_async_shared()
            # dV and dK complete before dQ is issued: with all three in flight (192 accumulator
            # registers plus P^T and dS^T held for the running products) ptxas serialised the
            # wgmmas (C7512) and spilled 240-328 B at D=128.
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, p_op, ds_op])
            # Every reader of the slot is complete: S^T, dP^T, dV, dK and the lse2/delta loads
            # (Gluon syncs the warpgroup before the single-thread arrive).
            mbarrier.arrive(qd_empty.index(slot), count=1)
            # This consumer's dS^T of step t is in shared memory (written and fenced before the
            # wait above).
            mbarrier.arrive(ds_ready.index(buf), count=1)
            if DQ_WARPGROUP:
                # A wait for no bulk copy (this consumer has none outstanding): without an
                # instruction here ptxas 12.8 (Triton 3.6's) crashes (SIGSEGV) on the step with
                # no dQ phase; ptxas 13.0 compiles it either way.
                tma.store_wait(0)
            elif DQ_LAG:
                # The dQ of step t - 1 (at t = 0 of no step: computed from whatever the tiles
                # hold, as a run-time branch around the products crashes ptxas, and not reduced).
                dq_step(
                    ds_smem, ds_ready, ds_free, k0_step, k1_step, dq_tile, dq_desc, zero_dq,
                    t - 1, t > 0, desc_b, prev_h, prev_m, CONSUMER, ABLATE, q_start + seqlen_q,
                    VARLEN,
                )  # fmt: skip
            else:
                dq_step(
                    ds_smem, ds_ready, ds_free, k0_step, k1_step, dq_tile, dq_desc, zero_dq, t,
                    True, desc_b, off_h,
                    dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m), CONSUMER, ABLATE,
                    q_start + seqlen_q, VARLEN,
                )  # fmt: skip
        if DQ_LAG and not DQ_WARPGROUP:
            # This step's dQ runs in the next one (or after the loop): its head and rows.
            prev_h = off_h
            prev_m = dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m)
    # SKIP_WINDOW: the last step when its rows see none of this consumer's keys (none otherwise):
    # its waits, a zero dS^T tile and its arrives in the loop's order, and the previous step's
    # dQ, without the step's own products. (A loop of at most one step, not a run-time branch:
    # such a branch around products crashed ptxas 12.8 in this kernel.)
    if SKIP_WINDOW and HAS_WINDOW and DQ_LAG and CONSUMER == 0:
        for t in range(t_last, n_steps):
            off_h = off_hk * kv_group + t // n_m
            start_m = lo + (t % n_m) * ROWS
            slot, buf = _empty_step(
                qd_ready, ds_free, ds_smem, t, CONSUMER, NUM_STAGES, DQ_WARPGROUP, s_layout
            )
            # The arrives in the order of the step's path: with the dQ products beside dK the
            # slot is freed after the previous step's dQ, otherwise before it.
            beside: gl.constexpr = DQ_BESIDE_DK and not DQ_WARPGROUP
            if not beside:
                mbarrier.arrive(qd_empty.index(slot), count=1)
            mbarrier.arrive(ds_ready.index(buf), count=1)
            if DQ_WARPGROUP:
                tma.store_wait(0)
            else:
                dq_step(
                    ds_smem, ds_ready, ds_free, k0_cols, k1_cols, dq_tile, dq_desc, zero_dq,
                    t - 1, t > 0, desc_b, prev_h, prev_m, CONSUMER, ABLATE, q_start + seqlen_q,
                    VARLEN,
                )  # fmt: skip
            if beside:
                mbarrier.arrive(qd_empty.index(slot), count=1)
            if not DQ_WARPGROUP:
                prev_h = off_h
                prev_m = dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m)

    # Until the other consumer's last dQ products, which read this consumer's K tile, have
    # completed: the epilogue overwrites it. With DQ_LAG the last step's dQ (none without steps)
    # comes first. (Phases: the docstring.)
    if DQ_WARPGROUP:
        # The dQ warpgroup's last products (which read both K tiles) have completed.
        mbarrier.wait(dq_done, 0)
    elif DQ_LAG:
        dq_step(
            ds_smem, ds_ready, ds_free, k0_cols, k1_cols, dq_tile, dq_desc, zero_dq,
            n_steps - 1, n_steps > 0, desc_b, prev_h, prev_m, CONSUMER, ABLATE,
            q_start + seqlen_q, VARLEN,
        )  # fmt: skip
        mbarrier.wait(ds_free.index((n_steps + 1) % 2), (n_steps // 2) & 1)
    else:
        mbarrier.wait(ds_free.index((n_steps + 1) % 2), ((n_steps + 1) // 2 + 1) & 1)
    # Epilogue: dK, dV through this consumer's K and V slots (their last readers are complete).
    # VARLEN: keys that cross the sequence's end are stored with a row mask (the rows after its
    # last key are the next sequence's).
    key = k_start + key0
    if VARLEN:
        if key0 + ROWS > seqlen_k:
            n_keys = seqlen_k - key0
            store_rows(DK, dk_desc, k_tile, dk * scale, key, n_keys, off_hk, stride_dkt, stride_dkh)
            store_rows(DV, dv_desc, v_tile, dv, key, n_keys, off_hk, stride_dvt, stride_dvh)
        else:
            _store_dk_dv(dk_desc, dv_desc, k_tile, v_tile, dk * scale, dv, desc_b, off_hk, key)
    else:
        _store_dk_dv(dk_desc, dv_desc, k_tile, v_tile, dk * scale, dv, desc_b, off_hk, key)
    tma.store_wait(0)


@gluon.jit
def _dq_warpgroup(
    ds_smem,
    k_smem,
    dq_smem,
    kv_ready,
    ds_ready,
    ds_free,
    dq_done,
    dq_desc,
    CU_Q,
    CU_K,
    kv_heads,
    kv_group,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    seqlen_pad,
    window_left,
    window_right,
    total_q,
    total_k,
    HEAD_DIM: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    ABLATE: gl.constexpr,
    VARLEN: gl.constexpr,
):
    """DQ_WARPGROUP: every step's dQ (all D columns, over both consumers' keys) on a warpgroup
    of its own, reduce-added from two staging tiles in turn, so that the consumers' steps hold
    no dQ phase (docstring, "Schedule")."""
    start_n, _, off_hk, q_start, _, seqlen_q, seqlen_k, desc_b = key_block(
        CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
    )
    lo, n_m = q_blocks(
        start_n, seqlen_q, seqlen_k, window_left, window_right, IS_CAUSAL, HAS_WINDOW
    )
    # All D columns of a step in one 64 x D fp32 accumulator (D=64 only: the launcher's config;
    # at D=128 the consumers need 240 registers, docstring), through two staging tiles in turn.
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    zero_dq = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=dq_layout)
    k0 = k_smem.index(0).reshape([ROWS, HEAD_DIM])
    k1 = k_smem.index(1).reshape([ROWS, HEAD_DIM])
    dq_base, dq_per_head = dq_rows(
        dq_desc, desc_b, off_hk * kv_group, kv_heads * kv_group, seqlen_pad
    )
    mbarrier.wait(kv_ready, 0)
    for t in range(n_m * kv_group):
        off_h = off_hk * kv_group + t // n_m
        start_m = lo + (t % n_m) * ROWS
        buf = t % 2
        # Both consumers' dS^T tiles of step t are written (the k-th completion is step 2k + buf).
        mbarrier.wait(ds_ready.index(buf), (t // 2) & 1)
        ds0 = ds_smem.index(2 * buf).permute((1, 0))
        ds1 = ds_smem.index(2 * buf + 1).permute((1, 0))
        dq_tok = warpgroup_mma(ds0, k0, zero_dq, use_acc=False, is_async=True)
        dq_tok = warpgroup_mma(ds1, k1, dq_tok, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(ds_free.index(buf), count=1)
        # Staging tile t % 2 was last read by step t - 2's reduce: at most one reduce (step
        # t - 1's) may still be reading shared memory.
        stage = dq_smem.index(t % 2)
        tma.store_wait(1)
        if VARLEN:
            dq = rows_of_sequence(dq, seqlen_q - start_m)
        stage_dq(stage, dq)
        fence_async_shared()
        if ABLATE == 0:
            row = dq_row(dq_base, dq_per_head, t // n_m, q_start + start_m)
            reduce_dq(dq_desc, desc_b, off_h, row, 0, stage)
    # Nothing reads K any more: the consumers may overwrite it with dK, dV.
    mbarrier.arrive(dq_done, count=1)
    tma.store_wait(0)


@gluon.jit
def attn_bwd_sm90_kernel(
    q_desc,
    k_desc,
    v_desc,
    do_desc,
    lse_desc,
    delta_desc,
    dq_desc,
    dk_desc,
    dv_desc,
    ALIBI,
    CU_Q,
    CU_K,
    DK,
    DV,
    LSE2,
    DELTA,
    kv_heads,
    kv_group,
    kv_share,
    seqlen_q,
    seqlen_k,
    lpt_heads,
    seqlen_pad,
    qk_scale,
    scale,
    window_left,
    window_right,
    softcap,
    stride_ab,
    total_q,
    total_k,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    HEAD_DIM: gl.constexpr,
    NUM_STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr,
    SOFTCAP: gl.constexpr,
    HAS_ALIBI: gl.constexpr,
    EVEN_N: gl.constexpr,
    DQ_WARPGROUP: gl.constexpr = False,
    DQ_REGS: gl.constexpr = 96,
    ABLATE: gl.constexpr = 0,
    KV_REGS: gl.constexpr = False,
    VARLEN: gl.constexpr = False,
    PERMUTED_ROWS: gl.constexpr = False,
    DQ_BESIDE_DK: gl.constexpr = False,
    PDL: gl.constexpr = False,
    FRESH_DESC: gl.constexpr = False,
    SKIP_MASKED: gl.constexpr = False,
    SKIP_WINDOW: gl.constexpr = False,
    BAND_MASK: gl.constexpr = False,
    LAG_OPTIONS: gl.constexpr = False,
):
    if PDL:
        # The dQ conversion may launch now (it waits for this grid before reading DQ_ACC).
        gdc_launch_dependents()
    # The dQ staging rows' order follows from the dQ descriptor's box (``bwd_dq.stage_dq``); the
    # flag states it among the constexprs, which key the launcher's compiled kernels.
    gl.static_assert(permuted_box(dq_desc.block_type.shape) == PERMUTED_ROWS)
    if VARLEN:
        # The grid is sized by the longest sequence: a key block past its own has nothing to do.
        start_n, _, _, _, _, _, n_keys, _ = key_block(
            CU_Q, CU_K, kv_heads, seqlen_q, seqlen_k, lpt_heads, total_q, total_k, VARLEN
        )
        if start_n >= n_keys:
            if PDL:
                # Every program waits for the prep kernel, so that this grid (and the dQ
                # conversion, which waits for it) never completes before the prep.
                gdc_wait()
            return
    dtype: gl.constexpr = q_desc.dtype
    # Buffers are [slots, 1, 1, rows, D]: one 4-D TMA box per slot.
    q_shape: gl.constexpr = [NUM_STAGES] + q_desc.block_type.shape  # noqa: RUF005
    kv_shape: gl.constexpr = [2] + k_desc.block_type.shape  # noqa: RUF005
    row_shape: gl.constexpr = [NUM_STAGES] + lse_desc.block_type.shape  # noqa: RUF005
    # dQ staging: per consumer, one fp32 tile of its half of the columns.
    dq_shape: gl.constexpr = [2] + dq_desc.block_type.shape  # noqa: RUF005
    q_smem = gl.allocate_shared_memory(dtype, q_shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, q_shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, kv_shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, kv_shape, v_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, row_shape, lse_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, row_shape, delta_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [4, ROWS, ROWS], ds_layout)  # [step % 2, consumer]
    dq_smem = gl.allocate_shared_memory(gl.float32, dq_shape, dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    kv_ready = kv_bar.index(0)
    qd_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qd_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    dq_done = done_bar.index(0)
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(dq_done, count=1)
    if VARLEN:
        # The producer's own barrier for the loads it bounds (a sequence's last key block and
        # query blocks).
        fix = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        fix_bar = fix.index(0)
        mbarrier.init(fix_bar, count=1)
    else:
        fix_bar = kv_ready  # never touched
    for i in gl.static_range(NUM_STAGES):
        # VARLEN: the producer's own arrival for the row stats it stores, besides the copies'.
        mbarrier.init(qd_ready.index(i), count=2 if VARLEN else 1)
        mbarrier.init(qd_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
        mbarrier.init(ds_free.index(i), count=1 if DQ_WARPGROUP else 2)

    # The two consumers' argument tuples differ only in CONSUMER (0, 1). They are spelled out:
    # Triton 3.6's frontend has no starred tuples, and a concatenated tuple loses its constexprs.
    if DQ_WARPGROUP:
        gl.warp_specialize(
            [
                (_consumer, (
                    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                    kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc,
                    dv_desc, CU_Q, CU_K, DK, DV, kv_heads, kv_group, seqlen_q, seqlen_k,
                    lpt_heads, seqlen_pad, qk_scale, scale, window_left, window_right, softcap,
                    ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, 0, HEAD_DIM, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
                    EVEN_N, DQ_WARPGROUP, ABLATE, KV_REGS, VARLEN, DQ_BESIDE_DK, FRESH_DESC,
                    SKIP_MASKED, SKIP_WINDOW, BAND_MASK, LAG_OPTIONS,
                )),
                (_consumer, (
                    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                    kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc,
                    dv_desc, CU_Q, CU_K, DK, DV, kv_heads, kv_group, seqlen_q, seqlen_k,
                    lpt_heads, seqlen_pad, qk_scale, scale, window_left, window_right, softcap,
                    ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, 1, HEAD_DIM, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
                    EVEN_N, DQ_WARPGROUP, ABLATE, KV_REGS, VARLEN, DQ_BESIDE_DK, FRESH_DESC,
                    SKIP_MASKED, SKIP_WINDOW, BAND_MASK, LAG_OPTIONS,
                )),
                (_dq_warpgroup, (
                    ds_smem, k_smem, dq_smem, kv_ready, ds_ready, ds_free, dq_done, dq_desc, CU_Q,
                    CU_K, kv_heads, kv_group, seqlen_q, seqlen_k, lpt_heads, seqlen_pad,
                    window_left, window_right, total_q, total_k, HEAD_DIM, IS_CAUSAL, HAS_WINDOW,
                    ABLATE, VARLEN,
                )),
                (_producer, (
                    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, k_smem, v_smem,
                    do_smem, lse_smem, delta_smem, kv_ready, qd_ready, qd_empty, fix_bar, CU_Q,
                    CU_K, LSE2, DELTA, kv_heads, kv_group, kv_share, seqlen_q, seqlen_k, lpt_heads,
                    seqlen_pad, window_left, window_right, total_q, total_k, NUM_STAGES,
                    IS_CAUSAL, HAS_WINDOW, VARLEN, PDL,
                )),
            ],
            [4, 4, 1],
            [CONSUMER_REGS, DQ_REGS, 24],
        )  # fmt: skip
    else:
        gl.warp_specialize(
            [
                (_consumer, (
                    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                    kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc,
                    dv_desc, CU_Q, CU_K, DK, DV, kv_heads, kv_group, seqlen_q, seqlen_k,
                    lpt_heads, seqlen_pad, qk_scale, scale, window_left, window_right, softcap,
                    ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, 0, HEAD_DIM, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
                    EVEN_N, DQ_WARPGROUP, ABLATE, KV_REGS, VARLEN, DQ_BESIDE_DK, FRESH_DESC,
                    SKIP_MASKED, SKIP_WINDOW, BAND_MASK, LAG_OPTIONS,
                )),
                (_consumer, (
                    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                    kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc,
                    dv_desc, CU_Q, CU_K, DK, DV, kv_heads, kv_group, seqlen_q, seqlen_k,
                    lpt_heads, seqlen_pad, qk_scale, scale, window_left, window_right, softcap,
                    ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, 1, HEAD_DIM, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
                    EVEN_N, DQ_WARPGROUP, ABLATE, KV_REGS, VARLEN, DQ_BESIDE_DK, FRESH_DESC,
                    SKIP_MASKED, SKIP_WINDOW, BAND_MASK, LAG_OPTIONS,
                )),
                (_producer, (
                    q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, q_smem, k_smem, v_smem,
                    do_smem, lse_smem, delta_smem, kv_ready, qd_ready, qd_empty, fix_bar, CU_Q,
                    CU_K, LSE2, DELTA, kv_heads, kv_group, kv_share, seqlen_q, seqlen_k, lpt_heads,
                    seqlen_pad, window_left, window_right, total_q, total_k, NUM_STAGES,
                    IS_CAUSAL, HAS_WINDOW, VARLEN, PDL,
                )),
            ],
            [4, 1],
            [CONSUMER_REGS, 24],
        )  # fmt: skip
