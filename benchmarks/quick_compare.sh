#!/bin/bash
# The side-by-side comparison behind docs/benchmarks.md (about 35 minutes on 2 cores): llama.cpp and jserve batch-1
# latency (also in turns, paired round by round: benchmarks/batch1_pair.py), llama-server and jserve serving 32
# concurrent streams in bfloat16 and float32, jserve and transformers offline throughput (uniform 128/128 and the
# ShareGPT-like mixed workload), TTFT with a cached 1,024-token prefix, and cold / cached warm-up. Needs
# benchmarks/build_bench_model.py, llama.cpp built and both GGUFs converted as benchmarks/README.md describes.
# Run it on a quiet machine; raw reports go to $OUT (default /tmp/jserve-bench).
#
#   bash benchmarks/quick_compare.sh [BASELINE_CHECKOUT]
#
# MIXED=0 leaves out the ShareGPT-like mixed workload (jserve in both dtypes and transformers' static batches: the
# longest part, 25 minutes and more on a slow machine).
#
# With BASELINE_CHECKOUT (another jserve checkout, e.g. `git worktree add /tmp/base <commit>`), its latency,
# serving and offline figures are measured in the same run, right after this checkout's.
set -u
cd "$(dirname "$0")/.."
HERE=$(pwd)
BASE=${1:-}
B=${LLAMA_CPP_BIN:-~/.cache/jserve/llama.cpp/build/bin}
M=~/.cache/jserve/bench-135m
N=${NUM_PROMPTS:-64}
MIXED_RUNS=${MIXED:-1}
OUT=${OUT:-/tmp/jserve-bench}
mkdir -p "$OUT"
trees=("$HERE")
[ -n "$BASE" ] && trees+=("$BASE")

echo "### machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2), $(nproc) cores, $(date -u +%FT%TZ)"
echo "### llama-bench (batch-1 prefill pp128, decode tg128)"
for d in bf16 f32; do LD_LIBRARY_PATH=$B $B/llama-bench -m ~/.cache/jserve/bench-135m-$d.gguf -p 128 -n 128 -t 2 -r 3 \
  2>&1 | grep -E "pp128|tg128"; done

for tree in "${trees[@]}"; do
  for dtype in bfloat16 float32; do
    echo "### jserve bench latency ($tree), $dtype"
    (cd "$tree" && python3 -m jserve bench latency --model $M --dtype $dtype --input-len 128 --output-len 128 \
      --num-iters 3 --num-iters-warmup 1 --max-model-len 512 --max-num-seqs 8 --max-num-batched-tokens 256 \
      2>&1 | grep -E "warm-up|Prefill|Decode|Roofline")
  done
done
# Where the memory bandwidth moves between minutes, only rounds taken in turns compare the two fairly.
for dtype in bfloat16 float32; do
  echo "### batch-1 decode, jserve and llama-bench in turns ($dtype, 6 rounds)"
  python3 benchmarks/batch1_pair.py --dtype $dtype --rounds 6 --llama-bin "$B" 2>&1 | grep -E "^round|median"
done

serve_bench() {  # URL NAME [extra bench flags]
  local url=$1 name=$2
  shift 2
  python3 -m jserve bench serve --base-url "$url" --model bench --tokenizer $M --ignore-eos --seed 0 "$@" \
    --result-json "$OUT/serve_$name.json" > "$OUT/serve_$name.txt" 2>&1
  echo "-- $name"
  grep -E "Successful|Failed|duration|Output token|Median TTFT|P99 TTFT|Median TPOT|Median ITL" "$OUT/serve_$name.txt"
}
# The KV cache holds as many tokens as llama-server's -c 12288 (384 a slot): its bytes per token, K and V of every
# layer, at the dtype's width (llama.cpp keeps f16 K/V, so its cache is the bf16 size at either dtype).
LLAMA_CTX=12288
kv_bytes() {  # DTYPE
  python3 -c "import sys; from pathlib import Path; sys.path.insert(0, '$HERE/benchmarks'); from run_all import kv_cache_bytes
print(kv_cache_bytes(Path('$M'), '$1', $LLAMA_CTX))"
}
jserve_server() {  # TREE DTYPE PORT NAME [extra server flags]; sets SERVER to its pid
  local tree=$1 dtype=$2 port=$3 name=$4
  shift 4
  (cd "$tree" && exec python3 -m jserve serve --model $M --dtype $dtype --port $port --served-model-name bench \
    --max-num-seqs 32 --max-num-batched-tokens 512 --kv-cache-memory-bytes "$(kv_bytes $dtype)" "$@" \
    > "$OUT/server_$name.log" 2>&1) &
  SERVER=$!
}
wait_healthy() { for _ in $(seq 1 150); do curl -sf "localhost:$1/health" > /dev/null && return; sleep 2; done; }
stop_server() { kill $SERVER; wait $SERVER 2> /dev/null; }  # waits out the drain: the next server takes the port
RANDOM_128=(--dataset random --random-input-len 128 --random-output-len 128 --num-prompts $N --max-concurrency 32)

