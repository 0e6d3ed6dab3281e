#!/usr/bin/env bash
# One device call's worth of H200 work, everything under $OUT; steps run in the order given.
# The user-facing steps (docs/PERFORMANCE.md shows what epilogues, ops, block and train last measured, and its file):
#   tests         the GPU tier of the test suite (default configs; tests pick larger shapes on a GPU; 8 xdist
#                 workers, since compiling kernels on the host's CPUs is most of its time), ~4 min; TESTS_ARGS
#                 picks test files
#   tests_triton  the same with CODA_BACKEND=triton: `tests` runs gluon-hopper wherever it can, so this is
#                 where the Triton backend meets the whole suite on the GPU, ~3 min (TESTS_ARGS too)
#   epilogues     each fused GEMM against its bare GEMM and the peers (bench/gemm_epilogues.py), ~4 min
#   ops           the ops and the block, forward and forward+backward, against the peers (bench/ops_block.py),
#                 ~1.5 min (last timed tuned, from a seeded tuning cache)
#   block         the block's GEMMs on both backends, the block against its speed of light and the peers,
#                 untuned, each width in a fresh process (bench/block_kernels.py), 5-7 min
#   first_call    seconds to the first training step from an empty cache and from a warm one, and each
#                 kernel's first compile (bench/first_call.py; FIRST_CALL_ARGS, e.g. "--cases llama_1b")
#   tune          `coda tune` ahead of time (TUNE_ARGS, e.g. "--hf-config SmolLM3Config --set num_hidden_layers=4
#                 --batch 2 --seq 4096"): its per-key lines in tune.log, the cache back as tuning.tgz; the train
#                 step's coda_tuned variant then reads it
#   train         end-to-end training steps per family and variant, each in its own process (bench/train.py;
#                 TRAIN_ARGS picks models, shapes and variants, e.g. "--models llama3.2-1b --variants coda,hf_eager")
# Investigation tools (bench/tools/):
#   profile       where the ops' time goes, kernel by kernel (profile_ops.py), 0.5 min
#   attention     attention over packed documents and sliding windows: SDPA with a mask, flash attention over
#                 each document, FlexAttention, against SDPA's causal kernel (attention.py), ~3 min
#   attention_in_step  cuDNN's attention backward inside coda's training step: q/k/v as coda hands them over
#                 against contiguous copies, SDPA's flash kernel and flash's variable-length one (attention_in_step.py;
#                 ATTENTION_IN_STEP_ARGS, e.g. "--model qwen3-1.7b"), ~3 min
#   rowwise       the row-pass kernels against torch.add's bandwidth (rowwise_bandwidth.py), ~1 min
#   step_gaps     a training step's time against its kernels' and the host's, the syncs, a host profile
#                 (step_gaps.py; STEP_GAPS_ARGS, e.g. "--models gemma3-1b,llama3.2-1b --packed no"), ~1 min a row
#   compile_times the property tests' random programs' first calls on both backends, compile time and result
#                 (compile_times.py; COMPILE_TIMES_ARGS, e.g. "--per-shape 24"), ~2 min at 8 a shape
#   bf16_seeds    coda's bf16 error over HF's own per family and weight seed, with coda's attention kernel and
#                 with transformers' (bench/tools/bf16_seeds.py; BF16_SEEDS_ARGS, e.g. "--families exaone4")
#   timeline      per-tile timelines of the block's fused GEMMs, as generated and with template v4's changes
#                 undone (timeline.py variants), ~4 min
# Usage on the device (pydantic travels as wheels in .whl): CODA_COMMIT=<commit sent> bash bench/gpu_session.sh STEP...; with no argument
# tests, epilogues and ops run. coda runs untuned (CODA_AUTOTUNE defaults to 0); export CODA_AUTOTUNE=1 for tuned
# figures (a carried .tuning.tgz is read only then). Each step stops after STEP_TIMEOUT (540) seconds, a device call's limit being 600.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/coda-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
export PYTHONUNBUFFERED=1 CODA_CACHE_DIR=${CODA_CACHE_DIR:-/tmp/coda-cache}
# Tuned configs travel between device calls (each machine starts bare): a carried .tuning.tgz
# seeds the tuning cache, and the cache goes back as $OUT/tuning.tgz.
mkdir -p "$CODA_CACHE_DIR"
[ -f .tuning.tgz ] && tar -C "$CODA_CACHE_DIR" -xzf .tuning.tgz
steps=${*:-tests epilogues ops}
# Results record the commit measured, and the device copy's .git may be stale (its HEAD an older
# commit): a measuring step needs CODA_COMMIT, the commit of the tree sent (git rev-parse --short HEAD here).
for step in $steps; do
  case $step in
    tests|tests_triton) ;;
    *) if [ -z "${CODA_COMMIT:-}" ]; then
         echo "gpu_session: $step needs CODA_COMMIT, the commit of this tree (results record it; the device copy's .git may be stale)" >&2
         exit 2
       fi ;;
  esac
