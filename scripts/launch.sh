#!/usr/bin/env bash
# Launch nanotrn on trn1.32xlarge (or trn2.48xlarge: --instance trn2) with plain torchrun. One call per node (SLURM's srun runs it on
# every node, see slurm_train.sbatch); every argument after the mode goes to train.py unchanged.
#
#   scripts/launch.sh health  --preset llama2_7b                              # pre-flight check
#   scripts/launch.sh compile --preset llama2_7b --data DATA --tokenizer TOK  # fill the compile cache
#   scripts/launch.sh train   --preset llama2_7b --data DATA --tokenizer TOK  # the run
#   DRY_RUN=1 NNODES=16 MASTER_ADDR=node-0 scripts/launch.sh train ...        # print it, run nothing
#
# Environment: NNODES (SLURM_JOB_NUM_NODES or 1), NPROC_PER_NODE (one rank per NeuronCore: 32 on
# trn1, 64 logical cores on trn2, from planner.instances.INSTANCES), MASTER_ADDR and MASTER_PORT (29500) of
# the rendezvous when NNODES > 1, NODE_RANK (SLURM_NODEID: a static node rank), RUN_ID
# (SLURM_JOB_ID), MAX_RESTARTS (3), COMPILE_STEPS (10), HEALTHCHECK_ARGS, NEURON_CACHE_DIR (see
# env.sh), PYTHON (python3), TORCHRUN (torchrun), DRY_RUN (1 = print the commands and environment),
# JOB_COMPLETION_INDEX (set by Kubernetes in an Indexed Job's pod: 0 hosts the rendezvous).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
cd "$root"

usage="usage: [DRY_RUN=1] scripts/launch.sh [--dry-run] train|compile|health [train.py arguments]"
# --dry-run anywhere (train.py has no such key): `launch.sh train --dry-run ...` was a config error.
args=()
for arg in "$@"; do
    if [[ "$arg" == --dry-run ]]; then DRY_RUN=1; else args+=("$arg"); fi
done
set -- ${args[@]+"${args[@]}"}          # (an empty array under set -u fails in bash < 4.4)
mode="${1:-}"
case "$mode" in
    train | compile | health) shift ;;
    -h | --help) echo "$usage"; exit 0 ;;                     # a request for help, not an error
    "") echo "$usage" >&2; exit 2 ;;
    *) echo "launch.sh: unknown mode '$mode'; $usage" >&2; exit 2 ;;
esac
for arg in "$@"; do         # help on what the mode runs (the config had taken --help for a key)
    if [[ "$arg" == -h || "$arg" == --help ]]; then
        echo "$usage"
        if [[ "$mode" == health ]]; then exec "${PYTHON:-python3}" scripts/healthcheck.py --help; fi
        exec "${PYTHON:-python3}" train.py --help
    fi
done
# Only 1 prints: any other value ran the job for real (DRY_RUN=true started it where it was typed).
if [[ ! "${DRY_RUN:-0}" =~ ^[01]$ ]]; then
    echo "error: DRY_RUN=$DRY_RUN: give 1 (print the commands, run nothing) or 0" >&2
    exit 2
fi

NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-}}"
MASTER_PORT="${MASTER_PORT:-29500}"
RUN_ID="${RUN_ID:-${SLURM_JOB_ID:-nanotrn}}"
MAX_RESTARTS="${MAX_RESTARTS:-3}"
COMPILE_STEPS="${COMPILE_STEPS:-10}"
PYTHON="${PYTHON:-python3}"
TORCHRUN="${TORCHRUN:-torchrun}"
# Whole numbers, else a Python traceback (int('x'), a division by zero) or torchrun's own below.
for var in NNODES NPROC_PER_NODE MAX_RESTARTS COMPILE_STEPS MASTER_PORT JOB_COMPLETION_INDEX; do
    value="${!var:-}" least=1
    [[ "$var" == MAX_RESTARTS || "$var" == JOB_COMPLETION_INDEX ]] && least=0
    if [[ -n "$value" ]] && { [[ ! "$value" =~ ^[0-9]+$ ]] || (( 10#$value < least )); }; then
        echo "error: $var=$value: give a whole number >= $least" >&2
        exit 2
    fi
    # as a decimal from here on: bash's own arithmetic reads 010 as octal 8 and 08 as an error, Python as 10 and 8
    if [[ -n "$value" ]]; then printf -v "$var" '%d' "$((10#$value))"; fi
done
# In range too: torchrun would fail on every node, as a retried error (a port: its traceback).
if ((10#$MASTER_PORT > 65535)); then
    echo "error: MASTER_PORT=$MASTER_PORT: give a TCP port, 1 to 65535" >&2
    exit 2
fi
# The port the Neuron runtime's collectives bootstrap on the first node (torch-xla sets
# NEURON_RT_ROOT_COMM_ID=MASTER_ADDR:62182 unless it is given, torch_xla/_internal/neuron.py): torchrun's store
# cannot listen there too. Given, it must name the first node across nodes: the Neuron docs' fix for a hang at
# collective init sets localhost:48620 (training-troubleshooting.rst), with which each node bootstraps alone.
RUNTIME_PORT=62182
if [[ -n "${NEURON_RT_ROOT_COMM_ID:-}" ]]; then
    if [[ ! "$NEURON_RT_ROOT_COMM_ID" =~ ^(.+):([0-9]{1,5})$ ]] || ((10#${BASH_REMATCH[2]} > 65535)); then
        echo "error: NEURON_RT_ROOT_COMM_ID=$NEURON_RT_ROOT_COMM_ID: give HOST:PORT (the first node and a free port)," \
             "or unset it (torch-xla then uses MASTER_ADDR:62182)" >&2
        exit 2
    fi
    RUNTIME_PORT=$((10#${BASH_REMATCH[2]}))
    if ((NNODES > 1)) && [[ "${BASH_REMATCH[1]}" =~ ^(localhost|127\.[0-9.]+|\[?::1\]?)$ ]]; then
        echo "error: NEURON_RT_ROOT_COMM_ID=$NEURON_RT_ROOT_COMM_ID names each node itself: with NNODES=$NNODES every" \
             "node's runtime would bootstrap alone; unset it (torch-xla then uses MASTER_ADDR:62182)" >&2
        exit 2
    fi
fi
if ((10#$MASTER_PORT == RUNTIME_PORT)); then
    echo "error: MASTER_PORT=$MASTER_PORT is the Neuron runtime's collectives bootstrap port on the first node" \
         "(NEURON_RT_ROOT_COMM_ID's, torch-xla's 62182 unless given): give another, e.g. MASTER_PORT=29500" >&2
    exit 2
fi
# The commands it runs, named by the variable that gives them (bash's own line, exit 127, named neither; a pod
# retried it). PYTHON now (it reads the config below), TORCHRUN after the config's checks, in a real run only.
no_command() {
    echo "error: $1=${!1}: no such command here; give the $2 of nanotrn's Python environment (its bin/ on PATH," \
         "or $1=/path/to/it)" >&2
    exit 2
}
command -v "$PYTHON" >/dev/null || no_command PYTHON python
# The pre-compile pass (below) evaluates at step 4 and saves at step 5: with fewer than 6 steps the eval, the
# save or the step after it (aws-neuron-sdk #813) stays out of the cache, and the run compiles it there (minutes).
if [[ "$mode" == compile ]] && ((10#$COMPILE_STEPS < 6)); then
    echo "error: COMPILE_STEPS=$COMPILE_STEPS: give 6 or more (the pass evaluates at step 4, saves at step 5 and" \
         "must run the step after that save)" >&2
    exit 2
fi
if [[ -n "$NODE_RANK" ]] && { [[ ! "$NODE_RANK" =~ ^[0-9]+$ ]] || ((10#$NODE_RANK >= 10#$NNODES)); }; then
    echo "error: NODE_RANK=$NODE_RANK: give a whole number below NNODES=$NNODES" >&2
    exit 2
fi
if [[ -n "$NODE_RANK" ]]; then NODE_RANK=$((10#$NODE_RANK)); fi

# Read the run's own config (configs.py needs only the standard library) and validate the layout
# for this world size and the xla backend now: a bad --tp, batch or pipeline p2p fails here, before
# 16 nodes start compiling. So do this node's paths (a missing --data or --tokenizer, an --out_dir it
# cannot write; not in a dry run, which may print a 128-node run anywhere): train.py would refuse them
# too, but as a failed run that torchrun and the Kubernetes Job retry, pod by pod. The
# instance type (--instance trn1|trn2) gives the ranks per node unless NPROC_PER_NODE is set.
layout_text="$(PYTHONPATH="$root" "$PYTHON" -c '
import sys
from importlib.util import find_spec
from configs import ConfigError, check_paths, from_args, resolve_dp, validate
from planner.instances import INSTANCES, check_instances
try:
    cfg = from_args(sys.argv[4:])
    hw = INSTANCES[cfg.parallel.instance]
    if int(sys.argv[2] or 0) > hw.cores:     # the ranks past them get no NeuronCore: each fails in the runtime, retried
        raise ConfigError(f"NPROC_PER_NODE={sys.argv[2]}: a {hw.name} has {hw.cores} NeuronCores (one rank each; "
                          f"trn2: logical cores at LNC=2); give at most {hw.cores}, or the --instance it runs on")
    world = int(sys.argv[1]) * int(sys.argv[2] or hw.cores)
    validate(cfg, world, "xla")      # Trainium: the rules of the xla backend too (pp_p2p, even pp)
    if world == int(sys.argv[1]) * hw.cores:
        check_instances(cfg, world)  # the planner rule that eks.py asks too: a TP group inside one instance
    if sys.argv[3] != "1":
        check_paths(cfg)
        # What the workers import, found without importing it: a Python without it (the DLAMI venv not activated)
        # was the traceback of the numpy import below, and one in each worker, retried by torchrun and the sbatch loop.
        # (tqdm too: the span index build imports it, on the node that builds it, after the workers start)
        need = ["torch", "numpy", "pyarrow", "sentencepiece", "tokenizers", "safetensors", "tqdm"]
        missing = [m for m in need + ["tensorboard"] * bool(cfg.log.tensorboard) if not find_spec(m)]
        if missing:
            missing = ", ".join(missing)
            raise ConfigError(f"the Python launch.sh runs ({sys.executable}) has no {missing}: activate "
                              f"the PyTorch venv of the Neuron DLAMI, with pip install -r requirements.txt run in it "
                              f"(docs/trn1.md), or give PYTHON=/path/to/that/python")
        from corpus import parse_mixture, resolve_paths    # numpy, pyarrow: what train.py reads --data with
        for entry, _ in parse_mixture(cfg.data.data):
            resolve_paths(entry, cfg.data.split)
        if cfg.device in ("auto", "xla") and not find_spec("libneuronxla"):   # else an error of each worker, retried
            raise ConfigError(f"--device={cfg.device} runs on Trainium under launch.sh (PJRT_DEVICE=NEURON, env.sh), "
                              f"but this Python has no libneuronxla (the runtime of torch-neuronx): run it in the "
                              f"PyTorch venv of the Neuron DLAMI, or give --device=cpu for a run on the CPU")
except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    sys.exit(2)                      # as a usage error: no retry can help (eks.py: podFailurePolicy FailJob)
p = cfg.parallel
print(cfg.optim.precision, p.tp, p.pp, resolve_dp(cfg, world), cfg.out_dir, p.instance, hw.name,
      world // int(sys.argv[1]), sep="\n")
' "$NNODES" "${NPROC_PER_NODE:-}" "${DRY_RUN:-0}" "$@")"
mapfile -t layout <<< "$layout_text"
precision="${layout[0]}" tp="${layout[1]}" pp="${layout[2]}" dp="${layout[3]}" out_dir="${layout[4]}"
instance="${layout[5]}" instance_name="${layout[6]}" NPROC_PER_NODE="${layout[7]}"
world=$((NNODES * NPROC_PER_NODE))
if [[ "${DRY_RUN:-0}" != 1 ]] && ! command -v "$TORCHRUN" >/dev/null; then no_command TORCHRUN torchrun; fi
if [[ "${DRY_RUN:-0}" != 1 && "$mode" == compile ]] && ! command -v neuron_parallel_compile >/dev/null; then
    echo "error: neuron_parallel_compile: no such command here; the compile pass needs torch-neuronx's (the Neuron" \
         "DLAMI's PyTorch environment on PATH, or the Dockerfile's image)" >&2
    exit 2
fi

export NNODES NANOTRN_PRECISION="$precision" NANOTRN_INSTANCE="$instance"
# shellcheck source=env.sh source-path=SCRIPTDIR
source "$here/env.sh"

# torchrun: one worker per NeuronCore. Ranks stay in blocks of NPROC_PER_NODE per node, so each
# TP group of 8 stays inside one instance (NeuronLink).
# Under SLURM (NODE_RANK known) the node rank is static, as in the NxD and HLAT scripts: node i of
# the allocation holds ranks i*NPROC_PER_NODE..., the same every attempt, and the 128 agents do
# not race through an elastic rendezvous. A failure then ends the step (--max-restarts=0) and
# slurm_train.sbatch starts it again on every node, resuming from the newest checkpoint.
# Without SLURM, multi-node uses the c10d rendezvous: when a worker dies, every node's agent
# notices and restarts its workers, so --max-restarts restarts the whole job.
# Each step of a job (health, compile, train) gets its own rendezvous id.
launcher=("$TORCHRUN" --nproc_per_node="$NPROC_PER_NODE" --nnodes="$NNODES")
restarts="$MAX_RESTARTS"
if ((NNODES > 1)); then
    if [[ -z "${MASTER_ADDR:-}" ]]; then
        echo "error: NNODES=$NNODES needs MASTER_ADDR (the first node's host name; the sbatch script sets it)" >&2
        exit 2
    fi
    if [[ "$MASTER_ADDR" =~ [[:space:]] ]]; then          # e.g. every node of scontrol show hostnames
        read -r -a words <<< "${MASTER_ADDR//$'\n'/ }"
        echo "error: MASTER_ADDR='${words[*]}' holds several words: give the first node's host name alone," \
             "e.g. MASTER_ADDR=${words[0]}" >&2
        exit 2
    fi
    if [[ "$MASTER_ADDR" =~ ^([^:]+):([0-9]+)$ ]]; then     # (an IPv6 address has several ':')
        echo "error: MASTER_ADDR=$MASTER_ADDR holds a port: give the host alone, MASTER_ADDR=${BASH_REMATCH[1]}," \
             "and the port as MASTER_PORT=${BASH_REMATCH[2]} (torchrun joins them; '$MASTER_ADDR:$MASTER_PORT'" \
             "names no host)" >&2
        exit 2
    fi
    if [[ -n "$NODE_RANK" ]]; then
        launcher+=(--node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT")
        restarts=0
    else
        launcher+=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RUN_ID-$mode")
        # Which agent hosts the rendezvous store: left alone, each torchrun guesses by resolving
        # MASTER_ADDR and comparing the answer with its own addresses, once. A Kubernetes pod's DNS
        # record appears only after the pod has started (and the miss of an early lookup by another
        # pod may be cached for seconds): pod 0 then guesses "not me", no agent hosts the store, and
        # every pod fails after 60 s (pytorch/pytorch#80772; meta-pytorch/torchx#541). An Indexed
        # Job's pod knows its index (scripts/eks.py): pod 0 hosts, the others connect, waiting for
        # the name to resolve. They wait as long as torchrun waits for a node to join (600 s), not
        # the store's 60 s: when pod 0 dies every other pod fails and is replaced at once, but pod
        # 0's replacement on a new node takes minutes (the instance, the image), and meanwhile each
        # 60 s spent one retry of every index (backoffLimitPerIndex) until the Job failed.
        if [[ -n "${JOB_COMPLETION_INDEX:-}" ]]; then
            launcher+=(--rdzv-conf="is_host=$((10#$JOB_COMPLETION_INDEX == 0 ? 1 : 0)),read_timeout=600")
        fi
    fi
else
    launcher+=(--standalone)
fi

# The node, before any rank starts. Every rank holds sockets and files (EFA, the runtime, data
# shards, checkpoint files): raise the open-file limit as the NxD scripts do (ulimit -n 65535).
# Reserve the rendezvous port and the port the Neuron runtime's collectives bootstrap on
# (RUNTIME_PORT, above) so that no outgoing connection of
# another process takes them as its ephemeral port (the NxD scripts: sysctl
# net.ipv4.ip_local_reserved_ports, with sudo). The list is added to, never replaced.
NOFILE=65535
reserved="$(cat /proc/sys/net/ipv4/ip_local_reserved_ports 2>/dev/null || true)"
is_reserved() {     # the kernel prints consecutive ports as one range: 29500,29501 reads back 29500-29501
    local item items
    [[ -n "$reserved" ]] || return 1        # (an empty array under set -u fails in bash < 4.4)
    IFS=, read -r -a items <<< "$reserved"
    for item in "${items[@]}"; do
        if ((${item%-*} <= $1 && $1 <= ${item#*-})); then return 0; fi
    done
    return 1
}
missing=()
for port in "$MASTER_PORT" "$RUNTIME_PORT"; do
    is_reserved "$port" || missing+=("$port")
done
node_setup=("ulimit -n $NOFILE")
if ((${#missing[@]})); then
    ports="$(IFS=,; echo "${reserved:+$reserved,}${missing[*]}")"
    node_setup+=("sudo -n sysctl -q -w net.ipv4.ip_local_reserved_ports=$ports")
fi

case "$mode" in
train)
    cmd=("${launcher[@]}" --max-restarts="$restarts" train.py "$@") ;;
compile)
    # neuron_parallel_compile runs the same command in graph-extraction mode (outputs are
    # invalid), then compiles every graph in parallel into NEURON_CACHE_DIR. Everything that
    # shapes a graph must match the real run, so only the step count changes; an eval and a
    # checkpoint save inside the few steps put the eval graph and the steps after a save
    # (aws-neuron-sdk #813) in the cache too, and a log at step 5 the log graph, whatever the run's
    # --log.interval (no graph's shape depends on it: XLA:CPU census at 2 and 4). train.py sees NEURON_EXTRACT_GRAPHS_ONLY and writes
    # no checkpoint and no export (its values are invalid), yet traces the save and load graphs;
    # the side directories are never created, let alone resumed from.
    side="$out_dir/precompile"
    cmd=(neuron_parallel_compile "${launcher[@]}" --max-restarts=0 train.py "$@"
         --optim.max_steps="$COMPILE_STEPS" --log.eval_interval=4 --ckpt.interval=5
         --log.interval=5 --ckpt.dir="$side/ckpt" --out_dir="$side" --log.tensorboard=) ;;
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
    echo "# nanotrn $mode (dry run): $NNODES node(s) x $NPROC_PER_NODE ranks = $world ($instance_name);" \
         "tp=$tp pp=$pp dp=$dp; precision=$precision"
    printf '%s\n' "${node_setup[@]}"
    for v in "${NANOTRN_ENV_VARS[@]}"; do echo "export $v=$(quote "${!v}")"; done
    echo "cd $(quote "$root")"
    quote "${cmd[@]}"
    exit 0
fi
hard="$(ulimit -Hn)"
if [[ "$hard" != unlimited ]] && ((hard < NOFILE)); then
    echo "warning: the hard open-file limit is $hard (< $NOFILE); at 128 nodes ranks may run out" >&2
    NOFILE="$hard"
fi
ulimit -n "$NOFILE"
# (sudo's own complaint, "command not found" or "a password is required", would be a second line)
if ((${#missing[@]})) && ! sudo -n sysctl -q -w "net.ipv4.ip_local_reserved_ports=$ports" 2>/dev/null; then
    echo "warning: could not reserve ports ${missing[*]} (needs sudo): another process may take them" >&2
fi
if ! mkdir -p "$NEURON_CACHE_DIR" 2>/dev/null; then     # (mkdir's own line named neither the variable nor a fix)
    echo "error: NEURON_CACHE_DIR=$NEURON_CACHE_DIR cannot be created here; give a folder on this node's own disk" >&2
    exit 2
fi
if [[ "$mode" != train ]]; then exec "${cmd[@]}"; fi

# The run: a stop must reach the workers without torchrun's fixed 30 s. torchrun turns SIGTERM
# (and INT, HUP, QUIT) into "signal every worker, SIGKILL them 30 s later" (torch's elastic agent:
# PContext.close(timeout=30)), and SIGUSR1 would kill torchrun itself (it installs no handler).
# So torchrun runs with USR1 ignored (inherited through exec; train.py installs its own handler)
# and this shell stays as its parent: a USR1 or TERM to this shell (SLURM's early warning through
# slurm_train.sbatch; Kubernetes' SIGTERM to the container's first process, this script) is sent
# on as USR1 to torchrun's children, the workers, which stop at the next step boundary with a
# checkpoint and exit 0. torchrun never sees it, so the launcher's own grace period applies
# (terminationGracePeriodSeconds on Kubernetes; docs/checkpoints.md). A USR1 sent to every process of the
# job (scancel --signal=USR1) reaches the workers directly and torchrun ignores it.
# A stop and the run's end both exit 0 in train.py; a worker that ended the run (--optim.max_steps reached,
# exported) leaves a file in NANOTRN_ENDED_DIR, so that a signal after the last step is told from a stop below.
# A stop leaves 'stop' there first: a worker's first seconds (torch's import, the config's checks, the group) still
# ignore USR1 as torchrun does, so a signal then was lost and the run trained on until the launcher's SIGKILL;
# each worker reads the file once its handlers exist (checkpoint.StopSignal), and a torchrun restart's workers too.
ended_dir="$(mktemp -d)" || ended_dir=""
export NANOTRN_ENDED_DIR="$ended_dir"
( trap '' USR1; exec "${cmd[@]}" ) &
torchrun_pid=$!
stopping=0
# shellcheck disable=SC2317  # called by the traps below
stop_workers() {
    echo "launch.sh: $1: asking the workers of torchrun (pid $torchrun_pid) to save and stop (SIGUSR1)" >&2
    stopping=1
    if [[ -n "$ended_dir" ]]; then : > "$ended_dir/stop"; fi     # before the signal: read after the handlers exist
    pkill -USR1 -P "$torchrun_pid" || true
}
trap 'stop_workers SIGUSR1' USR1
trap 'stop_workers SIGTERM' TERM
# wait returns early when a trapped signal arrives: wait again until torchrun has exited.
# After a stop, the workers exit once their checkpoint is written; a torchrun whose workers all
# succeeded then waits in its exit barrier for the other nodes' agents (torch elastic's
# _exit_barrier, 300 s). Where only this node was signalled (a Kubernetes pod drained alone), the
# others restart their workers instead and never arrive, so this node would hang for 300 s: once
# its workers have been gone for STOP_LINGER_S, torchrun is told to end (TERM, then KILL 5 s later:
# blocked in the barrier's store wait it may not run its handler; its workers are gone already). Where every node was signalled (SLURM), the barrier
# completes in well under STOP_LINGER_S and torchrun exits 0 by itself.
rc=0
gone=0
while true; do
    if ((stopping)); then
        sleep 1 & wait $! 2>/dev/null || true
        if ! kill -0 "$torchrun_pid" 2>/dev/null; then
            if wait "$torchrun_pid"; then rc=0; else rc=$?; fi
            break
        fi
        if pgrep -P "$torchrun_pid" >/dev/null; then gone=0; else gone=$((gone + 1)); fi
        if ((gone == ${STOP_LINGER_S:-10})); then
            echo "launch.sh: the workers stopped; ending torchrun's wait for the other nodes" >&2
            kill -TERM "$torchrun_pid" 2>/dev/null || true
        elif ((gone >= ${STOP_LINGER_S:-10} + 5)); then
            # Blocked in the barrier's store wait (C++), torchrun runs no Python signal handler.
            kill -KILL "$torchrun_pid" 2>/dev/null || true
        fi
        continue
    fi
    if wait "$torchrun_pid"; then rc=0; else rc=$?; fi
    if ! kill -0 "$torchrun_pid" 2>/dev/null; then break; fi
done
if ((rc > 128)); then       # perhaps a trap's, with torchrun gone meanwhile: its own status then
    if wait "$torchrun_pid" 2>/dev/null; then last=0; else last=$?; fi
    if ((last != 127)); then rc=$last; fi
fi
ended=0
if [[ -n "$ended_dir" ]]; then
    ended="$(find "$ended_dir" -name 'ended.*' | wc -l)"
    rm -rf "$ended_dir"
fi
# In a Kubernetes Job's pod, exit 0 marks the pod Succeeded and its index complete: a pod stopped short
# (SIGTERM: a drain, a spot reclaim, `kubectl delete pod`) whose workers saved and exited 0 (a 1-node Job,
# or every pod signalled) left the Job Complete at that step, never resumed. 143 (128 + TERM) fails the
# pod instead: the Job replaces it (an eviction is no retry: DisruptionTarget) and the new pod resumes.
# A signal after the last step stops nothing: every worker of this node had ended the run, which is
# complete; it exits 0 (143 failed the pod and its replacement waited for pods that had finished).
# torchrun's own status is not asked then: it may be ours (TERM, KILL) from its wait for the other nodes.
if ((stopping && ended == NPROC_PER_NODE)); then
    echo "launch.sh: the run had ended (--optim.max_steps) before the signal: exit 0" >&2
    rc=0
elif ((stopping && rc == 0)) && [[ -n "${JOB_COMPLETION_INDEX:-}" ]]; then
    echo "launch.sh: stopped by the signal: exit 143, so that the Job replaces this pod to continue (from the newest checkpoint)" >&2
    rc=143
fi
exit "$rc"