for dtype in bfloat16 float32; do
  gguf=bf16
  [ $dtype = float32 ] && gguf=f32
  echo "### serving, $dtype, 128 in / 128 out, $N requests at 32 concurrent"
  for tree in "${trees[@]}"; do
    name=jserve-$dtype-$(basename "$tree")
    jserve_server "$tree" $dtype 8301 $name --max-model-len 512
    wait_healthy 8301
    serve_bench http://127.0.0.1:8301 $name "${RANDOM_128[@]}"
    stop_server
  done
  LD_LIBRARY_PATH=$B $B/llama-server -m ~/.cache/jserve/bench-135m-$gguf.gguf --port 8302 -np 32 -c $LLAMA_CTX -t 2 \
    > "$OUT/llama_server_$dtype.log" 2>&1 &
  SERVER=$!
  wait_healthy 8302
  serve_bench http://127.0.0.1:8302 llama-server-$dtype "${RANDOM_128[@]}"
  stop_server
done

offline() {  # TREE ARGS...: jserve bench throughput's summary line
  local tree=$1
  shift
  (cd "$tree" && python3 -m jserve bench throughput --model $M "$@" 2>&1 | grep "^Throughput")
}
echo "### offline throughput, $N requests of 128 in / 128 out"
for tree in "${trees[@]}"; do
  offline "$tree" --backend jserve --dtype bfloat16 --dataset random --random-input-len 128 --random-output-len 128 \
    --num-prompts $N --max-model-len 512 --max-num-seqs 32 --kv-cache-memory-bytes 268435456
done
for dtype in bfloat16 float32; do
  offline "$HERE" --backend hf --hf-dtype $dtype --hf-batch-size 32 --dataset random --random-input-len 128 \
    --random-output-len 128 --num-prompts $N | tee "$OUT/offline_hf_$dtype.txt"
done
# transformers' faster dtype here runs the mixed workload (its static batches take ~20 minutes; one dtype only)
tps() { grep -o "[0-9.]* output tokens/s" "$1" | cut -d' ' -f1; }
HF_DTYPE=$(awk -v b="$(tps "$OUT/offline_hf_bfloat16.txt")" -v f="$(tps "$OUT/offline_hf_float32.txt")" \
  'BEGIN { print (b > f) ? "bfloat16" : "float32" }')

MIXED=(--dataset mixed --num-prompts 256 --seed 0)
if [ "$MIXED_RUNS" != 0 ]; then
  echo "### offline throughput, ShareGPT-like mixed workload: 256 requests, prompts 16-1024, outputs 16-512"
  offline "$HERE" --backend jserve --dtype bfloat16 "${MIXED[@]}" --max-num-seqs 32 --kv-cache-memory-bytes 1073741824
  offline "$HERE" --backend jserve --dtype float32 "${MIXED[@]}" --max-num-seqs 32 --kv-cache-memory-bytes 1073741824
fi

echo "### TTFT with a shared 1,024-token prefix (16 requests one at a time), prefix cache on and off"
PREFIX=(--dataset prefix-repetition --prefix-repetition-prefix-len 1024 --prefix-repetition-suffix-len 16
  --prefix-repetition-num-prefixes 1 --prefix-repetition-output-len 16 --num-prompts 16 --max-concurrency 1)
for flag in --enable-prefix-caching --no-enable-prefix-caching; do
  jserve_server "$HERE" bfloat16 8303 prefix$flag --max-model-len 2048 $flag
  wait_healthy 8303
  serve_bench http://127.0.0.1:8303 prefix$flag "${PREFIX[@]}"
  stop_server
done

echo "### warm-up, bf16, max_model_len 512, max_num_batched_tokens 512: cold, then with the compile cache"
CACHE=$(mktemp -d)
for _ in cold cached; do
  python3 -m jserve bench latency --model $M --dtype bfloat16 --input-len 16 --output-len 4 --num-iters 1 \
    --num-iters-warmup 0 --max-model-len 512 --max-num-seqs 32 --max-num-batched-tokens 512 \
    --compilation-cache-dir "$CACHE" 2>&1 | grep "warm-up"
done
rm -rf "$CACHE"

if [ "$MIXED_RUNS" != 0 ]; then
  echo "### offline throughput, mixed workload, transformers in $HF_DTYPE (its faster dtype), static batches of 32"
  offline "$HERE" --backend hf --hf-dtype $HF_DTYPE --hf-batch-size 32 "${MIXED[@]}"
fi
