#!/usr/bin/env bash
# The one GPU check of the developers' guide, as one script for a lent device (run from the
# repository root; results land in $OUT, default ./gpu-check). Each stage runs even if an earlier
# one failed. PYTHON defaults to .venv/bin/python; on the lent machine use its python3 with
# ortools carried as wheels. Download them here once (`echo /.whl/ >> .git/info/exclude`):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl ortools==9.15.6755 immutabledict protobuf==6.33.6
# and run there, carrying `.whl` (about 130 s):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#     export PYTHONPATH=/tmp/site:$PWD && PYTHON=python3 bash benchmarks/gpu_check.sh
#   1. `autopar profile --device cuda` (the full sweep; --quick measures only 3 matmul sizes),
#      unless PROFILE names an existing profile of this GPU kind
#   2. one training step of gpt3-1.3b (sdpa attention) on one GPU, predicted vs measured, with
#      device time by kernel kind and by aten op
#   3. the same for a Llama 3 8B-shaped model cut to 8 layers at seq 8192, local batch 2 (the
#      shapes of torchtitan's measured Llama 3 8B run, published_runs row tt-8b-fsdp-8), with
#      torch's default AdamW (foreach) and with AdamW(fused=True)
#   4. gpt3-1.3b as named (eager attention: masked_fill, softmax and dropout kernels)
#   5. with RATES=1, benchmarks/kernel_rates.py: fused attention and dtype-cast rates, attention with
#      dropout, float8 GEMMs against bf16, RoPE eager against compiled
#   6. with FP8=1, one fp8 step of the 8-layer Llama (tensorwise, compiled casts; torchao carried as a
#      wheel beside ortools: `pip download ... torchao==0.18.0` into .whl), the FP8 issue's GPU check
set -uo pipefail
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
PY="${PYTHON:-.venv/bin/python}"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit,clocks.max.sm --format=csv
"$PY" -c "import torch, ortools; print('torch', torch.__version__, 'ortools', ortools.__version__)"
# The preset of this GPU (autopar.api.default_cluster: H100, H200, B200...), unless PRESET names one.
PRESET="${PRESET:-$("$PY" -c 'from autopar.api import default_cluster; print(default_cluster(1).split(":")[0])' \
    2>/dev/null || echo hgx-h200)}"
echo "preset $PRESET"
PROFILE="${PROFILE:-$OUT/$PRESET.json}"
[ -f "$PROFILE" ] || timeout 240 "$PY" -m autopar.cli profile --device cuda --out "$PROFILE" 2>&1 | tail -2
CLUSTER="$PRESET:nodes=1,gpus_per_node=1,profile=$PROFILE"
step() {  # name, model, batch, extra arguments
    timeout 150 "$PY" benchmarks/one_device_step.py --model "$2" --global-batch "$3" --cluster "$CLUSTER" \
        --kernels-out "$OUT/kernels-$1.txt" "${@:4}" 2>&1 | grep -v -i "warn" | tee "$OUT/step-$1.md"
}
LLAMA8="llama:layers=8,hidden=4096,heads=32,kv_heads=8,ffn_hidden=14336,seq=8192,vocab=128256"
step llama8 "$LLAMA8" 2
step llama8-fused "$LLAMA8" 2 --optimizer fused && rm -f "$OUT/kernels-llama8-fused.txt"
step gpt3-1.3b-sdpa "gpt3-1.3b:attention=sdpa" 8
step gpt3-1.3b gpt3-1.3b 8
if [ "${RATES:-0}" = 1 ]; then timeout 180 "$PY" benchmarks/kernel_rates.py 2>&1 | tee "$OUT/kernel-rates.md"; fi
if [ "${FP8:-0}" = 1 ]; then step llama8-fp8 "$LLAMA8" 2 --precision fp8; fi
