# shellcheck shell=bash
# The Trainium environment of a nanotrn run: every variable the launcher sets, in one place.
# Sourced by scripts/launch.sh (never by the model: train.py reads no Neuron variable).
#
# Inputs (environment, all optional):
#   NANOTRN_PRECISION  optim.precision of the run (launch.sh reads it from the config); bf16_sr
#                      turns on the hardware stochastic rounding
#   NNODES             number of trn1 instances; > 1 adds the EFA variables
#   NEURON_CACHE_DIR   compile cache, default /var/tmp/neuron-compile-cache (the root volume)
#   NEURON_CC_EXTRA_FLAGS  appended to NEURON_CC_FLAGS
#
# The values are the ones of the AWS blog and the HLAT scripts (see ../README.md, Running on trn1).

NEURON_CACHE_DIR="${NEURON_CACHE_DIR:-/var/tmp/neuron-compile-cache}"

# The blog's stability lesson: with the Neuron persistent cache on the shared FSx, every core of
# 128 nodes polled it, and the traffic caused communication timeouts. Keep it on each node's
# local disk. Refuse a network file system here, before any node starts compiling.
nanotrn_check_local_dir() {
    local dir="$1" probe="$1" fstype
    while [[ ! -e "$probe" && "$probe" != "/" ]]; do probe="$(dirname "$probe")"; done
    fstype="$(stat -f -c %T "$probe" 2>/dev/null || echo unknown)"
    case "$fstype" in
        nfs* | lustre* | fuse* | ceph* | gpfs* | smb* | cifs* | 9p | UNKNOWN*)
            echo "error: NEURON_CACHE_DIR=$dir is on a '$fstype' file system; the Neuron compile" \
                 "cache must be on each node's local disk (the blog: a shared cache caused" \
                 "timeouts). Set NEURON_CACHE_DIR to a local path, e.g. /var/tmp/neuron-compile-cache." >&2
            return 1 ;;
    esac
}
nanotrn_check_local_dir "$NEURON_CACHE_DIR" || exit 1

# The PJRT plugin of torch-neuronx: torch_xla.device() is a NeuronCore.
export PJRT_DEVICE=NEURON
# Compiler: transformer-specific optimizations and the LLM-training distribution strategy (the
# blog), and the local cache. neuron_parallel_compile and the real run both read this variable,
# so the pre-compiled graphs are found by the run (same cache, same flags).
export NEURON_CC_FLAGS="--model-type=transformer --distribution-strategy=llm-training --cache_dir=${NEURON_CACHE_DIR}${NEURON_CC_EXTRA_FLAGS:+ ${NEURON_CC_EXTRA_FLAGS}}"
export NEURON_COMPILE_CACHE_URL="$NEURON_CACHE_DIR"
# Custom softmax lowering (the blog) and host/device overlap: up to 3 graphs in flight.
export NEURON_FUSE_SOFTMAX=1
export NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS=3
# bf16 weights with stochastic rounding in hardware (XLA_USE_BF16 is gone since Neuron 2.24: the
# model is cast with model.to(torch.bfloat16) in train.py). Explicitly off for other precisions.
if [[ "${NANOTRN_PRECISION:-}" == "bf16_sr" ]]; then
    export NEURON_RT_STOCHASTIC_ROUNDING_EN=1
else
    export NEURON_RT_STOCHASTIC_ROUNDING_EN=0
fi
# 32 ranks per host each with many threads: cap glibc malloc arenas (host memory, HLAT scripts).
export MALLOC_ARENA_MAX=64

NANOTRN_ENV_VARS=(PJRT_DEVICE NEURON_CC_FLAGS NEURON_COMPILE_CACHE_URL NEURON_FUSE_SOFTMAX
                  NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS NEURON_RT_STOCHASTIC_ROUNDING_EN
                  MALLOC_ARENA_MAX)

# Multi-node: collectives between instances go over EFA with device RDMA; fork-safe because the
# data loader forks worker processes.
if (( ${NNODES:-1} > 1 )); then
    export FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 FI_EFA_FORK_SAFE=1
    NANOTRN_ENV_VARS+=(FI_PROVIDER FI_EFA_USE_DEVICE_RDMA FI_EFA_FORK_SAFE)
fi
