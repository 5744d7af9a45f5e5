#!/usr/bin/env bash
# Issue 26 on the H200: host time of step() with its breakdown (benchmarks/host_time.py), and tests/gpu. Run through
# the device tool: OUT=$OUT bash benchmarks/gpu_issue26.sh [TAG]. Writes $OUT/host_time_TAG.{txt,json}, $OUT/tests_TAG.txt,
# $OUT/first_TAG.txt. STEP_GRAPH=1: host_time.py also times the step graph's guard (--step-graph) in the same blocks.
# Stop 41 ran call a on an H100 (benchmarks/results/gpu_stop41/, with call b: benchmarks/gpu_graph_keys.py and the tests);
# stop 42 ran calls c, d and e (benchmarks/results/gpu_stop42*/). The next session, first: FIRST=1 TESTS=1 MODELS=mlp (the
# graphs' counts after 2569462: 4 graphs kept, 16 misses before a rest), then the GPT-2 350M rows (MODELS=gpt2-350m,
# PROFILE=0, --blocks 6: its rows alone take ~400 s at 10 blocks), each call under the 600 s bound.
# Stop 43 (benchmarks/results/gpu_stop43_*/) left for the next: the whole tests/gpu once (not run whole since stop 42's call
# d), and the fp8 step graph's host effect: `python benchmarks/host_time.py --device cuda --models mlp-fp8 --optims fused
# --step-graph` (the torchao wheel carried: pip install --no-index --no-deps --target /tmp/site .whl/torchao-*.whl and
# PYTHONPATH=$PWD:/tmp/site), whose "guard" arm is how fp8 steps ran before 4676bd1; then a quiet fp8_cost.py run.
# Stop 44 (benchmarks/results/gpu_stop44_*/) ran those. Left for the next: the whole tests/gpu on 4244e0c's capture
# credits (call a's whole run failed the step graph's fp16 fused bound, 8 captures; call c passed that file with three
# others), the framework rows and the compiled row (not measured since stop 37), GPT-2 350M, foreach, and eager fp8.
# Stop 45 had no device. It built reports in batches (4e359e8): the next call, first, STEP_GRAPH=1 BATCH=1 MODELS=mlp
# (host_time.py --batch-arm: the step graph's guard with and without the batches, in the same blocks; read the means),
# then the whole tests/gpu (TESTS=1), then MODELS=gpt2-350m with BATCH=1 (its settle was 432 us a step at stop 40).
# Stop 46 ran those on an H100 (benchmarks/results/gpu_stop46/). Left for the next, first: MODELS=gpt2-350m,mlp OPS=0
# BLOCKS=4 STEP_GRAPH=1 BATCH=1 (host_time.py now prints each stage's mean: the batched arm's whole-step mean rose
# while its settle fell, find where), then the framework rows twice, as shipped and with AMPGUARD_REPORT_BATCH=0 (one
# H100 run read accelerate 1.140, H200 runs 1.001-1.079: lease or regression?), and with their profile (python
# benchmarks/frameworks_cost.py --device cuda --blocks 6 --pstats $OUT/fw_pstats: where the guarded arms' 1-3 ms a
# step go; not a timing run), then
# FP8_EAGER=1 with FP8_S=400 FP8_BLOCKS=30 alone in its call (190 s was not enough), and GPT-2 350M foreach.
# Stop 47 got no device (its whole budget went on refused starts). It changed what the framework rows measure: the
# guard steps accelerate's prepared scheduler (no read of step_was_skipped, which waited for the whole optimizer step
# every step), and a read of the skip every step waits for the decision only (Reporter.early_skip). The next call,
# first: FIRST=0 TESTS=0 HOST=0 FRAMEWORKS=1 FW_BASE=c3def41 FW_BLOCKS=16 FRAMEWORKS_S=100 (stop 46's library and
# this one in turn, twice, ~450 s), then tests/gpu whole (its two new tests in test_gpu_host.py), then the rest above.
# FW_LIST=...,transformers_noclip adds the Trainer without clipping (max_grad_norm=0; issue 26's 1.005 row, never run).
# Stop 48 ran those on an H100 (benchmarks/results/gpu_stop48/, RESULTS.md "Stop 48"): no difference beyond the noise
# (paired quartiles +-10 %), tests/gpu failed the accelerate LR lag (fixed, 9 passed after), eager fp8 1.041/1.023 (the
# monitor's own amax reductions). Then the eager fp8 monitor took torchao's own amax (ampguard/fp8.py, _Taps). The next
# session, first: FIRST=0 TESTS=0 HOST=0 FP8_EAGER=1 FP8_S=380 FP8_BLOCKS=30 (the taps' effect: 1.023 before), then
# tests/gpu whole (TESTS=1; test_gpu_fp8.py runs the taps on CUDA), then the framework rows with their graphs' counts
# (FRAMEWORKS=1 FW_LIST=transformers,lightning: the measurement graph ran eagerly on 64 and 80 of 80 steps there).
# The device's .git is a copy made at a session's first call: `git log` there names that commit, not the tree's.
# FW_BLOCK=20 runs 20 steps a round (10 by default): stop 48's rounds of 10 steps varied by +-10 %.
# Stop 49 (benchmarks/results/gpu_stop49/): the taps' unsampled fp8 cost 1.015-1.025 (host-bound lease: wall 177 ms, kernels
# 162), sampled 1.065-1.068 (~4500 launches a sampled step). Then the amaxes converted per dtype in collect() and sampled
# casts through the taps (8 kernels a cast): FP8_EAGER=1 FP8_VARIANTS=plain,guard+fp8,guard+fp8-nosample FP8_BASE=a8f7cb2
# (this tree, then a8f7cb2's, in one call). Call 5 ran that: 1.030 / 1.010 against 1.061 / 1.024. After the device time,
# afab373 put a sampled step's tensorwise samples in one buffer (one kernel a cast, was 8). The next session, first:
# FIRST=0 TESTS=1 HOST=0 (tests/gpu whole: the buffer and the per-dtype amaxes on CUDA), then FP8_EAGER=1
# FP8_VARIANTS=plain,guard,guard+fp8,guard+fp8-nosample FP8_BASE=dcf82c8 FP8_S=400 (the buffer's effect, same lease).
# Stop 50 (benchmarks/results/gpu_stop50/, RESULTS.md "Stop 50"): tests/gpu 76 passed on fa43d14; eager fp8 with the
# buffer 0.999 / 1.002 (call 2) and 1.015 / 1.015 (call 3, a wider spread); compiled b32 1.008 / 1.006 and 1.007 / 1.005
# (gpu_issue28.sh j); host_time.py twice. Then, on the CPU only: grad_output casts through the taps by linear_mm_config
# (no gradient hook), and two monitors on one model sharing a visit. The next session, first: FIRST=0 TESTS=1 HOST=0
# (tests/gpu whole), then FP8_EAGER=1 FP8_VARIANTS=plain,plain2,guard,guard+fp8,guard+fp8-nosample FP8_BASE=fa43d14
# FP8_S=450 (the taps' effect on a host-bound lease, with the control this time).
# Stop 51 (benchmarks/results/gpu_stop51/, RESULTS.md "Stop 51") ran those and gpu_issue28.sh j twice more: tests/gpu 76
# passed on 27ad18f; eager fp8 unresolved by the wall clock (the control alone +-3 %), kernel time +0.00 ms unsampled over
# the guard; compiled monitor 1.009 / 1.007, unsampled 1.006 / 1.006 against the guard's 1.005 / 1.005. The next session,
# first (nothing since needs tests/gpu beyond test_gpu_fp8.py): the compiled profile by kernel name, guard against plain,
# to confirm what the decision's small kernels cost (benchmarks/results/cpu_stop51/decision_ops.out counts 40 besides
# the norms in bf16, 72 in fp16): `python benchmarks/fp8_cost.py --device cuda --compile --batch 32 --blocks 4 --steps 5
# --profile-steps 10 --variants plain,guard,guard+fp8-nosample` (carry .whl; PYTHONPATH=$PWD:/tmp/site), then fewer of
# them (constants cached, the rule's where/or chains folded) and gpu_issue28.sh j again. Before those, tests/gpu whole
# (FIRST=0 TESTS=1 HOST=0): after the device calls stop 51 wrapped every module hook of the guard in
# ampguard.module_hooks.Hook (7980ab1; the CPU compile tests pass: one graph, no recompile) and added the finalizers.
# Stop 52 (benchmarks/results/gpu_stop52/, RESULTS.md "Stop 52") ran tests/gpu whole on 200126b (76 passed) and the
# compiled profile before and after the decision's kernel cut (gpu_issue28.sh PROFILE=1 PROFILE_BASE=453fd82): the guard
# adds 46 kernels (was 71), 160 us of kernel time (was 220). The lease was too noisy for the wall-clock ratios. The next
# session, first: gpu_issue28.sh j twice (COMPILE_RUNS="1 2" FP8_PROFILE_STEPS=10: each run also gives the kernel-time
# ratios, which a noisy lease does not hide), with plain2 as the control, to read
# the unsampled fp8 monitor against issue 28's 1.005 by the wall clock.
# Stop 53 (benchmarks/results/gpu_stop53/, RESULTS.md "Stop 53") ran it on a quiet lease: compiled unsampled 1.0048 /
# 1.0050, sampled 1.0061 / 1.0070; tests/gpu 76 passed on f2242e6; eager b32 one run of 24 blocks (1.0016 / 1.0028);
# the framework rows twice (Lightning 1.036 / 1.041, its measurement graph never captured). The next session, two
# calls. Call 1: `PYTHONPATH=$PWD python benchmarks/results/gpu_stop53/lightning_keys.py cuda lightning`, the same
# with no arguments (~60 s each: whether Lightning's gradient addresses repeat alone and among six loops), then
# issue 28's eager figure as the issue asks (>= 30 blocks, run 1 of 2): FIRST=0 TESTS=0 HOST=0 FP8_EAGER=1
# FP8_VARIANTS=plain,plain2,guard,guard+fp8,guard+fp8-nosample FP8_BLOCKS=30 FP8_S=400 (~340 s). Call 2: the eager run
# again (run 2), then tests/gpu/test_gpu_fp8.py (bec722d changed the taps after stop 53's device calls).
# Stop 54 (benchmarks/results/gpu_stop54/, RESULTS.md "Stop 54") ran both: eager b32 monitor 1.0027 / 1.0028, unsampled
# 1.0015 / 1.0017 (30 blocks each); test_gpu_fp8.py 5 passed on 1a11178; Lightning's gradient keys distinct on every
# step, alone and among the six loops (its closure zeroes the gradients after the forward). Then feb630c freed them
# before the closure (AmpGuardPrecision(free_grads_first=True)): its GPU test replayed 21 of 24 steps (0 before), peak
# 295 MiB lower; the framework rows read +-15 % on that lease. FW_BASE never worked before d4be5c2 (the tree's root
# was put ahead of PYTHONPATH). The next session, first: FIRST=0 TESTS=0 HOST=0 FRAMEWORKS=1 FW_BASE=1a11178
# FW_BLOCKS=30 FRAMEWORKS_S=110 (stop 53's library, then this one, twice: the Lightning row before and after on one
# lease; check each JSON's versions.ampguard_from), then the whole tests/gpu (TESTS=1).
# Stop 55 (benchmarks/results/gpu_stop55/, RESULTS.md "Stop 55") got one H100 for 389 s after 1400 s of refused starts:
# a non-fused optimizer's new path (the tensor decision in the step graph, the skip read once) cut foreach's host time
# (MLP +327 -> +204 us, GPT-2 350M +1117 -> -86 us, one run each); tests/gpu then failed six diagnosis scenarios and
# the usage-pattern recipe (named a step late), which 58a6c56 fixed on the CPU only. The next session, first:
# FIRST=0 TESTS=1 HOST=0 (tests/gpu whole on 58a6c56 or later), then FIRST=0 TESTS=0 HOST=1 MODELS=mlp,gpt2-350m
# OPTIMS=foreach,fused BLOCKS=5 OPS=0 STEP_GRAPH=1 HOST_ARM=1 HOST_S=400 (run 2 of the foreach rows, fused beside
# them), then FIRST=0 TESTS=0 HOST=0 TABLE_GROUPS=sentinel,foreach TABLE_S=200 TABLE_BLOCKS=30 (the sentinel's 1.005
# row after 220637c, the hand loop's foreach 1.01 row), then the framework rows above (FW_BASE=1a11178).
# Stop 56 got no device (98 s of budget, no start allowed): the list above stands, in that order. Its one change on the
# step's path (982d211: the CPU unscale by a 0-d tensor) runs on the CPU only and needs no device call.
# Stop 57 got no device either (28 tries, 15 failed starts and 13 turned away, spent 1617 s of its 1800). Its change on CUDA's
# path, c2a7768 (a non-fused step's skip read copies the step graph's whole payload: Decision.packed_host), is tested
# on the CPU only. The next session, first and short: FIRST=0 TESTS=1 HOST=0 (tests/gpu whole: 58a6c56's late cause and
# c2a7768's payload, both unrun on CUDA), then FIRST=0 TESTS=0 HOST=0 HOST_BASE=eb86e04 (c2a7768's host effect, MLP
# foreach, eb86e04's library and this tree's in turn, two rounds; HB_MODELS=mlp,gpt2-350m adds the 350M row), then the
# list above from its second call. $OUT brings back 8 files at most: tar the HOST_BASE files (10 with tests).
# Stop 58 got no device either (refused starts). Its changes on CUDA's path cut the step graph's kernels (ece8b69: a
# non-fused step unscales by the norms' 1/scale; 8b9ae21: hysteresis 1 in one op; 712f2c3: the decision vector's one
# stack; census 64 -> 56 for foreach fp16, 62 -> 57 fused), tested on the CPU only. The next session, first and short:
# FIRST=0 TESTS=1 HOST=0 EARLY=1 (tests/gpu whole, then benchmarks/results/cpu_stop58/early_event.py, ~20 s: can the
# step graph hand the host its skip flag before it ends?), then HOST_BASE=eb86e04 as above (c2a7768 and the
# kernel cuts together; host_time.py now prints the skip read's own time, "(pipeline._learn_skip)").
# Stop 59 built the early skip flag (AMPGUARD_EARLY_SKIP=1, off by default: c407387), and found that HOST_BASE timed the
# stages apart ("guard" alone is AMPGUARD_STEP_GRAPH=0 since f9ac1b6): it now passes --step-graph. The next call, first:
# FIRST=0 TESTS=1 HOST=0 EARLY=1 (tests/gpu whole, test_gpu_unfused_fast.py's early-flag capture test among them, then
# early_event.py), then FIRST=0 TESTS=0 HOST=0 HOST_BASE=eb86e04 HB_EARLY=1 HB_OPTIMS=foreach,fused HOST_S=120 (c2a7768
# and stop 58's cuts against eb86e04, and the early flag beside the default, two rounds), then the list above.
# Stop 59 got one H100 (benchmarks/results/gpu_stop59/, RESULTS.md "Stop 59"): tests/gpu 80 passed on 4206a01; the
# early flag cut the skip read ~115 -> ~40 us, the graph's landing (b057e19) took the reporter's copy away; bf12803 (the
# landing by memmove) is unrun. The next session, first: `AMPGUARD_EARLY_SKIP=1 python -m pytest -q tests/gpu` (~270 s:
# tests/gpu whole with the early flag on), then `python benchmarks/host_time.py --device cuda --models mlp --optims
# foreach --blocks 8 --steps 30 --step-graph --early-arm` twice (~25 s); if both hold, turn the switch on by default.
# Stop 60 (benchmarks/results/gpu_stop60/, RESULTS.md "Stop 60"): tests/gpu 80 passed with AMPGUARD_EARLY_SKIP=1; the
# early flag +144 / +155 us against the default's +133 / +152 (no net gain: the switch stays off); the landing's fill
# and the graph nodes split in place (cpu_stop60/land_split.py, host_time.py --nested); issue 26's compiled rows all
# met twice (table.py --groups compile,compile-foreach,compile-b16,compile-350m). The next session, first, short:
# `python -m pytest -q tests/gpu/test_gpu_unfused_fast.py` and `python benchmarks/results/cpu_stop60/land_split.py`
# (0a27064's one-call fill: Landing._land was 16-21 us), then the call 1 host-time command of gpu_stop60/README.md.
# Before those, first of all (~90 s): `python benchmarks/results/cpu_stop60/fw_graph_keys.py` (inside the frameworks
# the graphs replayed on 32-128 of 330 steps at stop 59, against all but the first in the hand loop: which gradients
# move, and in which of the allocator's pools).
# Stop 61 got no device (23 refused or failed starts, 1576 s). It changed what sentinel="top" sums (b7e63c3: the model's
# own output, the logits, read through the loss). The next session, first, one call (~300 s): table.py's sentinel group
# with this library and 1d6150e's in turn, twice, then fw_graph_keys.py:
#   rm -rf /tmp/base && mkdir -p /tmp/base && git archive 1d6150e ampguard benchmarks | tar -x -C /tmp/base
#   for r in 1 2; do for side in this base; do root=$PWD; [ $side = base ] && root=/tmp/base; (cd $root &&
#     PYTHONPATH=$root python benchmarks/table.py --device cuda --groups sentinel --blocks 30 --budget-s 62
#     --profile-steps 0 --no-memory --no-syncs --out $OUT/table_sentinel_$side$r.json); done; done
# then tests/gpu/test_gpu_diagnosis.py (the sentinel on CUDA), then stop 60's list above (fw_graph_keys.py first).
# Stop 62 (benchmarks/results/gpu_stop62/, RESULTS.md "Stop 62", one H100 lease) ran those: the sentinel 1.019 ->
# 1.009 (target 1.005); AMPGUARD_FUSED_RULE (the step graph's tail compiled: 48 -> 6 kernels, the MLP foreach row
# +164 -> +126 us) with 7 of 360 random decisions 1 ulp off (torch.reciprocal under inductor), fixed in 4f9b031 and not
# run since; the Trainer's small gradients cycle over 18 places (its graph never replays). The device tool returns at
# most 8 files a call: tar $OUT's files into one. The next session, first, one call (~250 s):
#   python benchmarks/results/cpu_stop62/fused_rule.py   (bits: 0 of 360 must differ with the options)
#   AMPGUARD_FUSED_RULE=1 python -m pytest -q tests/gpu   (the whole suite with the switch on)
#   python benchmarks/host_time.py --device cuda --models mlp,gpt2-350m --optims foreach,fused --blocks 6 --steps 30
#     --step-graph --fused-rule-arm   (twice; then, if the bits and the suite hold, the switch on by default)
# then the sentinel's profile (table.py --groups sentinel --profile-steps 5: where its ~0.23 ms goes).
# Stop 63 had no device (135 s of device time when it began). It let MeasureGraph keep 24 graphs and remember 96 keys
# (2d60f55), for the Trainer's cycle of 18 places. The next session adds to its first call (~20 s):
#   python -m pytest -q -s tests/gpu/test_gpu_measure_graph.py -k trainer   (the Trainer replays on half its steps)
#   python benchmarks/results/cpu_stop60/fw_graph_keys.py --frameworks transformers --steps 80   (replays from step ~40)
# and, after the steps above, the framework rows with their graphs' counts (FRAMEWORKS=1). The first call whole, in one
# script that tars its outputs: benchmarks/results/cpu_stop63/device_first_call.sh.
# Stop 64 ran that script (benchmarks/results/gpu_stop64/, RESULTS.md "Stop 64", three H100 calls, then no device):
# the fused rule's bits 0 of 360; the Trainer replays (49 of 64 steps); tests/gpu with the rule on failed 10 of 82
# (dynamo's recompile limit, counted per code object, hit by the ninth guard sharing _tail; fixed in d03432d on the
# CPU). The rule stays off by default until the next session's first call passes tests/gpu with it on:
#   OUT=$OUT bash benchmarks/results/cpu_stop64/device_first_call.sh   (~450 s; then the default turns on)
# then host_time.py's second run (--fused-rule-arm, as above) and the framework rows (FRAMEWORKS=1).
# Stop 65 ran both (benchmarks/results/gpu_stop65/, RESULTS.md "Stop 65", seven H100 calls): tests/gpu with the rule on
# 79 passed, 2 failed (both failing with it off too; fixed in 16fea5c), a process's first guard failing its compile
# (fixed in 41b5e5d); the sentinel's kernels named (15 float32 sums, 178 of 183 us); no host-time gain for the rule on
# that lease; the framework rows noise, each guarded arm capturing once a round. The next session's calls:
#   PART=1 OUT=$OUT bash benchmarks/results/cpu_stop65/device_next.sh   (~500 s: tests/gpu whole, move_diag.py)
#   PART=2 OUT=$OUT bash benchmarks/results/cpu_stop65/device_next.sh   (~260 s: host time, the rule's capture misses)
#   PART=3 (the sentinel batched, twice) and PART=4 (the framework rows with each arm in its own process, FW_ISOLATE=1,
#   and as before, in one call: frameworks_cost.py --isolate, stop 65)
# Stop 66 got no device (16 failed starts: benchmarks/results/cpu_stop66/README.md). The same parts, regrouped into
# three calls that shrink with the time left; the next session's order:
#   CALL=B OUT=$OUT bash benchmarks/results/cpu_stop66/device_calls.sh   (~575 s: the sentinel summed and batched, twice,
#   around the framework rows isolated), then CALL=C (~300 s: MLP host time, the rule's capture misses), then CALL=A
#   (~545 s: tests/gpu whole with the rule on, move_diag.py)
# Stop 67 ran B, C, tests/gpu as shipped (84 passed) and B's two halves again on one H100
# (benchmarks/results/gpu_stop67/). The fused rule gave no host time back: CALL=A is dropped. The next session, first
# (~60 s), the sentinel arms' peaks, the batch switch's last unmeasured condition (batched was the cheaper in both runs):
#   python benchmarks/table.py --device cuda --groups none --no-syncs --memory-variants plain_fused,guard_fused,\
#     guard_sentinel_fused,guard_sentinelbatch_fused,plain_fused#2 --out $OUT/sentinel_memory.json
# then tests/gpu with torchao's wheel carried (carry [".whl"]: .whl/torchao-0.18.0-*.whl, git-ignored, downloaded at stop 67; its
# fp8 module skipped at stop 67).
# Stop 68 got no device (none lent: benchmarks/results/cpu_stop68/). The list above stands, in that order; then, if time is
# left, the framework rows by the arm threads' CPU time beside the wall clock (whether the guarded arms' extra is host
# work on a host-bound lease): python benchmarks/frameworks_cost.py --device cuda --isolate --clock thread --blocks 30
#   --no-syncs --out $OUT/frameworks_thread.json (~250 s).
set -uo pipefail
TAG=${1:-now}
export PYTHONPATH=$PWD
if ls .whl/torchao-*.whl >/dev/null 2>&1; then  # carried (carry [".whl"]): nothing is pip-installable on the device
  pip install -q --no-index --no-deps --target /tmp/site .whl/torchao-*.whl >/dev/null 2>&1 && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu_$TAG.txt"
