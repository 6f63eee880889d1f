#!/usr/bin/env bash
# The srun launch that slurm_train.sh and slurm_test.sh share:
#   tools/slurm_launch.sh TOOL PARTITION JOB_NAME ARG...
# runs tools/TOOL ARG... --launcher slurm in GPUS tasks of one GPU each;
# mmengine reads the ranks and the master address from Slurm's variables.
#
# Environment: GPUS (8), GPUS_PER_NODE (8), CPUS_PER_TASK (5), SRUN_ARGS (""),
# PYTHON (default: the repository's .venv/bin/python if present, else python).
set -euo pipefail
TOOL=$1
PARTITION=$2
JOB_NAME=$3
shift 3
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(( GPUS < 8 ? GPUS : 8 ))}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    PYTHON="$ROOT/.venv/bin/python"
    [ -x "$PYTHON" ] || PYTHON=python
fi
# shellcheck disable=SC2086  # SRUN_ARGS holds several arguments
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
exec srun -p "$PARTITION" \
    --job-name="$JOB_NAME" \
    --gres="gpu:$GPUS_PER_NODE" \
    --ntasks="$GPUS" \
    --ntasks-per-node="$GPUS_PER_NODE" \
    --cpus-per-task="$CPUS_PER_TASK" \
    --kill-on-bad-exit=1 \
    ${SRUN_ARGS:-} \
    "$PYTHON" -u "$ROOT/tools/$TOOL" "$@" --launcher slurm
