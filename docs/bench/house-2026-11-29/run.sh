#!/bin/bash
# usage: run.sh SRC OUTDIR  -- greedy records on both backends, fixed set, 1 thread
set -e
SRC=$1; OUT=$2; mkdir -p $OUT
export PYTHONPATH=$SRC OMP_NUM_THREADS=1
PY=/work/main/.venv/bin/python
$PY -c "import speculor,sys; print(speculor.__file__, file=sys.stderr)"
$PY -m speculor.cli bench --backend llama.cpp --threads 1 --strategies ${LS:-plain,chain:k=4,dyspec:budget=auto,suffix,sequoia:budget=auto,specinfer} --sets mtbench,humaneval,code-edit --limit 4 --max-new-tokens 48 --rounds 1 --out $OUT/llama > $OUT/llama.log 2>&1
$PY -m speculor.cli bench --backend llama.cpp --threads 1 --strategies plain,chain:k=4,suffix:budget=auto --sets mtbench,code-edit --limit 4 --max-new-tokens 32 --rounds 1 --batch 4 --out $OUT/llama-b4 > $OUT/llama-b4.log 2>&1
$PY -m speculor.cli bench --backend torch --threads 1 --strategies plain,chain:k=4,suffix,dyspec:budget=auto --sets mtbench,humaneval --limit 3 --max-new-tokens 32 --rounds 1 --out $OUT/torch > $OUT/torch.log 2>&1
echo done