python -c "import torch; print(torch.__version__)" | tee -a "$OUT/gpu_$TAG.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/gpu_$TAG.txt"
if [ "${FIRST:-1}" = 1 ]; then  # first: stop 38's unexplained sync (its sites printed) and the step graph's tests
  timeout -k 5 "${FIRST_S:-150}" python -m pytest -q -p no:cacheprovider -rfE tests/gpu/test_gpu_detectors.py \
    tests/gpu/test_gpu_step_graph.py tests/gpu/test_gpu_measure_graph.py > "$OUT/first_$TAG.txt" 2>&1
  echo "first tests rc=$?"; tail -n 25 "$OUT/first_$TAG.txt"
fi
if [ "${TESTS:-1}" = 1 ]; then  # ~250 s on the H200 at stop 37 (a 200 s bound cut it short): its whole log kept
  timeout -k 5 "${TESTS_S:-330}" python -m pytest -q -p no:cacheprovider -rfE tests/gpu > "$OUT/tests_$TAG.txt" 2>&1
  echo "tests rc=$?"; tail -n 15 "$OUT/tests_$TAG.txt"
fi
if [ "${EARLY:-0}" = 1 ]; then  # stop 58's experiment: a flag handed to the host before its graph ends (~20 s)
  timeout -k 5 "${EARLY_S:-60}" python benchmarks/results/cpu_stop58/early_event.py > "$OUT/early_$TAG.txt" 2>&1
  echo "early rc=$?"; cat "$OUT/early_$TAG.txt"
