#!/usr/bin/env bash
# One device call's worth of H200 work, in priority order, everything under $OUT:
#   1. the GPU tier of the test suite (default configs; tests pick larger shapes on a GPU; 8 xdist
#      workers, since compiling kernels on the host's CPUs is most of its time)
#   2. the GEMM + forward-epilogue suite (bench/gemm_epilogues.py)
#   3. the ops + block suite (bench/ops_block.py)
#   4. (profile) where the ops' time goes, kernel by kernel (bench/profile_ops.py)
#   5. (train) end-to-end training steps per variant, each in its own process (bench/train_llama.py;
#      TRAIN_ARGS picks models, shapes and variants, e.g. "--models 1b --shapes 2x4096 --variants coda,hf_eager")
#   6. (timeline) per-tile timelines of the block's fused GEMMs, as generated and with each of
#      template v4's changes undone (bench/timeline.py variants, ~4 min)
#   7. (stores) ncu counters of the SwiGLU backward's parts: shared-memory store wavefronts and
#      bank conflicts, L2 bytes, tensor-pipe activity; then their timelines with the stores
#      through TMA and through pointers (why its stores slow the other K loop)
#   8. (l2) ncu L2 throughput and bytes of the SwiGLU backward's GEMM, its parts and cuBLAS's GEMM
#   9. (xbar) ncu of each SM's side of the L2 link for the same kernels (bytes in and out, share of peak)
#  10. (block) bench/block_kernels.py untuned: every GEMM of the block on both backends, the block
#      rows (each width in a fresh process) against SoL and peers (5-7 min; --merge it into bench/results)
#  11. (tests_triton) the GPU tier again with CODA_BACKEND=triton: `tests` runs gluon-hopper wherever
#      it can, so this is where the Triton backend meets the whole suite on the GPU (tests that need
#      a particular backend still set it themselves; ~3 min)
#  12. (rowwise) bench/rowwise_bandwidth.py: the row-pass kernels (RoPE backward, RMSNorm prep, input gradient and
#      backward, the cross-entropy pass) against torch.add's bandwidth (~1 min)
#  12b. (rowwise_sweep) the same, and rms_backward under each tiling of its TILINGS (~2 min)
#  13. (keep_h) bench/epilogue_cost.py: the SwiGLU backward with and without its y stores (what keeping
#      the forward's h would save) beside its plain GEMM, D=2048 then 4096, untuned (~2 min)
# Usage on the device (pydantic travels as wheels in .whl, see README "Running on the H200"):
#   bash bench/gpu_session.sh tests | epilogues | ops | profile | train | timeline   (several steps may share one device call:
#   measured on the H200 with a seeded tuning cache, tests 1.5 min, epilogues 4, ops 1.5, profile 0.5; a cold
#   cache adds the tuning, about 4 min for ops. Each step stops after STEP_TIMEOUT (540) seconds, a device
#   call's limit being 600; with no argument tests, epilogues and ops run)
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
# bench/timeline.py's rows without warnings and without the long config text (its label stays)
timeline_rows() { grep -v Warn | sed -e 's/config=.*cooperative=[A-Za-z]*//'; }
# ncu of one bench/epilogue_cost.py case at K=2048, its third launch: "metric value" lines, and ncu's errors
ncu_case() {  # seconds metrics case config
  CODA_AUTOTUNE=0 timeout "$1" ncu --clock-control none -k regex:coda_ --launch-skip 2 --launch-count 1 \
    --metrics "$2" --csv python3 bench/epilogue_cost.py --launch "$3" --k 2048 --config "$4" 2>&1 \
    | grep '"coda_\|==ERROR' | awk -F'","' '{ if (NF > 2) print $(NF-2), $NF; else print }'
}
# the same for cuBLAS's GEMM of the SwiGLU backward's shape, [8192, 8192, 2048]: "kernel | metric value" lines
ncu_cublas() {  # metrics
  timeout 60 ncu --clock-control none -k regex:'gemm|nvjet|xmma' --launch-skip 2 --launch-count 1 --metrics "$1" \
    --csv python3 -c "import torch
a = torch.randn(8192, 2048, device='cuda', dtype=torch.bfloat16)
w = torch.randn(8192, 2048, device='cuda', dtype=torch.bfloat16)
for _ in range(3): a @ w.T
torch.cuda.synchronize()" 2>&1 | grep '^"[0-9]\|==ERROR' | awk -F'","' '{ if (NF > 2) print $5, "|", $(NF-2), $NF; else print }'
}
for step in $steps; do
  case $step in
    tests) CODA_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -n 8 tests 2>&1 | tee "$OUT/gpu_tier.log" | tail -15 ;;
    tests_triton) CODA_BACKEND=triton CODA_AUTOTUNE=0 timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -q -p no:cacheprovider -n 8 tests 2>&1 \
                    | tee "$OUT/gpu_tier_triton.log" | tail -15 ;;
    keep_h) for d_f in "2048 8192" "4096 14336"; do
              set -- $d_f
              CODA_AUTOTUNE=0 timeout 250 python3 bench/epilogue_cost.py --out "$OUT/keep_h_d$1" --d "$1" --f "$2" --alone no \
                --cases swiglu_backward_zdz,swiglu_backward_keep_h,plain_swiglu_shape --configs "sub4 loop" 2>&1 | tail -8
            done | tee "$OUT/keep_h.log" ;;
    rowwise) timeout ${STEP_TIMEOUT:-540} python3 bench/rowwise_bandwidth.py --out "$OUT" 2>&1 | tee "$OUT/rowwise.log" | tail -12 ;;
    rowwise_sweep) timeout ${STEP_TIMEOUT:-540} python3 bench/rowwise_bandwidth.py --sweep --out "$OUT" 2>&1 \
                     | tee "$OUT/rowwise.log" | grep -A12 "fastest first" ;;
    epilogues) timeout ${STEP_TIMEOUT:-540} python3 bench/gemm_epilogues.py --part epilogues --out "$OUT" 2>&1 \
                 | grep -v '^\[coda tune\]   \[' | tee "$OUT/epilogues.log" | tail -30 ;;
    ops) timeout ${STEP_TIMEOUT:-540} python3 bench/ops_block.py --out "$OUT" 2>&1 | grep -v '^\[coda tune\]   \[' \
           | tee "$OUT/ops.log" | tail -30 ;;
    profile) timeout ${STEP_TIMEOUT:-540} python3 bench/profile_ops.py --out "$OUT" 2>&1 | grep -v '^\[coda tune\]   \[' \
               | tee "$OUT/profile.log" | grep -v Warning | tail -80 ;;
    train) timeout ${STEP_TIMEOUT:-570} python3 bench/train_llama.py --out "$OUT" ${TRAIN_ARGS:-} 2>&1 \
             | grep -v '^\[coda tune\]   \[' | tee "$OUT/train.log" | grep '^\[train_llama\]' | tail -40 ;;
    timeline)
      fused=residual_norm_stats,rmsnorm_backward_residual,rms_rope,rms_swiglu,swiglu_backward_zdz
      { timeout 170 python3 bench/timeline.py --out "$OUT/timeline_v4" --cases $fused
        timeout 170 python3 bench/timeline.py --out "$OUT/timeline_late" --variant late_eturn --cases $fused
        timeout 100 python3 bench/timeline.py --out "$OUT/timeline_exact" --variant exact_sigmoid \
          --cases rms_swiglu,swiglu_backward_zdz
      } 2>&1 | timeline_rows | tee "$OUT/timeline.log" ;;
    stores)  # ncu: shared-memory store wavefronts and bank conflicts, the SwiGLU backward's stores alone
      M=gpu__time_duration.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,\
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,smsp__inst_executed_op_shared_st.sum,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,\
l1tex__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
      for c in plain_swiglu_shape swiglu_stores_only swiglu_loads_only swiglu_backward_zdz; do
        echo "== $c"
        ncu_case 90 $M $c "sub4 loop"
      done 2>&1 | tee "$OUT/stores_ncu.log"
      # the same stores through pointers (STG, no TMA unit): does the other K loop still slow down?
      CODA_AUTOTUNE=0 timeout 150 python3 bench/timeline.py --out "$OUT/stores_timeline" \
        --cases plain_swiglu_shape,swiglu_stores_only --configs "sub4 loop,sub4 loop ptr-stores" 2>&1 \
        | timeline_rows | tee -a "$OUT/stores_ncu.log" ;;
    l2)  # ncu: L2 throughput and bytes of the SwiGLU backward's K=2048 GEMM and its parts, ping-pong and
         # cooperative, and of cuBLAS's GEMM of the same shape (is the fused GEMM bound by L2 bandwidth?)
      M=gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_read.sum,\
