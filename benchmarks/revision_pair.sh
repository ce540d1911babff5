#!/bin/bash
# Batch-1 decode of this checkout against another (a baseline revision), paired round by round: each round runs
# `jserve bench latency` once in each checkout, in turns (the order alternating), so both share each moment of a
# machine whose memory bandwidth moves. Prints each round's decode tok/s and the median ratio this / baseline.
#
#   git worktree add /tmp/base <commit>
#   bash benchmarks/revision_pair.sh /tmp/base [ROUNDS] [DTYPE]
#
# The CPU kernels build per checkout (cached by source hash), so the two run their own kernels.cc.
set -eu
cd "$(dirname "$0")/.."
HERE=$(pwd)
BASE=$1
ROUNDS=${2:-10}
DTYPE=${3:-bfloat16}
MODEL=${MODEL:-~/.cache/jserve/bench-135m}
decode() {
  (cd "$1" && PYTHONPATH="$1" python3 -m jserve bench latency --model "$MODEL" --dtype "$DTYPE" --input-len 32 \
    --output-len 128 --num-iters 3 2>&1 | grep -oP "^Decode: +\K[0-9.]+")
}
ratios=()
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) -eq 1 ]; then new=$(decode "$HERE"); old=$(decode "$BASE"); else old=$(decode "$BASE"); new=$(decode "$HERE"); fi
  ratio=$(python3 -c "print(f'{$new / $old:.3f}')")
  ratios+=("$ratio")
  echo "round $r: this $new tok/s, baseline $old tok/s, ratio $ratio"
done
python3 -c "import statistics, sys; r = [float(x) for x in sys.argv[1:]]; print(f'median ratio {statistics.median(r):.3f}, this faster in {sum(x > 1 for x in r)} of {len(r)} rounds')" "${ratios[@]}"