fi
if [ -n "${HOST_BASE:-}" ]; then  # HOST_BASE=REV: that commit's host_time.py and library, then this tree's, in turn
  rm -rf /tmp/host_base && mkdir -p /tmp/host_base && git archive "$HOST_BASE" ampguard benchmarks | tar -x -C /tmp/host_base
  for round in ${HOST_ROUNDS:-1 2}; do
    for side in base this; do
      root=.; [ "$side" = base ] && root=/tmp/host_base
      # --step-graph: its arm is the default guard ("guard" alone is the stages apart, AMPGUARD_STEP_GRAPH=0, since
      # f9ac1b6); HB_EARLY=1 adds this tree's early-flag arm (--early-arm, stop 59; the base's script has none)
      early=; [ "$side" = this ] && [ "${HB_EARLY:-0}" = 1 ] && early=--early-arm
      timeout -k 5 "${HOST_S:-150}" python "$root/benchmarks/host_time.py" --device cuda --models ${HB_MODELS:-mlp} \
        --optims ${HB_OPTIMS:-foreach} --blocks ${HB_BLOCKS:-4} --steps 30 --profile 0 --ops 0 --step-graph $early \
        --json "$OUT/host_${TAG}_${side}$round.json" > "$OUT/host_${TAG}_${side}$round.txt" 2>&1
      echo "host $side$round rc=$?"; grep -E " on cuda|guard with the step graph|the early skip flag|_learn_skip" \
        "$OUT/host_${TAG}_${side}$round.txt"
    done
  done
