#!/usr/bin/env bash
# Create .venv in the repository root and install kcla_mm with its stack.
#
# Idempotent: a second run takes seconds. The slow step is building mmcv 2.1.0
# (full, with compiled ops) from source: about 15 minutes on 2 cores. The built
# wheel is kept in $KCLA_WHEEL_DIR (default ~/.cache/kcla_mm/wheels) and reused.
#
# Environment:
#   KCLA_VENV       venv path (default: <repo>/.venv)
#   KCLA_TORCH      torch (and torchvision) requirements to install first
#                   (default: "torch===2.13.0 torchvision==0.28.0": the
#                   registry's build, made for CUDA, which runs on CPU-only
#                   machines as well; torchvision is what mmpretrain imports).
#                   "===" asks for exactly that release, not a local "+cpu"
#                   file that a machine's find-links may also offer: PyPI's
#                   torchvision cannot load beside a CPU-only torch. Another
#                   CUDA build: install torch and torchvision into the venv
#                   first and set KCLA_TORCH=skip.
#   KCLA_WHEEL_DIR  where the mmcv wheel is cached.
#   MAX_JOBS        parallel compile jobs for mmcv (default: nproc).
#   KCLA_EXTRAS     optional extras of setup.cfg to install too, comma-separated,
#                   e.g. KCLA_EXTRAS=deploy (onnx and onnxruntime, for
#                   tools/deployment/). Default: none.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KCLA_VENV:-$ROOT/.venv}"
TORCH_REQ="${KCLA_TORCH:-torch===2.13.0 torchvision==0.28.0}"
WHEEL_DIR="${KCLA_WHEEL_DIR:-$HOME/.cache/kcla_mm/wheels}"
PY="$VENV/bin/python"
STAMP="$VENV/.kcla_mm_installed"
EXTRAS="${KCLA_EXTRAS:-}"

log() { printf '[setup_env] %s\n' "$*"; }

if [ ! -x "$PY" ]; then
    log "creating virtual environment at $VENV"
    python3 -m venv "$VENV"
fi

# Fast path: everything already installed for this requirements/setup.cfg.
want="$( (cat "$ROOT/requirements.txt" "$ROOT/setup.cfg"; echo "extras=$EXTRAS") \
    | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
        && "$PY" -c "import mmcv.ops, mmdet, mmseg, mmpretrain, kcla_mm" 2>/dev/null; then
    log "environment up to date ($VENV)"
    exit 0
fi

PIP=("$PY" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade "pip<26" "setuptools>=77,<81" wheel ninja

if [ "$TORCH_REQ" != "skip" ]; then
    log "installing $TORCH_REQ"
    # shellcheck disable=SC2086  # several requirements, split on spaces
    "${PIP[@]}" install -q $TORCH_REQ
fi
"$PY" -c "import torch, torchvision; print('[setup_env] torch', torch.__version__, 'torchvision', torchvision.__version__)"

# numpy<2 before mmcv so the build and the ops see the same ABI.
"${PIP[@]}" install -q "numpy<2" "opencv-python<4.12"

if ! "$PY" -c "import mmcv.ops" 2>/dev/null; then
    mkdir -p "$WHEEL_DIR"
    torch_tag="$("$PY" -c "import torch; print(torch.__version__.replace('+', '_'))")"
    tagged="$WHEEL_DIR/torch-$torch_tag"
    mkdir -p "$tagged"
    if ! ls "$tagged"/mmcv-2.1.0-*.whl >/dev/null 2>&1; then
        log "building mmcv 2.1.0 with compiled ops (first run only, ~15 min on 2 cores)"
        export MMCV_WITH_OPS=1 FORCE_CUDA="${FORCE_CUDA:-0}"
        export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
        # --no-cache-dir: pip's own wheel cache ignores which torch a wheel
        # was built against; this build is for the torch installed above
        "${PIP[@]}" wheel --no-cache-dir --no-build-isolation --no-deps -w "$tagged" mmcv==2.1.0
    else
        log "reusing cached mmcv wheel from $tagged"
    fi
    "${PIP[@]}" install -q --no-deps "$tagged"/mmcv-2.1.0-*.whl
fi

log "installing requirements and kcla_mm (editable)"
"${PIP[@]}" install -q --find-links "$WHEEL_DIR/torch-$("$PY" -c "import torch; print(torch.__version__.replace('+', '_'))")" \
    -r "$ROOT/requirements.txt"
"${PIP[@]}" install -q --no-build-isolation --no-deps -e "$ROOT[tests]" 2>/dev/null \
    || "${PIP[@]}" install -q --no-build-isolation --no-deps -e "$ROOT"
"${PIP[@]}" install -q "pytest>=7" "flake8>=6,<8" "isort>=5,<7"
if [ -n "$EXTRAS" ]; then
    # everything else is installed by now: this adds only the extras' packages
    log "installing the extras [$EXTRAS]"
    "${PIP[@]}" install -q --no-build-isolation -e "$ROOT[$EXTRAS]"
fi

"$PY" -c "import mmcv.ops, mmdet, mmseg, mmpretrain, kcla_mm; print('[setup_env] mmcv', mmcv.__version__, 'mmdet', mmdet.__version__, 'mmseg', mmseg.__version__, 'mmpretrain', mmpretrain.__version__)"
# the fused CPU inference kernels of KCLA (built once per machine type into
# torch's extension cache; without a compiler the eager path runs instead)
if "$PY" -m kcla_mm.ops.fused.build >/dev/null 2>&1; then
    log "fused KCLA CPU kernels built"
else
    log "WARNING: the fused KCLA CPU kernels could not be built; inference uses the eager path" \
        "(see: $PY -m kcla_mm.ops.fused.build)"
fi
echo "$want" > "$STAMP"
log "done"
