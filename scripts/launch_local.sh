#!/usr/bin/env bash
# Train on this machine's CPU cores with NPROC ranks over gloo on loopback.
#   scripts/launch_local.sh NPROC [hydra overrides...]
#   scripts/launch_local.sh 2 residual=msar model=tiny parallel=pp2 trainer.max_steps=20
set -euo pipefail
if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NPROC [hydra overrides...]" >&2
  exit 2
fi
nproc=$1
shift
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-}
if [[ -z $py ]]; then
  if [[ -x $here/.venv/bin/python ]]; then py=$here/.venv/bin/python; else py=python3; fi
fi
export DS_ACCELERATOR=cpu
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}   # NPROC ranks share the cores: no oversubscription
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
exec "$py" -m torch.distributed.run --nproc_per_node "$nproc" --master_addr 127.0.0.1 --master_port "$port" \
  -m msar_train.train "$@"
