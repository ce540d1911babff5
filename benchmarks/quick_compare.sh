#!/bin/bash
# The reduced side-by-side comparison behind docs/benchmarks.md (about 15 minutes on 2 cores): llama.cpp and jserve
# batch-1 latency, llama-server and jserve serving 32 concurrent streams, jserve and transformers offline throughput,
# and cold / cached warm-up. Needs benchmarks/build_bench_model.py, llama.cpp built and both GGUFs converted as
# benchmarks/README.md describes. Run it on a quiet machine; raw serving reports go to $OUT (default /tmp/jserve-bench).
set -u
cd "$(dirname "$0")/.."
B=${LLAMA_CPP_BIN:-~/.cache/jserve/llama.cpp/build/bin}
M=~/.cache/jserve/bench-135m
N=${NUM_PROMPTS:-64}
OUT=${OUT:-/tmp/jserve-bench}
mkdir -p "$OUT"

echo "### llama-bench (batch-1 prefill pp128, decode tg128)"
for d in bf16 f32; do LD_LIBRARY_PATH=$B $B/llama-bench -m ~/.cache/jserve/bench-135m-$d.gguf -p 128 -n 128 -t 2 -r 3 \
  2>&1 | grep -E "pp128|tg128"; done

for run in "cpu bfloat16" "cpu float32" "reference bfloat16"; do
  set -- $run
  echo "### jserve bench latency, attention backend $1, $2"
  python3 -m jserve bench latency --model $M --dtype $2 --input-len 128 --output-len 128 --num-iters 3 \
    --num-iters-warmup 1 --max-model-len 512 --max-num-seqs 8 --max-num-batched-tokens 256 --attention-backend $1 \
    2>&1 | grep -E "warm-up|Prefill|Decode|Roofline"
done

serve_bench() {  # URL NAME
  python3 -m jserve bench serve --base-url "$1" --model bench --tokenizer $M --dataset random --random-input-len 128 \
    --random-output-len 128 --num-prompts $N --max-concurrency 32 --ignore-eos --seed 0 \
    --result-json "$OUT/serve_$2.json" > "$OUT/serve_$2.txt" 2>&1
  echo "-- $2"
  grep -E "Successful|Failed|duration|Output token|Median TTFT|P99 TTFT|Median TPOT|Median ITL" "$OUT/serve_$2.txt"
}
echo "### serving, bf16, 128 in / 128 out, $N requests at 32 concurrent"
python3 -m jserve serve --model $M --dtype bfloat16 --port 8301 --served-model-name bench --max-model-len 512 \
  --max-num-seqs 32 --max-num-batched-tokens 512 --kv-cache-memory-bytes 268435456 > "$OUT/jserve_server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 150); do curl -sf localhost:8301/health > /dev/null && break; sleep 2; done
serve_bench http://127.0.0.1:8301 jserve
kill $SERVER; wait $SERVER 2> /dev/null
LD_LIBRARY_PATH=$B $B/llama-server -m ~/.cache/jserve/bench-135m-bf16.gguf --port 8302 -np 32 -c 12288 -t 2 \
  > "$OUT/llama_server.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 60); do curl -sf localhost:8302/health > /dev/null && break; sleep 1; done
serve_bench http://127.0.0.1:8302 llama-server
kill $SERVER; wait $SERVER 2> /dev/null

echo "### offline throughput, bf16, $N requests of 128 in / 128 out"
python3 -m jserve bench throughput --backend jserve --model $M --dtype bfloat16 --dataset random \
  --random-input-len 128 --random-output-len 128 --num-prompts $N --max-model-len 512 --max-num-seqs 32 \
  --kv-cache-memory-bytes 268435456 2>&1 | grep "^Throughput"
python3 -m jserve bench throughput --backend hf --hf-dtype bfloat16 --hf-batch-size 32 --model $M --dataset random \
  --random-input-len 128 --random-output-len 128 --num-prompts $N 2>&1 | grep "^Throughput"

echo "### warm-up, bf16, max_model_len 512, max_num_batched_tokens 512: cold, then with the compile cache"
CACHE=$(mktemp -d)
for _ in cold cached; do
  python3 -m jserve bench latency --model $M --dtype bfloat16 --input-len 16 --output-len 4 --num-iters 1 \
    --num-iters-warmup 0 --max-model-len 512 --max-num-seqs 32 --max-num-batched-tokens 512 \
    --compilation-cache-dir "$CACHE" 2>&1 | grep "warm-up"
done
rm -rf "$CACHE"
