#!/usr/bin/env bash
# Detection demo: synthetic shapes data, a small KCLA Faster R-CNN trained on the
# CPU in a few minutes, its COCO AP next to the untrained model's, pictures of
# the predictions. Everything goes to work_dirs/demo_det (see
# tools/demo_detection.py; extra arguments go to it, e.g. --max-iters 100).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python
exec "$PY" tools/demo_detection.py "$@"
