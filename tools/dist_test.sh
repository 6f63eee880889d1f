#!/usr/bin/env bash
# Distributed testing with torchrun: tools/dist_test.sh CONFIG CHECKPOINT GPUS [test.py args]
#
# Environment: NNODES (1), NODE_RANK (0), PORT (29500), MASTER_ADDR (127.0.0.1),
# PYTHON (default: the repository's .venv/bin/python if present, else python).
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 CONFIG CHECKPOINT GPUS [tools/test.py arguments]" >&2
    exit 2
fi
exec bash "$(dirname "${BASH_SOURCE[0]}")/dist_launch.sh" test.py "$3" 2 "$1" "$2" "${@:4}"