fi
if [ "${HOST:-1}" = 1 ]; then
  timeout -k 5 "${HOST_S:-300}" python benchmarks/host_time.py --device cuda --models ${MODELS:-mlp,gpt2-350m} \
    --optims ${OPTIMS:-fused,foreach} --blocks ${BLOCKS:-10} --steps 30 --profile ${PROFILE:-0} --ops ${OPS:-30} \
    ${STEP_GRAPH:+--step-graph} ${BATCH:+--batch-arm} ${HOST_ARM:+--host-arm} --json "$OUT/host_time_$TAG.json" > "$OUT/host_time_$TAG.txt" 2>&1
  echo "host rc=$?"; grep -v Warning "$OUT/host_time_$TAG.txt" | grep -E "on cuda|graph:|breakdown|host decision|^    " | head -90
fi
# Stop 46 adds FRAMEWORKS=1 (the framework rows), COMPILE=1 (the compiled row) and FP8_EAGER=1 (issue 28's eager
# figures), none measured on a device since stop 37 (the fp8 ones never whole: its eager runs outlasted their bounds).
fw_run() {  # fw_run NAME [PYTHONPATH]: the framework rows, the library from PYTHONPATH (default: this tree)
  PYTHONPATH=${2:-$PYTHONPATH} timeout -k 5 "${FRAMEWORKS_S:-130}" python benchmarks/frameworks_cost.py --device cuda \
    --frameworks ${FW_LIST:-accelerate,transformers,lightning} --blocks ${FW_BLOCKS:-20} ${FW_BLOCK:+--block $FW_BLOCK} \
    ${FW_ISOLATE:+--isolate} \
    --budget-s $(( ${FRAMEWORKS_S:-130} - 20 )) \
    --out "$OUT/frameworks_$1.json" > "$OUT/frameworks_$1.txt" 2>&1
  echo "frameworks $1 rc=$?"; grep -A5 "^framework " "$OUT/frameworks_$1.txt"; grep -A4 "host syncs per step" "$OUT/frameworks_$1.txt"
}
if [ "${FRAMEWORKS:-0}" = 1 ]; then
  if [ -n "${FW_BASE:-}" ]; then  # FW_BASE=REV: that commit's ampguard and this tree's, in turn, twice (same harness)
    rm -rf /tmp/fw_base && mkdir -p /tmp/fw_base && git archive "$FW_BASE" ampguard | tar -x -C /tmp/fw_base
    for round in 1 2; do
      fw_run "${TAG}_base$round" "/tmp/fw_base:$PYTHONPATH"; fw_run "${TAG}_this$round"
    done
  else
    fw_run "$TAG"
  fi
