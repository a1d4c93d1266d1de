#!/usr/bin/env bash
# One prepared run on a GPU machine without the converted real models (such as the lent H200 of the `device`
# tool, whose image has its own torch): the CUDA tests, then translation vs the target's own prefill on the real
# models' architectures (random weights of the same shapes: benchmarks/bench_arch.py), fp32 and bf16, and the
# zoo-size pairs of bench_translate.py. Every step is bounded; results go to $OUT.
#
#   G=.gpu OUT=runs/gpu bash benchmarks/gpu_check.sh
#
# $G holds models/<name>/config.json (e.g. copied from ~/.cache/mot-cag/models) and translators/<pair>/config.json
# (weights optional); $WHEELS, when set, is a folder of wheels installed first (a transformers matching the
# project's pin).
set -u
OUT=${OUT:-runs/gpu}
G=${G:-.gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi -L
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_translate_cache.py \
  > "$OUT/pytest.txt" 2>&1
echo "pytest rc $?" >> "$OUT/env.txt"
for dt in float32 bfloat16; do
  timeout 150 python3 benchmarks/bench_arch.py --models "$G/models" --translators "$G/translators" \
    --tokens 1024,2048,4096 --device cuda --dtype $dt --repeats 10 --out "$OUT/arch-$dt.json" > "$OUT/arch-$dt.txt" 2>&1
  echo "bench_arch $dt rc $?" >> "$OUT/env.txt"
done
timeout 60 python3 benchmarks/bench_translate.py --device cuda --tokens 256 > "$OUT/zoo-translate.txt" 2>&1
echo "bench_translate rc $?" >> "$OUT/env.txt"
