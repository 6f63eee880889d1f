#!/usr/bin/env bash
# Segmentation demo on the CPU: synthetic Kvasir-SEG -> converter -> train -> test.
# Trains a tiny KCLA-ResNet-18 UNet, evaluates it and its untrained
# initialisation, prints foreground IoU/DSC and writes prediction overlays to
# work_dirs/demo_seg/overlays. Arguments go to tools/run_demo_seg.py
# (e.g. --iters 300 --work-dir work_dirs/demo_seg).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" tools/run_demo_seg.py --python "$PY" "$@"
