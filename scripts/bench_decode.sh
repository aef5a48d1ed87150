#!/usr/bin/env bash
# Time per output token with and without our connector, measured by vLLM's own client (`vllm bench serve`,
# prefix-repetition workload: 40 prompts of 256 shared + 256 own tokens, 128 output tokens each, 4 at a time),
# on the tiny demo model with vLLM's prefix cache off. vLLM's CPU worker binds one core without a KV connector and
# every core with one, so both servers here bind the same core (VLLM_CPU_OMP_THREADS_BIND, default 0). The two
# configurations alternate, ROUNDS times (default 3); one summary line per run, then the JSON files in OUT. vLLM's
# KV cache is sized explicitly (VLLM_CPU_KVCACHE_SPACE, default 4 GiB) in both: left to itself on CPU it takes
# about 90 % of the memory, and LMCache's CPU tier beside it then has the worker killed for memory.
#   bash scripts/bench_decode.sh [OUT]            (a few minutes per run on a 2-core machine: each server compiles)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$here/.bench-decode}
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-8123}
BIND=${VLLM_CPU_OMP_THREADS_BIND:-0}
KV_GIB=${VLLM_CPU_KVCACHE_SPACE:-4}
VENV=${VENV:-$here/.venv}
mkdir -p "$OUT"
MODEL=$("$VENV/bin/python" -c "from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
print(ensure_model(TINY_MODEL))" 2>/dev/null | tail -1)
printf 'chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 2.0\n' > "$OUT/lmcache.yaml"
OURS='{"kv_connector":"LMCachePlatformsConnector","kv_role":"kv_both"}'

run() {  # label, then the server's extra arguments
  local label=$1 pid
  shift
  PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false VLLM_CPU_OMP_THREADS_BIND=$BIND VLLM_CPU_KVCACHE_SPACE=$KV_GIB LMCACHE_CONFIG_FILE="$OUT/lmcache.yaml" \
    setsid "$VENV/bin/vllm" serve "$MODEL" --port "$PORT" --no-enable-prefix-caching --max-model-len 1024 --seed 0 \
    --dtype bfloat16 --disable-uvicorn-access-log "$@" > "$OUT/$label.server.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
  "$VENV/bin/vllm" bench serve --backend vllm --model "$MODEL" --port "$PORT" --dataset-name prefix_repetition \
    --num-prompts 40 --max-concurrency 4 --seed 0 --ignore-eos --save-result --result-dir "$OUT" \
    --result-filename "$label.json" > "$OUT/$label.bench.log" 2>&1
  kill -INT -- "-$pid"
  wait "$pid" || true
  echo "$label: $(grep -E "Mean TPOT|Median TPOT|Mean TTFT|Output token throughput" "$OUT/$label.bench.log" |
    tr -s ' ' | paste -sd' ')"
}

for round in $(seq 1 "$ROUNDS"); do
  run "without-$round"
  run "with-$round" --kv-transfer-config "$OURS"
done
