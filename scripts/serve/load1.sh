#!/bin/bash
# usage: load1.sh OUTDIR MAXTOK STRATEGIES CLIENTS
out=$1; tok=$2; strat=$3; clients=$4; shift 4
mkdir -p $out
cd /tmp/snap
PYTHONPATH=/tmp/snap/src /work/main/.venv/bin/python -m speculor.cli serve --threads 2 --port 8311 "$@" > $out/serve.log 2>&1 &
pid=$!
for i in $(seq 1 120); do curl -s localhost:8311/v1/models >/dev/null && break; sleep 2; done
PYTHONPATH=/tmp/snap/src /work/main/.venv/bin/python -m speculor.cli loadtest --url http://localhost:8311 --clients $clients --requests ${REQ:-1} --max-tokens $tok --sets mtbench,humaneval,summarize --limit 16 --strategy $strat --peer llama-server --threads 2 --out $out/load.json > $out/load.txt 2>$out/load.err
kill $pid; wait $pid 2>/dev/null
echo done
