#!/usr/bin/env bash
# Fresh held-out corpus (seed 27191, never used before), recompute ratios incl. 0.3 never run held-out.
cd "$(dirname "$0")/.."
B=.venv/bin; OUT=runs/cv2; mkdir -p $OUT
[ -d $OUT/heldout ] || $B/mot-cag data corpus $OUT/heldout --docs 30 --questions 40 --seed 27191 --json > $OUT/corpus.json
# models as arguments (default: the two that can read the corpus); two calls may run side by side
for m in ${@:-qwen2.5-coder-0.5b gemma-3-270m}; do
  s=$(date +%s)
  $B/python benchmarks/chunk_variants.py --model $m --corpus $OUT/heldout --store $OUT/store-$m \
    --out $OUT/heldout-$m --limit 40 --variants "direct,none,stored,stored+dev@0.15,stored+dev@0.3" --threads 1 \
    > $OUT/heldout-$m.md 2> $OUT/heldout-$m.log
  echo "heldout $m $(( $(date +%s) - s )) s" >> $OUT/times.txt
done
echo "finished $*" >> $OUT/times.txt
