#!/bin/bash
# usage: scripts/serve/load1.sh OUTDIR MAXTOK STRATEGIES CLIENTS [serve args...]
# load.sh with the clients' levels given (e.g. 16: the one-by-one level and 16 at once) and several strategies
# (e.g. default,plain) asked of one server. SRC, PY, REQ: as in load.sh.
set -e
out=$(realpath -m "$1"); tok=$2; strat=$3; clients=$4; shift 4
here=$(pwd)
SRC=${SRC:-$here}; PY=${PY:-$here/.venv/bin/python}
mkdir -p "$out"
cd "$SRC"
PYTHONPATH=$SRC/src "$PY" -m speculor.cli serve --threads 2 --port 8311 "$@" > "$out/serve.log" 2>&1 &
pid=$!
for i in $(seq 1 120); do curl -s localhost:8311/v1/models >/dev/null && break; sleep 2; done
PYTHONPATH=$SRC/src "$PY" -m speculor.cli loadtest --url http://localhost:8311 --clients "$clients" \
    --requests "${REQ:-1}" --max-tokens "$tok" --sets mtbench,humaneval,summarize --limit 16 --strategy "$strat" \
    --peer llama-server --threads 2 --out "$out/load.json" > "$out/load.txt" 2> "$out/load.err"
kill $pid; wait $pid 2>/dev/null || true
echo done