done
STEP_TIMEOUT=${STEP_TIMEOUT:-540}
# the tuner's per-candidate lines, left out of the logs' tails
untuned_lines() { grep -v '^\[coda tune\]   \['; }
# bench/tools/timeline.py's rows without warnings and without the long config text (its label stays)
timeline_rows() { grep -v Warn | sed -e 's/config=.*cooperative=[A-Za-z]*//'; }
for step in $steps; do
  case $step in
    tests) CODA_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -n 8 ${TESTS_ARGS:-tests} 2>&1 \
             | tee "$OUT/gpu_tier.log" | tail -15 ;;
    tests_triton) CODA_BACKEND=triton CODA_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider \
                    -n 8 ${TESTS_ARGS:-tests} 2>&1 | tee "$OUT/gpu_tier_triton.log" | tail -15 ;;
    epilogues) timeout $STEP_TIMEOUT python3 bench/gemm_epilogues.py --part epilogues --out "$OUT" 2>&1 | untuned_lines \
                 | tee "$OUT/epilogues.log" | tail -30 ;;
    ops) timeout $STEP_TIMEOUT python3 bench/ops_block.py --out "$OUT" 2>&1 | untuned_lines | tee "$OUT/ops.log" | tail -30 ;;
    block) CODA_AUTOTUNE=0 timeout $STEP_TIMEOUT python3 bench/block_kernels.py --out "$OUT" 2>&1 \
             | grep -v Warn | tee "$OUT/block_kernels.log" | grep "block D=\|x[0-9]" | tail -60 ;;
    first_call) timeout $STEP_TIMEOUT python3 bench/first_call.py --out "$OUT" ${FIRST_CALL_ARGS:-} 2>&1 \
                  | tee "$OUT/first_call.log" | tail -30 ;;
    attention) timeout $STEP_TIMEOUT python3 bench/tools/attention.py --out "$OUT" 2>&1 | tee "$OUT/attention.log" | tail -30 ;;
    tune) timeout $STEP_TIMEOUT python3 -m coda tune ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log" | untuned_lines | tail -40 ;;
    train) timeout $STEP_TIMEOUT python3 bench/train.py --out "$OUT" ${TRAIN_ARGS:-} 2>&1 | untuned_lines \
             | tee "$OUT/train.log" | grep '^\[train\]' | tail -40 ;;
    profile) timeout $STEP_TIMEOUT python3 bench/tools/profile_ops.py --out "$OUT" 2>&1 | untuned_lines \
               | tee "$OUT/profile.log" | grep -v Warning | tail -80 ;;
    attention_in_step) timeout $STEP_TIMEOUT python3 bench/tools/attention_in_step.py --out "$OUT" ${ATTENTION_IN_STEP_ARGS:-} \
      2>&1 | grep -v Warn | tee "$OUT/attention_in_step.log" | tail -8 ;;
    rowwise) timeout $STEP_TIMEOUT python3 bench/tools/rowwise_bandwidth.py --out "$OUT" 2>&1 | tee "$OUT/rowwise.log" | tail -12 ;;
    step_gaps) timeout $STEP_TIMEOUT python3 bench/tools/step_gaps.py --out "$OUT" ${STEP_GAPS_ARGS:-} 2>&1 \
      | tee "$OUT/step_gaps.log" | tail -20 ;;
    compile_times) timeout $STEP_TIMEOUT python3 bench/tools/compile_times.py --out "$OUT" ${COMPILE_TIMES_ARGS:-} 2>&1 \
      | grep -v Warn | tee "$OUT/compile_times.log" | tail -8 ;;
    bf16_seeds) timeout $STEP_TIMEOUT python3 bench/tools/bf16_seeds.py --out "$OUT" ${BF16_SEEDS_ARGS:-} 2>&1 \
      | grep -v Warn | tee "$OUT/bf16_seeds.log" | tail -50 ;;
    timeline)
      fused=residual_norm_stats,rmsnorm_backward_residual,rms_rope,rms_swiglu,swiglu_backward_zdz
      { timeout 170 python3 bench/tools/timeline.py --out "$OUT/timeline_v4" --cases $fused
        timeout 170 python3 bench/tools/timeline.py --out "$OUT/timeline_late" --variant late_eturn --cases $fused
        timeout 100 python3 bench/tools/timeline.py --out "$OUT/timeline_exact" --variant exact_sigmoid \
          --cases rms_swiglu,swiglu_backward_zdz
      } 2>&1 | timeline_rows | tee "$OUT/timeline.log" ;;
    *) echo "unknown step $step (tests, tests_triton, epilogues, ops, block, first_call, attention, attention_in_step, tune, train, profile, rowwise, step_gaps, compile_times, bf16_seeds, timeline)"; exit 2 ;;
  esac
done
# (an if, not `&&`: with no tuning cache the call still exits 0)
if [ -d "$CODA_CACHE_DIR/tuning" ]; then tar -C "$CODA_CACHE_DIR" -czf "$OUT/tuning.tgz" tuning; fi
