#!/usr/bin/env bash
# Training on a Slurm cluster, one task per GPU:
#   tools/slurm_train.sh PARTITION JOB_NAME CONFIG WORK_DIR [tools/train.py arguments]
# Works for every config of the project (detection, segmentation, classification).
#
# Environment: GPUS (8, tasks in all), GPUS_PER_NODE (8), CPUS_PER_TASK (5),
# SRUN_ARGS (extra srun arguments, e.g. "--quotatype=auto"),
# PYTHON (default: the repository's .venv/bin/python if present, else python).
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 PARTITION JOB_NAME CONFIG WORK_DIR [tools/train.py arguments]" >&2
    exit 2
fi
exec bash "$(dirname "${BASH_SOURCE[0]}")/slurm_launch.sh" train.py "$1" "$2" "$3" \
    --work-dir "$4" "${@:5}"
