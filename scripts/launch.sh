#!/usr/bin/env bash
# Launch nanotrn on trn1.32xlarge with plain torchrun. One call per node (SLURM's srun runs it on
# every node, see slurm_train.sbatch); every argument after the mode goes to train.py unchanged.
#
#   scripts/launch.sh health  --preset llama2_7b                              # pre-flight check
#   scripts/launch.sh compile --preset llama2_7b --data DATA --tokenizer TOK  # fill the compile cache
#   scripts/launch.sh train   --preset llama2_7b --data DATA --tokenizer TOK  # the run
#   DRY_RUN=1 NNODES=16 MASTER_ADDR=node-0 scripts/launch.sh train ...        # print it, run nothing
#
# Environment: NNODES (SLURM_JOB_NUM_NODES or 1), NPROC_PER_NODE (32: one rank per NeuronCore),
# MASTER_ADDR and MASTER_PORT (29500) of the rendezvous when NNODES > 1, RUN_ID (SLURM_JOB_ID),
# MAX_RESTARTS (3), COMPILE_STEPS (10), HEALTHCHECK_ARGS, NEURON_CACHE_DIR (see env.sh),
# PYTHON (python3), TORCHRUN (torchrun), DRY_RUN (1 = print the command and environment only).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
cd "$root"

usage() {
    echo "usage: [DRY_RUN=1] scripts/launch.sh [--dry-run] train|compile|health [train.py arguments]" >&2
    exit 2
}
if [[ "${1:-}" == "--dry-run" ]]; then DRY_RUN=1; shift; fi
mode="${1:-}"
case "$mode" in train | compile | health) shift ;; *) usage ;; esac

NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
NPROC_PER_NODE="${NPROC_PER_NODE:-32}"
MASTER_PORT="${MASTER_PORT:-29500}"
RUN_ID="${RUN_ID:-${SLURM_JOB_ID:-nanotrn}}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
COMPILE_STEPS="${COMPILE_STEPS:-10}"
PYTHON="${PYTHON:-python3}"
TORCHRUN="${TORCHRUN:-torchrun}"
world=$((NNODES * NPROC_PER_NODE))

# Read the run's own config (configs.py needs only the standard library) and validate the layout
# for this world size now: a bad --tp or batch fails here, before 16 nodes start compiling.
layout_text="$(PYTHONPATH="$root" "$PYTHON" -c '
import sys
from configs import ConfigError, from_args, resolve_dp, validate
try:
    cfg = from_args(sys.argv[2:])
    validate(cfg, int(sys.argv[1]))
except ConfigError as e:
    sys.exit(f"config error: {e}")
p = cfg.parallel
print(cfg.optim.precision, p.tp, p.pp, resolve_dp(cfg, int(sys.argv[1])), sep="\n")
print(cfg.out_dir)
' "$world" "$@")"
mapfile -t layout <<< "$layout_text"
precision="${layout[0]}" tp="${layout[1]}" pp="${layout[2]}" dp="${layout[3]}" out_dir="${layout[4]}"

export NNODES NANOTRN_PRECISION="$precision"
# shellcheck source=env.sh source-path=SCRIPTDIR
source "$here/env.sh"

# torchrun: one worker per NeuronCore. Multi-node uses the c10d rendezvous rather than a static
# --node_rank: when a worker dies, its node's agent re-enters the rendezvous and the agents of all
# other nodes notice and restart their workers too, so --max-restarts restarts the whole job
# (train.py then resumes from the newest complete checkpoint). Ranks stay in blocks of
# NPROC_PER_NODE per node, so each TP group of 8 stays inside one instance (NeuronLink).
# Each step of a job (health, compile, train) gets its own rendezvous id.
launcher=("$TORCHRUN" --nproc_per_node="$NPROC_PER_NODE" --nnodes="$NNODES")
if ((NNODES > 1)); then
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        echo "error: NNODES=$NNODES needs MASTER_ADDR (the first node's host name; the sbatch script sets it)" >&2
        exit 2
    fi
    launcher+=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RUN_ID-$mode")
else
    launcher+=(--standalone)
fi

case "$mode" in
train)
    cmd=("${launcher[@]}" --max-restarts="$MAX_RESTARTS" train.py "$@") ;;
compile)
    # neuron_parallel_compile runs the same command in graph-extraction mode (outputs are
    # invalid), then compiles every graph in parallel into NEURON_CACHE_DIR. Everything that
    # shapes a graph must match the real run, so only the step count changes; an eval and a
    # checkpoint save inside the few steps put the eval graph and the steps after a save
    # (aws-neuron-sdk #813) in the cache too. Its invalid checkpoint goes to a side directory
    # that the real run never resumes from.
    side="$out_dir/precompile"
    cmd=(neuron_parallel_compile "${launcher[@]}" --max-restarts=0 train.py "$@"
         --optim.max_steps="$COMPILE_STEPS" --log.eval_interval=4 --ckpt.interval=5
         --ckpt.resume=false --ckpt.dir="$side/ckpt" --out_dir="$side" --log.tensorboard=) ;;
health)
    read -r -a extra <<< "${HEALTHCHECK_ARGS:-}"
    cmd=("${launcher[@]}" --max-restarts=0 scripts/healthcheck.py --tp="$tp" --pp="$pp" "${extra[@]}") ;;
esac

quote() {  # print words so that a shell reads them back unchanged
    local s out=()
    for s in "$@"; do
        if [[ -n "$s" && "$s" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+=("$s")
        else out+=("'${s//\'/\'\\\'\'}'"); fi
    done
    echo "${out[*]}"
}

if [[ "${DRY_RUN:-0}" == "1" ]]; then
    echo "# nanotrn $mode (dry run): $NNODES node(s) x $NPROC_PER_NODE ranks = $world; tp=$tp pp=$pp dp=$dp; precision=$precision"
    for v in "${NANOTRN_ENV_VARS[@]}"; do echo "export $v=$(quote "${!v}")"; done
    echo "cd $(quote "$root")"
    if [[ "$mode" == compile ]]; then echo "rm -rf -- $(quote "$side")"; fi
    quote "${cmd[@]}"
    exit 0
fi
mkdir -p "$NEURON_CACHE_DIR"
if [[ "$mode" == compile ]]; then
    # The side directory holds only an earlier compile pass's invalid checkpoints; with them there,
    # --ckpt.resume=false would refuse to start (and resuming would skip the steps to trace).
    rm -rf -- "$side"
fi
exec "${cmd[@]}"