lts__t_sectors_op_write.sum,dram__bytes.sum,launch__grid_size,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
      for cc in "plain_swiglu_shape:sub4 loop" "swiglu_stores_only:sub4 loop" "swiglu_loads_only:sub4 loop" \
                "swiglu_backward_zdz:sub4 loop" "plain_swiglu_shape:coop sub8" "swiglu_backward_zdz:coop sub8"; do
        echo "== ${cc%%:*} (${cc#*:})"
        ncu_case 60 $M "${cc%%:*}" "${cc#*:}"
      done 2>&1 | tee "$OUT/l2_ncu.log"
      { echo "== cuBLAS [8192, 8192, 2048]"; ncu_cublas $M; } 2>&1 | tee -a "$OUT/l2_ncu.log" ;;
    block) CODA_AUTOTUNE=0 timeout ${STEP_TIMEOUT:-540} python3 bench/block_kernels.py --out "$OUT" 2>&1 \
             | grep -v Warn | tee "$OUT/block_kernels.log" | grep "block D=\|x[0-9]" | tail -60 ;;
    xbar)  # ncu: each SM's side of the L2 link (bytes in and out, and their share of its peak) for the
           # same kernels as l2: is ping-pong's 128x128 K loop near the SM's L2 read bandwidth, and what
           # do the epilogue's writes take from it? Then L2 requests against sectors (the outputs' 64- and
           # 128-byte TMA rows against the operands' 128). One metric group per ncu run, so that a name
           # this ncu lacks costs only its own group (~7 min in all).
      for group in l1tex__m_xbar2l1tex_read_bytes.sum,l1tex__m_xbar2l1tex_read_bytes.sum.pct_of_peak_sustained_elapsed \
                   l1tex__m_l1tex2xbar_write_bytes.sum,l1tex__m_l1tex2xbar_write_bytes.sum.pct_of_peak_sustained_elapsed \
                   l1tex__m_xbar2l1tex_read_bytes_mem_global_op_tma_ld.sum,l1tex__m_l1tex2xbar_req_cycles_active_op_tma.sum \
                   lts__t_requests_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_write.sum,\
lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_write.sum; do
        for cc in "plain_swiglu_shape:sub4 loop" "swiglu_stores_only:sub4 loop" "swiglu_stores_only:sub4 loop ptr-stores" \
                  "swiglu_loads_only:sub4 loop" "swiglu_backward_zdz:sub4 loop" "plain_swiglu_shape:coop sub8"; do
          echo "== ${cc%%:*} (${cc#*:})"
          ncu_case 60 gpu__time_duration.sum,$group "${cc%%:*}" "${cc#*:}"
        done
        echo "== cuBLAS [8192, 8192, 2048]"
        ncu_cublas gpu__time_duration.sum,$group
      done 2>&1 | tee "$OUT/xbar_ncu.log" ;;
    *) echo "unknown step $step (tests, tests_triton, rowwise, rowwise_sweep, keep_h, epilogues, ops, profile, train, timeline, stores, l2, xbar, block)"; exit 2 ;;
  esac
done
[ -d "$CODA_CACHE_DIR/tuning" ] && tar -C "$CODA_CACHE_DIR" -czf "$OUT/tuning.tgz" tuning
