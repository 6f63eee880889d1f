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
exec bash "$(dirname "${BASH_SOURCE[0]}")/dist_launch.sh" train.py "$2" 1 "$1" "${@:3}"
