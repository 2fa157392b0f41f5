#!/bin/bash
# usage: scripts/serve/load.sh OUTDIR MAXTOK STRATEGY [serve args...]
# `speculor serve --threads 2` on port 8311, then `speculor loadtest` at 1, 4 and 16 clients against it and against
# llama-server (`make llama-server` first); writes OUTDIR/load.json, load.txt (the table), serve.log, load.err.
# REQ=N: requests per client (default 1). SRC: the checkout to serve from (default: this one; the recorded runs used a
# snapshot of main in /tmp/snap). PY: the Python with speculor's dependencies (default: this checkout's .venv).
set -e
out=$(realpath -m "$1"); tok=$2; strat=$3; shift 3
here=$(pwd)
SRC=${SRC:-$here}; PY=${PY:-$here/.venv/bin/python}
mkdir -p "$out"
cd "$SRC"
PYTHONPATH=$SRC/src "$PY" -m speculor.cli serve --threads 2 --port 8311 "$@" > "$out/serve.log" 2>&1 &
pid=$!
for i in $(seq 1 120); do curl -s localhost:8311/v1/models >/dev/null && break; sleep 2; done
PYTHONPATH=$SRC/src "$PY" -m speculor.cli loadtest --url http://localhost:8311 --clients 1,4,16 --requests "${REQ:-1}" \
    --max-tokens "$tok" --sets mtbench,humaneval,summarize --limit 16 --strategy "$strat" --peer llama-server \
    --threads 2 --out "$out/load.json" > "$out/load.txt" 2> "$out/load.err"
kill $pid; wait $pid 2>/dev/null || true
echo done
