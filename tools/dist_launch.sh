#!/usr/bin/env bash
# The torchrun launch that dist_train.sh and dist_test.sh share:
#   tools/dist_launch.sh TOOL GPUS N ARG...
# runs tools/TOOL in GPUS processes per node with the first N ARGs (the tool's
# positional arguments), then --launcher pytorch, then the other ARGs unchanged.
#
# Environment: NNODES (1), NODE_RANK (0), PORT (29500), MASTER_ADDR (127.0.0.1),
# PYTHON (default: the repository's .venv/bin/python if present, else python).
set -euo pipefail
TOOL=$1
GPUS=$2
N=$3
shift 3
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    PYTHON="$ROOT/.venv/bin/python"
    [ -x "$PYTHON" ] || PYTHON=python
fi
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="${NNODES:-1}" \
    --node_rank="${NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" \
    --nproc_per_node="$GPUS" \
    --master_port="${PORT:-29500}" \
    "$ROOT/tools/$TOOL" "${@:1:$N}" --launcher pytorch "${@:$((N + 1))}"
