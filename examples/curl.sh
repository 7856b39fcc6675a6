#!/usr/bin/env bash
# The meshd OpenAI-compatible API with curl. Start a daemon first (`meshd serve`), then:
#   examples/curl.sh                 # API on 127.0.0.1:7392
#   MESHD_API_PORT=8000 examples/curl.sh
#   MESHD_API_KEY=... examples/curl.sh   # when the API requires a key (bound beyond loopback)
set -euo pipefail

BASE="http://${MESHD_API_HOST:-127.0.0.1}:${MESHD_API_PORT:-7392}"
AUTH=()
if [[ -n "${MESHD_API_KEY:-}" ]]; then
  AUTH=(-H "Authorization: Bearer ${MESHD_API_KEY}")
fi
call() { curl -sS --fail-with-body "${AUTH[@]}" "$@"; echo; }

echo "== the model the mesh serves"
call "$BASE/v1/models"
MODEL=$(curl -sS "${AUTH[@]}" "$BASE/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

echo "== a chat completion (usage and meshd's speculative telemetry come with it)"
call "$BASE/v1/chat/completions" -H "Content-Type: application/json" -d '{
  "model": "'"$MODEL"'",
  "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}],
  "max_tokens": 32,
  "temperature": 0
}'

echo "== the same, streamed as server-sent events (ends with data: [DONE])"
call -N "$BASE/v1/chat/completions" -H "Content-Type: application/json" -d '{
  "model": "'"$MODEL"'",
  "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}],
  "max_tokens": 16,
  "temperature": 0,
  "stream": true,
  "stream_options": {"include_usage": true}
}'

echo "== a text completion with a stop sequence, a seed, and request-level speculative settings"
call "$BASE/v1/completions" -H "Content-Type: application/json" -d '{
  "model": "'"$MODEL"'",
  "prompt": "def fibonacci(n):\n",
  "max_tokens": 48,
  "temperature": 0.7,
  "seed": 42,
  "stop": ["\n\n\n", "class "],
  "meshd": {"speculative": {"strategy": "ngram-simple", "window_max_tokens": 4}}
}'

echo "== an unsupported parameter is refused with a 400 that names it"
curl -sS "${AUTH[@]}" "$BASE/v1/chat/completions" -H "Content-Type: application/json" -d '{
  "model": "'"$MODEL"'", "messages": [{"role": "user", "content": "hi"}], "n": 2
}'
echo

echo "== Prometheus metrics (first lines)"
curl -sS "${AUTH[@]}" "$BASE/metrics" | grep -E '^meshd_api_(requests|generated_tokens)_total' | head -n 8
