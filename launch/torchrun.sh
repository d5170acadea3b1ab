#!/usr/bin/env bash
# Launch training on one node (or one node of many) with torchrun.
#
#   launch/torchrun.sh NPROC --config launch/configs/tiny.toml --set train.engine=fsdp2 [--set ...]
#
# Multi-node: set NNODES, NODE_RANK and MASTER_ADDR (MASTER_PORT defaults to 29500) on every
# node; the SLURM script (launch/slurm/train.sbatch) does this for you. A run that exits with 75
# (preempted, checkpoint written) resumes when the same command runs again. launch/torchrun.py is torchrun
# (same arguments) whose SIGTERM / SIGUSR1 reach the workers, which save and exit 75; it then exits 75 too.
set -euo pipefail
if [ $# -lt 1 ] || ! [[ "$1" =~ ^[0-9]+$ ]]; then
  echo "usage: $0 NPROC_PER_NODE --config FILE [--set KEY=VALUE ...]" >&2
  exit 2
fi
NPROC="$1"; shift
cd "$(dirname "$0")/.."
if [ "${NNODES:-1}" -gt 1 ]; then
  exec python -m launch.torchrun --nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK}" \
    --nproc_per_node="$NPROC" --rdzv_backend=c10d --rdzv_endpoint="${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}" \
    --rdzv_id="${RDZV_ID:-focused-pretrain}" -m pretrain.train "$@"
fi
exec python -m launch.torchrun --standalone --nproc_per_node="$NPROC" -m pretrain.train "$@"
