#!/bin/bash
# usage: scripts/serve/one.sh SRC TAG
# `speculor serve --threads 2` from the checkout SRC, then 4 chat requests of 128 greedy tokens one after another;
# prints each request's seconds, keeps the answers in /tmp/ans_TAG_*.json. PY: the Python with speculor's
# dependencies (default: this checkout's .venv).
PY=${PY:-$(pwd)/.venv/bin/python}
export PYTHONPATH=$1/src
cd /tmp
$PY -m speculor.cli serve --threads 2 --port 8311 > /tmp/serve_$2.log 2>&1 &
S=$!
for i in $(seq 1 120); do curl -sf localhost:8311/health >/dev/null && break; sleep 2; done
REQ='{"model":"x","messages":[{"role":"user","content":"Write a short story about a robot who learns to paint. Make it vivid."}],"max_tokens":128,"temperature":0}'
for i in 1 2 3 4; do
  s=$(date +%s.%N); curl -s localhost:8311/v1/chat/completions -H 'content-type: application/json' -d "$REQ" > /tmp/ans_$2_$i.json; e=$(date +%s.%N)
  echo "$2 $i $(echo "$e - $s" | bc) s"
done
kill $S; wait
