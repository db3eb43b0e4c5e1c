# shellcheck shell=bash
# The Trainium environment of a nanotrn run: every variable the launcher sets, in one place.
# Sourced by scripts/launch.sh (never by the model: train.py reads no Neuron variable).
#
# Targets the Neuron 2.29 DLAMI (torch-neuronx 2.9.0.2.13, torch-xla 2.9, neuronx-cc 2.24, NxD 0.18):
# the last Neuron release that trains with PyTorch/XLA (docs/trn1.md).
#
# Inputs (environment, all optional):
#   NANOTRN_PRECISION  optim.precision of the run (launch.sh reads it from the config); bf16_sr
#                      turns on the hardware stochastic rounding
#   NANOTRN_INSTANCE   trn1 | trn2 (parallel.instance of the run, read from the config)
#   NANOTRN_SR_SEED    the stochastic-rounding seed, the same on every rank (default 0)
#   NNODES             number of instances; > 1 adds the EFA variables
#   NEURON_CACHE_DIR   compile cache, default /var/tmp/neuron-compile-cache (the root volume)
#   NEURON_CC_EXTRA_FLAGS  appended to NEURON_CC_FLAGS
#
# The values are the ones of the AWS blog and the HLAT scripts (see ../docs/trn1.md).

# The pin, read by the Dockerfile's build check and by the tests (its base image tag must match):
# the Neuron release, and the torch-neuronx it ships.
# shellcheck disable=SC2034  # read by the Dockerfile and tests/test_eks.py, not by the launch
NANOTRN_NEURON_SDK=2.29.0
NANOTRN_TORCH_NEURONX=2.9.0.2.13

NEURON_CACHE_DIR="${NEURON_CACHE_DIR:-/var/tmp/neuron-compile-cache}"
# NEURON_CC_FLAGS below carries it as --cache_dir=PATH, and the flags are split on whitespace.
if [[ "$NEURON_CACHE_DIR" =~ [[:space:]] ]]; then
    echo "error: NEURON_CACHE_DIR='$NEURON_CACHE_DIR': NEURON_CC_FLAGS passes it to the compiler as" \
         "--cache_dir=PATH, split on whitespace; give a path without whitespace" >&2
    exit 2                                              # a configuration error, as NANOTRN_SR_SEED's below
fi

