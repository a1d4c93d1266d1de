#!/usr/bin/env bash
# The main job: ingest the sample corpus once with a real source model (SmolLM2-135M), then answer one question
# with the three real models of three families from that one store: SmolLM2 from its own stored chunk caches,
# Qwen2.5-Coder-0.5B and Gemma-3-270m from translated caches (no target prefills the retrieved text). Then the
# GPT-2 and OPT architectures, whose real weights are not available here, through the zoo's stand-ins.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
PIPELINE=pipelines/real.toml
STORE=stores/demo-real
QUESTION="Where was Cet Sor born?"   # answer: Stinddaldale (examples/corpus/people-00.txt)

ask_or_fallback() {  # store, target, extra options...
  local store=$1 target=$2; shift 2
  local source mode=translated
  source=$($BIN/mot-cag store info --store "$store" --json | $BIN/python -c "import json,sys; print(json.load(sys.stdin)['source'])")
  if [ "$target" != "$source" ] && ! $BIN/mot-cag translators --json | $BIN/python -c "
import json, sys
sys.exit(0 if any(t['source'] == '$source' and t['target'] == '$target' for t in json.load(sys.stdin)) else 1)"; then
    echo "(no translator $source -> $target is installed: answering from $target's own chunk caches instead;"
    echo " train one with: mot-cag train --source $source --target $target --kind ridge --token-features --data real)"
    mode=native-chunks
  fi
  $BIN/mot-cag ask "$QUESTION" --store "$store" --target "$target" --mode "$mode" "$@"
  echo
}

echo "== models available here (real models are converted from their packages on first use)"
$BIN/mot-cag models
echo
echo "== ingest examples/corpus into $STORE with smollm2-135m ($PIPELINE)"
$BIN/mot-cag ingest examples/corpus --pipeline "$PIPELINE" --store "$STORE"
$BIN/mot-cag store info --store "$STORE"
echo
echo "== ask the three real models: \"$QUESTION\""
for target in smollm2-135m qwen2.5-coder-0.5b gemma-3-270m; do
  ask_or_fallback "$STORE" "$target" --pipeline "$PIPELINE"
done
echo "== the OPT and GPT-2 architectures (zoo stand-ins trained here; their real weights are not available):"
echo "== a qwen2-mini store (pipelines/default.toml), answered by opt-mini and gpt2-mini through translated caches"
$BIN/mot-cag ingest examples/corpus --store stores/demo > /dev/null
for target in opt-mini gpt2-mini; do
  ask_or_fallback stores/demo "$target"
done
