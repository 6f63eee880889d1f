#!/usr/bin/env bash
# Classification demo on the CPU: synthetic CIFAR-100 -> train -> test.
# Trains KCLA CIFAR-ResNet-20 on synthetic data in the official
# cifar-100-python/ layout (10 classes), evaluates it and its untrained
# initialisation and prints their top-1/top-5 accuracy beside chance level.
# Arguments go to tools/run_demo_cls.py (e.g. --iters 300 --classes 10
# --work-dir work_dirs/demo_cls).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-.venv/bin/python}"
exec "$PY" tools/run_demo_cls.py --python "$PY" "$@"