# The blog's stability lesson: with the Neuron persistent cache on the shared FSx, every core of
# 128 nodes polled it, and the traffic caused communication timeouts. Keep it on each node's
# local disk. Refuse a network file system here, before any node starts compiling, and a cache URL
# (the Neuron cache takes s3://..., one cache all nodes share: neuron-caching.rst).
nanotrn_check_local_dir() {
    local dir="$1" probe="$1" fstype
    if [[ "$dir" =~ ^[A-Za-z][A-Za-z0-9+.-]*:// ]]; then
        echo "error: NEURON_CACHE_DIR=$dir is a URL, one cache every node would share; the Neuron compile cache" \
             "must be on each node's local disk (the blog: a shared cache caused timeouts). Set NEURON_CACHE_DIR" \
             "to a local path, e.g. /var/tmp/neuron-compile-cache." >&2
        return 1
    fi
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
nanotrn_check_local_dir "$NEURON_CACHE_DIR" || exit 2        # a configuration error: no retry can help

# The PJRT plugin of torch-neuronx: torch_xla.device() is a NeuronCore.
export PJRT_DEVICE=NEURON
# Compiler: transformer-specific optimizations and the LLM-training distribution strategy (the
# blog), and the local cache. neuron_parallel_compile and the real run both read this variable,
# so the pre-compiled graphs are found by the run (same cache, same flags). A compile cut short (a
# torchrun restart kills every node's workers, one may be compiling a missed graph; the time
# limit's USR1 during the compile step) is cached as failed, and every later run on that node
# skips it and fails: --retry_failed_compilation compiles it again (Neuron docs, neuron-caching
# "a compilation interrupted by ctrl-C ... marked as failed"; NxD's run_llama_7b_tp_ptl.sh sets it).
# It and --cache_dir are the cache wrapper's flags (neuron_cc_wrapper), not passed to neuronx-cc.
# --distribution-strategy=llm-training on trn1 only, the blog's and HLAT's flag. AWS's trn2 configs pass none
# (neuronx-distributed-training examples/conf/hf_llama3_8B_trn2_config.yaml and hf_llama3_70B_trn2_config.yaml:
# compiler_flags '--model-type transformer'); NxD's Llama scripts dropped it on trn1 too at Neuron 2.22 (its
# release notes, nxd-core.rst: Llama3-8B slower with it on PyTorch 2.5): kept there, as measured by the blog.
strategy=" --distribution-strategy=llm-training"
if [[ "${NANOTRN_INSTANCE:-trn1}" == "trn2" ]]; then
    strategy=""
fi
export NEURON_CC_FLAGS="--model-type=transformer${strategy} --retry_failed_compilation --cache_dir=${NEURON_CACHE_DIR}${NEURON_CC_EXTRA_FLAGS:+ ${NEURON_CC_EXTRA_FLAGS}}"
export NEURON_COMPILE_CACHE_URL="$NEURON_CACHE_DIR"
# Custom softmax lowering (the blog) and host/device overlap: up to 3 graphs in flight. The
# in-flight variable does nothing from Neuron 2.31 on (the runtime ignores it); it matters on the
# 2.29 DLAMI this targets, the last release that trains with PyTorch/XLA.
export NEURON_FUSE_SOFTMAX=1
export NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS=3
# A graph may wait this long (seconds) for its collectives: at 128 nodes a slow first step, a
# checkpoint save on some ranks or a late node can take minutes without anything being wrong. The
# runtime's default is 30 s by its configuration guide, 600 s on trn1 by its developer guide
# (neuron-runtime/guides); NxDT's Llama configs set 100 (neuron_rt_exec_timeout), the HLAT scripts 4000.
export NEURON_RT_EXEC_TIMEOUT=4000
# bf16 weights with stochastic rounding in hardware (not XLA_USE_BF16: deprecated, torch-xla 2.9
# still reads it with a warning; the model is cast with model.to(torch.bfloat16) in train.py).
# Explicitly off for other precisions.
if [[ "${NANOTRN_PRECISION:-}" == "bf16_sr" ]]; then
    export NEURON_RT_STOCHASTIC_ROUNDING_EN=1
else
    export NEURON_RT_STOCHASTIC_ROUNDING_EN=0
fi
# bf16_sr without ZeRO-1 (HLAT 7B) updates the weights on every DP replica independently and
# relies on all of them rounding the same sums the same way: one seed, set explicitly, on every
# rank (the runtime's default is 0, but nothing then says so). monitor.py logs the spread of the
# parameter norm over the DP group and warns when the replicas drift apart anyway.
# The runtime keeps the seed as a uint32 (nki's random seeds are 32-bit too): a longer number would
# wrap or be cut by its parser, a seed other than the one given; 11 digits and more are refused unread
# (bash's integers wrap past 2^63).
sr_seed="${NANOTRN_SR_SEED:-0}"
if [[ ! "$sr_seed" =~ ^[0-9]{1,10}$ ]] || (( 10#$sr_seed > 4294967295 )); then    # else the runtime meets it after the compile
    echo "error: NANOTRN_SR_SEED=$NANOTRN_SR_SEED: give a whole number from 0 to 4294967295 (the 32-bit seed of the" \
         "hardware's stochastic rounding, the same on every rank), or leave it unset for 0" >&2
    exit 2                                              # a configuration error: no retry can help (eks.py: FailJob)
fi
export NEURON_RT_STOCHASTIC_ROUNDING_SEED="${NANOTRN_SR_SEED:-0}"
# trn2: two physical NeuronCore-v3 per logical core (LNC=2), the Neuron default, stated: 64 ranks
# per trn2.48xlarge. The compiler's --logical-nc-config defaults to the same 2.
if [[ "${NANOTRN_INSTANCE:-trn1}" == "trn2" ]]; then
    export NEURON_LOGICAL_NC_CONFIG=2
fi
# Functionalization back on: Neuron turns it off by default, and with it off torch-neuronx
# 2.6-2.9 returns wrong data from split/chunk along a non-leading dimension (pytorch/xla#8640);
# the model splits qkv and gate_up on the last dimension. NxD's 70B scripts set the same
# (examples/training/llama/tp_pp_llama_hf_pretrain/run_llama2_70B_tp_pp.sh). On XLA:CPU already,
# torch-xla 2.9 with it off gives this model another first loss than eager CPU; with it on, the
# same (tests/test_xla.py).
export XLA_DISABLE_FUNCTIONALIZATION=0
# 32 ranks per host each with many threads: cap glibc malloc arenas (host memory, HLAT scripts).
export MALLOC_ARENA_MAX=64
# Gloo groups (the host group for checkpoint barriers on XLA) connect to a peer only when they
# first talk to it: a barrier then opens 2*log2(world) sockets per rank (24 at 4096 ranks), not a
# full mesh of 4095 per rank, 131k per node (parallel.new_host_group sets the same).
export TORCH_GLOO_LAZY_INIT=1

NANOTRN_ENV_VARS=(PJRT_DEVICE NEURON_CC_FLAGS NEURON_COMPILE_CACHE_URL NEURON_FUSE_SOFTMAX
                  NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS NEURON_RT_EXEC_TIMEOUT
                  NEURON_RT_STOCHASTIC_ROUNDING_EN NEURON_RT_STOCHASTIC_ROUNDING_SEED
                  MALLOC_ARENA_MAX TORCH_GLOO_LAZY_INIT XLA_DISABLE_FUNCTIONALIZATION)
if [[ -n "${NEURON_LOGICAL_NC_CONFIG:-}" ]]; then NANOTRN_ENV_VARS+=(NEURON_LOGICAL_NC_CONFIG); fi

# Multi-node: collectives between instances go over EFA with device RDMA (FI_PROVIDER=efa,
# FI_EFA_USE_DEVICE_RDMA=1: every NxD and NxDT launch script). FI_EFA_FORK_SAFE=1: on kernels before
# 5.15 (Amazon Linux 2's 5.10) the Neuron runtime disables multi-node collectives without it (Neuron
# docs, nrt-troubleshoot "FI_EFA_FORK_SAFE"), and where the kernel does not make fork safe itself
# libfabric aborts a rank that forks (ofiwg/libfabric prov/efa/src/efa_fork_support.c): a compile on
# a cache miss runs neuronx-cc as a child of the rank (nanotrn's data loader is a thread, it forks
# nothing). With it libfabric puts no bounce buffer in huge pages, so a pod needs no hugepages-2Mi.
# And a rendezvous that takes a replaced node (Kubernetes restarts a failed pod; scripts/eks.py):
# by default torchrun's c10d agents share one store with their workers, whose address the rank-0
# agent publishes only in its first round, so a new agent waits for it forever (torch 2.9,
# dynamic_rendezvous.py: _bootstrap_store_info is cached). Off, each round's rank 0 worker hosts a
# fresh store. Static node ranks (SLURM) ignore it (static_tcp_rendezvous.py).
if (( ${NNODES:-1} > 1 )); then
    export FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 FI_EFA_FORK_SAFE=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    NANOTRN_ENV_VARS+=(FI_PROVIDER FI_EFA_USE_DEVICE_RDMA FI_EFA_FORK_SAFE TORCH_DISABLE_SHARE_RDZV_TCP_STORE)
fi
