"""FlashAttention-3-style backward for Hopper (sm_90a) in Gluon: one pass per key block, dQ by
TMA reduce-add. Compiled for sm_90a on the CPU (``tests/test_compile_hopper_bwd.py``) and checked
on the H100 (``scripts/hopper_bwd.py check``, the GPU tests of ``tests/test_backward_sm90.py``).
This module holds the kernel (its buffers, barriers and partitions); the producer warp and each
program's work are in ``bwd_load.py``, the consumer warpgroups and the dQ warpgroup in
``bwd_steps.py``, dQ's staging and reduce in ``bwd_dq.py``, the row kernels before and after it
in ``bwd_rows.py``.

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

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from flashcore.kernels.hopper.bwd_dq import permuted_box
from flashcore.kernels.hopper.bwd_load import ROWS, key_block, producer
from flashcore.kernels.hopper.bwd_steps import consumer, dq_warpgroup


@gluon.jit
def _consumer_0(
    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_ready, qd_ready,
    qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc, dv_desc, CU_Q, CU_K, DK, DV, kv_heads,
    kv_group, seqlen_q, seqlen_k, lpt_heads, seqlen_pad, qk_scale, scale, window_left, window_right,
    softcap, ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr,
    HAS_WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, EVEN_N: gl.constexpr,
    DQ_WARPGROUP: gl.constexpr, ABLATE: gl.constexpr, KV_REGS: gl.constexpr = False,
    VARLEN: gl.constexpr = False, DQ_BESIDE_DK: gl.constexpr = False,
    FRESH_DESC: gl.constexpr = False, SKIP_MASKED: gl.constexpr = False,
    SKIP_WINDOW: gl.constexpr = False, BAND_MASK: gl.constexpr = False,
    LAG_OPTIONS: gl.constexpr = False,
):  # fmt: skip
    """Consumer 0, the default partition: ``bwd_steps.consumer`` (CONSUMER 0) called from the
    kernel's module. Triton 3.6's line info gives the default partition's own lines the file of
    its kernel: with ``consumer`` itself as the default partition, racecheck (H200) read consumer
    0's loads at ``bwd_steps.py``'s line numbers in ``bwd.py``. Called from here, its body is an
    inlined call that keeps its own file; consumer 1, a worker partition, is named right either
    way."""
    consumer(
        q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem, kv_ready, qd_ready,
        qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc, dv_desc, CU_Q, CU_K, DK, DV,
        kv_heads, kv_group, seqlen_q, seqlen_k, lpt_heads, seqlen_pad, qk_scale, scale, window_left,
        window_right, softcap, ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh,
        stride_dvt, stride_dvh, 0, HEAD_DIM, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
        EVEN_N, DQ_WARPGROUP, ABLATE, KV_REGS, VARLEN, DQ_BESIDE_DK, FRESH_DESC, SKIP_MASKED,
        SKIP_WINDOW, BAND_MASK, LAG_OPTIONS,
    )  # fmt: skip


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
                (_consumer_0, (
                    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                    kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc,
                    dv_desc, CU_Q, CU_K, DK, DV, kv_heads, kv_group, seqlen_q, seqlen_k,
                    lpt_heads, seqlen_pad, qk_scale, scale, window_left, window_right, softcap,
                    ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, HEAD_DIM, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
                    EVEN_N, DQ_WARPGROUP, ABLATE, KV_REGS, VARLEN, DQ_BESIDE_DK, FRESH_DESC,
                    SKIP_MASKED, SKIP_WINDOW, BAND_MASK, LAG_OPTIONS,
                )),
                (consumer, (
                    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                    kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc,
                    dv_desc, CU_Q, CU_K, DK, DV, kv_heads, kv_group, seqlen_q, seqlen_k,
                    lpt_heads, seqlen_pad, qk_scale, scale, window_left, window_right, softcap,
                    ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, 1, HEAD_DIM, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
                    EVEN_N, DQ_WARPGROUP, ABLATE, KV_REGS, VARLEN, DQ_BESIDE_DK, FRESH_DESC,
                    SKIP_MASKED, SKIP_WINDOW, BAND_MASK, LAG_OPTIONS,
                )),
                (dq_warpgroup, (
                    ds_smem, k_smem, dq_smem, kv_ready, ds_ready, ds_free, dq_done, dq_desc, CU_Q,
                    CU_K, kv_heads, kv_group, seqlen_q, seqlen_k, lpt_heads, seqlen_pad,
                    window_left, window_right, total_q, total_k, HEAD_DIM, IS_CAUSAL, HAS_WINDOW,
                    ABLATE, VARLEN,
                )),
                (producer, (
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
                (_consumer_0, (
                    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                    kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc,
                    dv_desc, CU_Q, CU_K, DK, DV, kv_heads, kv_group, seqlen_q, seqlen_k,
                    lpt_heads, seqlen_pad, qk_scale, scale, window_left, window_right, softcap,
                    ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, HEAD_DIM, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
                    EVEN_N, DQ_WARPGROUP, ABLATE, KV_REGS, VARLEN, DQ_BESIDE_DK, FRESH_DESC,
                    SKIP_MASKED, SKIP_WINDOW, BAND_MASK, LAG_OPTIONS,
                )),
                (consumer, (
                    q_smem, k_smem, v_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_smem,
                    kv_ready, qd_ready, qd_empty, ds_ready, ds_free, dq_done, dq_desc, dk_desc,
                    dv_desc, CU_Q, CU_K, DK, DV, kv_heads, kv_group, seqlen_q, seqlen_k,
                    lpt_heads, seqlen_pad, qk_scale, scale, window_left, window_right, softcap,
                    ALIBI, stride_ab, total_q, total_k, stride_dkt, stride_dkh, stride_dvt,
                    stride_dvh, 1, HEAD_DIM, NUM_STAGES, IS_CAUSAL, HAS_WINDOW, SOFTCAP, HAS_ALIBI,
                    EVEN_N, DQ_WARPGROUP, ABLATE, KV_REGS, VARLEN, DQ_BESIDE_DK, FRESH_DESC,
                    SKIP_MASKED, SKIP_WINDOW, BAND_MASK, LAG_OPTIONS,
                )),
                (producer, (
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
