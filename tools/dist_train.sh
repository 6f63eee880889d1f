#!/usr/bin/env bash
# Distributed training with torchrun: tools/dist_train.sh CONFIG GPUS [train.py args]
#
# Environment: NNODES (1), NODE_RANK (0), PORT (29500), MASTER_ADDR (127.0.0.1),
# PYTHON (default: the repository's .venv/bin/python if present, else python).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 CONFIG GPUS [tools/train.py arguments]" >&2
    exit 2
fi
CONFIG=$1
GPUS=$2
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
    "$ROOT/tools/train.py" "$CONFIG" --launcher pytorch "${@:3}"
