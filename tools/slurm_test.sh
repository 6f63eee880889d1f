#!/usr/bin/env bash
# Testing on a Slurm cluster, one task per GPU:
#   tools/slurm_test.sh PARTITION JOB_NAME CONFIG CHECKPOINT [tools/test.py arguments]
#
# Environment: GPUS (8, tasks in all), GPUS_PER_NODE (8), CPUS_PER_TASK (5),
# SRUN_ARGS (extra srun arguments),
# PYTHON (default: the repository's .venv/bin/python if present, else python).
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 PARTITION JOB_NAME CONFIG CHECKPOINT [tools/test.py arguments]" >&2
    exit 2
fi
exec bash "$(dirname "${BASH_SOURCE[0]}")/slurm_launch.sh" test.py "$1" "$2" "$3" "$4" "${@:5}"
