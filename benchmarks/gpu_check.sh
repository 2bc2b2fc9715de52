#!/usr/bin/env bash
# The one GPU check of the developers' guide, as one script for a lent device (run via the device
# tool from the repository root; results land in $OUT, default ./gpu-check):
#   1. `autopar profile --device cuda --quick` -> benchmarks/profiles/<gpu>.json
#   2. one training step of gpt3-1.3b on one GPU, predicted vs measured (benchmarks/one_device_step.py)
# Needs: make install done on the device machine (or a carried .venv).
set -euo pipefail
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT" benchmarks/profiles
PY="${PYTHON:-.venv/bin/python}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-' | tr -cd 'a-z0-9-')
PROFILE="benchmarks/profiles/${GPU}.json"
PRESET="${PRESET:-hgx-h200}"
timeout 300 "$PY" -m autopar.cli profile --device cuda --quick --out "$PROFILE" 2>&1 | tee "$OUT/profile.log"
cp "$PROFILE" "$OUT/"
timeout 240 "$PY" benchmarks/one_device_step.py --model "${MODEL:-gpt3-1.3b}" --global-batch "${BATCH:-8}" \
    --cluster "$PRESET:nodes=1,gpus_per_node=1,profile=$PROFILE" 2>&1 | tee "$OUT/step.md"
