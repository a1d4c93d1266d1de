#!/usr/bin/env bash
# Evaluation of the real models (issue 11): single-document QA and a held-out store, direct and none.
set -u
cd "$(dirname "$0")/.."
B=.venv/bin
OUT=${OUT:-benchmarks/results/real-models}
[ -f $OUT/qa.jsonl ] || $B/mot-cag data synth --task qa --n 40 --seed 52817 --out $OUT/qa.jsonl
[ -d $OUT/corpus ] || $B/mot-cag data corpus $OUT/corpus --docs 24 --questions 30 --seed 64033 --json > $OUT/corpus.json
for m in smollm2-135m gemma-3-270m qwen2.5-coder-0.5b; do
  if [ ! -s $OUT/qa-$m.json ]; then
    s=$(date +%s); $B/mot-cag eval --dataset $OUT/qa.jsonl --target $m --mode direct --mode none --device cpu \
      --details $OUT/qa-$m.details.jsonl --json > $OUT/qa-$m.json 2> $OUT/qa-$m.err; echo "qa $m $(( $(date +%s) - s )) s" >> $OUT/times.txt
  fi
done
for m in smollm2-135m gemma-3-270m qwen2.5-coder-0.5b; do
  if [ ! -d $OUT/store-$m ]; then
    s=$(date +%s); $B/mot-cag ingest $OUT/corpus/docs --store $OUT/store-$m --source $m --json > $OUT/ingest-$m.json 2>&1; echo "ingest $m $(( $(date +%s) - s )) s" >> $OUT/times.txt
  fi
  if [ ! -s $OUT/store-$m.json ]; then
    s=$(date +%s); $B/mot-cag eval --dataset $OUT/corpus/questions.jsonl --store $OUT/store-$m --target $m --top-k 4 \
      --mode direct --mode native-chunks --mode none --device cpu --details $OUT/store-$m.details.jsonl --json > $OUT/store-$m.json 2> $OUT/store-$m.err
    echo "store $m $(( $(date +%s) - s )) s" >> $OUT/times.txt
  fi
done
echo finished >> $OUT/times.txt
