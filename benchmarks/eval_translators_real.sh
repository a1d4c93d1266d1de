#!/usr/bin/env bash
# Translated caches between the real models (issue [3]): for each pair, the held-out corpus (seed 80923, never
# used to choose a translator setting) ingested by the source with chunks prefilled after its prompt head, 4
# retrieved chunks per question, answered by the target in modes direct (reads the text), none, and the
# translated store chunks with inject-all injection and with replay-joint. Resumable: rerun to continue.
# The default since 2026-12-06 (inject-all + the tail recompute) is the variant tr:inject-all+end@0.5.
#   LIMIT=24 bash benchmarks/eval_translators_real.sh
# VARIANTS (chunk_variants.py names) adds e.g. tr:direct+dev@0.15 (inject-all, then selective recompute);
# TR defaults to the bundled translators.
set -u
cd "$(dirname "$0")/.."
B=.venv/bin
OUT=${OUT:-runs/tr}
TR=${TR:-mot_cag/zoo/translators}
VARIANTS=${VARIANTS:-"direct,none,tr:direct,tr:replay-joint"}
LIMIT=${LIMIT:-24}
PAIRS=${PAIRS:-"smollm2-135m:qwen2.5-coder-0.5b smollm2-135m:gemma-3-270m qwen2.5-coder-0.5b:smollm2-135m gemma-3-270m:qwen2.5-coder-0.5b qwen2.5-coder-0.5b:gemma-3-270m gemma-3-270m:smollm2-135m"}
CORPUS=$OUT/heldout
[ -d $CORPUS ] || $B/mot-cag data corpus $CORPUS --docs 30 --questions 48 --seed 80923 --json > /dev/null
for pair in $PAIRS; do
  s=${pair%%:*}; t=${pair##*:}
  start=$(date +%s)
  $B/python benchmarks/chunk_variants.py --model $t --source $s --translator $TR/${s}__$t --corpus $CORPUS \
    --store $OUT/store-heldout-$s --out $OUT/heldout-${s}__$t --limit $LIMIT \
    --variants "$VARIANTS" --threads ${THREADS:-2} \
    > $OUT/heldout-${s}__$t.md 2> $OUT/heldout-${s}__$t.log
  echo "heldout $s -> $t $(( $(date +%s) - start )) s" >> $OUT/heldout-times.txt
done
echo finished >> $OUT/heldout-times.txt
