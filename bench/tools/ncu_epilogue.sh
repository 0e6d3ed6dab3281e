#!/usr/bin/env bash
# Where a gluon-hopper epilogue's time goes, by Nsight Compute (on the H200 machines: ncu reads the
# hardware counters there with --clock-control none). Profiles one launch of one epilogue_cost case
# per config (after 2 warm-up launches): warp stall reasons, issue and instruction statistics,
# and per-instruction stall sampling, each as a .ncu-rep and CSVs under $OUT; prints each stall
# reason's share and the SASS instructions with the most stall samples (bench/tools/ncu_summary.py).
#   bash bench/tools/ncu_epilogue.sh [CASE] [K] [CONFIG ...]
#   e.g. bash bench/tools/ncu_epilogue.sh swiglu_backward_zdz 64 "sub4 e2 b1" "sub4 loop" triton
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/coda-out}
mkdir -p "$OUT"
case_name=${1:-swiglu_backward_zdz}
k=${2:-64}
shift 2 2>/dev/null || shift $#
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=("sub4 e2 b1" "sub4 loop" "triton")
if [ -d .whl ]; then  # pydantic travels as wheels (docs/PERFORMANCE.md, "Running on the H200")
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:-}:$PWD/src:$PWD/bench CODA_AUTOTUNE=0
for cfg in "${configs[@]}"; do
  tag=$(echo "$case_name-k$k-$cfg" | tr ' ' '_')
  ncu --clock-control none --target-processes all -k regex:coda_ --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats \
      --section LaunchStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section SourceCounters \
      -o "$OUT/$tag" -f python3 bench/tools/epilogue_cost.py --launch "$case_name" --k "$k" --config "$cfg" \
      > "$OUT/$tag.log" 2>&1
  ncu --import "$OUT/$tag.ncu-rep" --csv --page details > "$OUT/$tag.csv" 2>>"$OUT/$tag.log"
  ncu --import "$OUT/$tag.ncu-rep" --csv --page raw > "$OUT/$tag.raw.csv" 2>>"$OUT/$tag.log"
  ncu --import "$OUT/$tag.ncu-rep" --csv --page source --print-source sass > "$OUT/$tag.sass.csv" 2>>"$OUT/$tag.log"
  echo "== $tag"; grep -iE "issued|executed ipc|duration" "$OUT/$tag.csv" | head -12
  python3 bench/tools/ncu_summary.py "$OUT/$tag.raw.csv" "$OUT/$tag.sass.csv"
done
