#!/usr/bin/env bash
# The main job: ingest the sample corpus once with the source model, then answer one question with three
# targets of different families from the same store (translated caches; no target prefills the text).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
STORE=stores/demo
QUESTION="Where was Cet Sor born?"   # answer: Stinddaldale (examples/corpus/people-00.txt)

echo "== models available here"
$BIN/mot-cag models
echo
echo "== ingest examples/corpus into $STORE (source model from pipelines/default.toml)"
$BIN/mot-cag ingest examples/corpus --store "$STORE"
$BIN/mot-cag store info --store "$STORE"
echo
echo "== ask: \"$QUESTION\""
translators=$($BIN/mot-cag translators --json)
source=$($BIN/python -c "from mot_cag.config import PipelineConfig; print(PipelineConfig.from_file().source)")
for target in qwen2-mini opt-mini gpt2-mini; do
  mode=translated
  if [ "$target" != "$source" ] && ! printf '%s' "$translators" | grep -q "\"target\": \"$target\""; then
    echo "(no translator $source -> $target is installed: answering from $target's own chunk caches instead;"
    echo " train one with: mot-cag train --source $source --target $target)"
    mode=native-chunks
  fi
  $BIN/mot-cag ask "$QUESTION" --store "$STORE" --target "$target" --mode "$mode"
  echo
done