fi
if [ -n "${TABLE_GROUPS:-}" ]; then  # table.py's CUDA groups by name (foreach, sentinel, b8, ...), side by side
  timeout -k 5 "${TABLE_S:-120}" python benchmarks/table.py --device cuda --groups "$TABLE_GROUPS" \
    --blocks ${TABLE_BLOCKS:-20} --budget-s $(( ${TABLE_S:-120} - 25 )) --profile-steps 0 --no-memory --no-syncs \
    --out "$OUT/table_$TAG.json" > "$OUT/table_$TAG.txt" 2>&1
  echo "table rc=$?"; grep -v Warning "$OUT/table_$TAG.txt" | grep -E "^\| |done|skipped" | head -30
fi
if [ "${COMPILE:-0}" = 1 ]; then
  timeout -k 5 "${COMPILE_S:-110}" python benchmarks/table.py --device cuda --groups compile --blocks 30 \
    --budget-s $(( ${COMPILE_S:-110} - 25 )) --profile-steps 0 --out "$OUT/table_compile_$TAG.json" \
    > "$OUT/table_compile_$TAG.txt" 2>&1
  echo "compile rc=$?"; grep -v Warning "$OUT/table_compile_$TAG.txt" | tail -n 20
fi
fp8_run() {  # fp8_run NAME ROOT BLOCKS: fp8_cost.py of the tree at ROOT (its ampguard: the script puts ROOT first)
  timeout -k 5 "${FP8_S:-200}" python "$2/benchmarks/fp8_cost.py" --device cuda --blocks "$3" --steps 10 \
    --batch 32 --variants ${FP8_VARIANTS:-plain,plain2,guard,guard+fp8,guard+fp8-nosample} \
    --profile-steps ${FP8_PROFILE:-10} --out "$OUT/fp8_eager_$1.json" > "$OUT/fp8_eager_$1.txt" 2>&1
  echo "fp8 eager $1 rc=$?"; grep -E "^(plain|guard|profile)" "$OUT/fp8_eager_$1.txt"
}
if [ "${FP8_EAGER:-0}" = 1 ]; then  # torchao carried: pip install --no-index --no-deps --target /tmp/site .whl/torchao-*.whl
  fp8_run "$TAG" . ${FP8_BLOCKS:-30}
  if [ -n "${FP8_BASE:-}" ]; then  # FP8_BASE=REV: that commit's library and fp8_cost.py after this tree's, same lease
    rm -rf /tmp/fp8_base && mkdir -p /tmp/fp8_base && git archive "$FP8_BASE" ampguard benchmarks/fp8_cost.py | tar -x -C /tmp/fp8_base
    FP8_PROFILE=0 fp8_run "${TAG}_base" /tmp/fp8_base ${FP8_BASE_BLOCKS:-12}
  fi
fi
