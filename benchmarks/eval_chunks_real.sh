#!/usr/bin/env bash
# Joined chunk caches on the real models (issue [2]): each model as its own source and target, on a held-out
# corpus (fresh seed, never used to choose anything), 4 retrieved chunks. Resumable: rerun to continue.
#   R=0.15 bash benchmarks/eval_chunks_real.sh        # R: the recompute ratio chosen on the dev corpus
set -u
cd "$(dirname "$0")/.."
B=.venv/bin
OUT=${OUT:-runs/cv}
R=${R:-0.15}
LIMIT=${LIMIT:-48}
MODELS=${MODELS:-"qwen2.5-coder-0.5b gemma-3-270m smollm2-135m"}
[ -d $OUT/heldout ] || $B/mot-cag data corpus $OUT/heldout --docs 30 --questions 48 --seed 80923 --json > /dev/null
for m in $MODELS; do
  s=$(date +%s)
  $B/python benchmarks/chunk_variants.py --model $m --corpus $OUT/heldout --store $OUT/store-heldout-$m \
    --out $OUT/heldout-$m --limit $LIMIT --variants "direct,none,alone,stored,stored+dev@$R" --threads ${THREADS:-2} \
    > $OUT/heldout-$m.md 2> $OUT/heldout-$m.log
  echo "heldout $m $(( $(date +%s) - s )) s" >> $OUT/times.txt
done
echo finished >> $OUT/times.txt
