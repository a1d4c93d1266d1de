#!/usr/bin/env bash
# The main job, as far as it is built: list the models usable here and check each one's KV-cache layer.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
echo "== models available here"
$BIN/mot-cag models
echo "== cache layer check (prefill + continue vs single pass) for every model"
$BIN/mot-cag models check --all --device auto
