"""The blog's way on Amazon EKS: the Kubernetes manifests of a nanotrn run, from the same sources
as SLURM. One pod per Trainium instance, each running the same `scripts/launch.sh` that
`slurm_train.sbatch` runs on a node, with the environment of `scripts/env.sh` and the hardware of
the planner's instance table (planner/instances.py). No operator is needed on the cluster.

    python scripts/eks.py --preset llama2_7b --nodes 128 --image IMAGE --fsx-claim CLAIM \\
        --data /fsx/data/train.arrow --tokenizer /fsx/tok.model | kubectl apply -f -
    python scripts/eks.py ... --job compile | kubectl apply -f -      # fill the compile caches first
    python scripts/eks.py ... --out manifests/                         # both, one file each

Every flag eks.py does not know is train.py's (validated here, for nodes x cores ranks, before
anything is written). What it writes (docs/eks.md):
  - a headless Service: pod i of a Job is <job>-i.<name>, so pod 0 is reachable before any pod is
    ready; torchrun's c10d rendezvous runs on pod 0 (MASTER_ADDR);
  - an Indexed Job, one pod per instance (anti-affinity), each with every Neuron device and (more
    than one node) every EFA interface of the instance, the FSx claim for data, checkpoints and
    TensorBoard, a memory-backed /dev/shm, the compile cache on the node's own disk (hostPath).
    --job train: a node-local health check, then `exec scripts/launch.sh train`; --job compile:
    the run's full health check (node pairs over EFA), then `exec scripts/launch.sh compile`.

Followed where it cannot run here (cited at each place): the Neuron EKS docs ("Kubernetes
environment setup for Neuron": device plugin resources; "How to prepare trn1.32xlarge for multi-node
execution": EFA devices), AWS's own Trainium manifests (aws-samples/awsome-distributed-training
3.test_cases/pytorch/neuronx-distributed/llama3/kubernetes/llama3_train.yaml-template;
aws/aws-k8s-tester test/cases/neuron-training/manifests/bert-training.yaml, an Indexed Job with a
headless Service and MASTER_ADDR=<job>-0.<service>) and the Kubernetes Job API (1.31).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
from configs import ConfigError, check_dir, from_args, path_kind, validate  # noqa: E402
from planner.instances import INSTANCES, check_instances  # noqa: E402  (the planner's table)

WORKDIR = "/opt/nanotrn"        # where the Dockerfile puts the repository in the image
CONTAINER = "nanotrn"
STOP_MARGIN_S = 5               # of the pod's grace period, for passing the stop on and the workers' exit:
                                # train.py's final save gets the rest (--ckpt.grace_s, checkpoint.stop_budget)
CONFIG_ERROR = 2                # launch.sh's exit status for a bad configuration: no retry can help
RUNTIME_PORT = 62182            # the Neuron runtime's collectives bootstrap on pod 0 (torch-xla's
                                # NEURON_RT_ROOT_COMM_ID default; launch.sh reserves it too)


def fail(msg: str):
    sys.exit(f"error: {msg}")


# ----------------------------------------------------------------------------- the inputs

def parse(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                 epilog="every other flag is train.py's (--preset, --data, --tp, ...)")
    ap.add_argument("--nodes", type=int, required=True, help="instances (one pod each)")
    ap.add_argument("--image", required=True, help="the nanotrn image (Dockerfile), e.g. ECR_URI:TAG")
    ap.add_argument("--fsx-claim", required=True, help="PersistentVolumeClaim of the FSx for Lustre file system")
    ap.add_argument("--mount", default="/fsx", help="where the FSx claim is mounted in the pods (default: %(default)s)")
    ap.add_argument("--name", default="nanotrn",
                    help="the Service; the Jobs are NAME-train and NAME-compile (default: %(default)s)")
    ap.add_argument("--namespace", default="default",
                    help="the Kubernetes namespace of the Service and Jobs (default: %(default)s)")
    ap.add_argument("--job", choices=("train", "compile"), default="train",
                    help="what goes to stdout: the training Job or the pre-compile Job (with the Service) "
                         "(default: %(default)s)")
    ap.add_argument("--out", default="", help="write NAME-compile.yaml and NAME-train.yaml here instead")
    ap.add_argument("--max-restarts", type=int, default=3,
                    help="torchrun's restarts of a pod's workers, and the Job's replacements of each pod "
                         "(default: %(default)s)")
    ap.add_argument("--grace-period", type=int, default=60,
                    help="terminationGracePeriodSeconds: the final save's budget plus 5 s (default: %(default)s)")
    ap.add_argument("--shm", default="64Gi", help="size limit of the memory-backed /dev/shm (default: %(default)s)")
    ap.add_argument("--cache-dir", default="/var/tmp/neuron-compile-cache",
                    help="the Neuron compile cache on each node's local disk (hostPath) (default: %(default)s)")
    ap.add_argument("--port", type=int, default=29500,
                    help="the rendezvous port on pod 0 (and the next one: the compile Job's health check) "
                         "(default: %(default)s)")
    return ap.parse_known_args(argv)


# An image reference (the distribution project's grammar): [host[:port]/]path[:tag][@digest], the path lower case.
_HOST, _PART = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?", r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE = re.compile(rf"(?:{_HOST}(?:\.{_HOST})*(?::[0-9]+)?/)?{_PART}(?:/{_PART})*(?::\w[\w.-]{{0,127}})?"
                   r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")


def dns_name(flag: str, value: str, limit: int) -> str:
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", value) or len(value) > limit:
        fail(f"{flag} {value!r} is not a Kubernetes name: lower-case letters, digits and '-', "
             f"at most {limit} characters")
    return value


def check(args, train_args: list[str]):
    """Every refusal, before anything is written. Returns (config, instance, train.py arguments)."""
    if args.nodes < 1:
        fail(f"--nodes {args.nodes}: give the number of instances, at least 1")
    # Job names become pod host names <job>-<index> (63 characters) and label values.
    dns_name("--name", args.name, 63 - len("-compile-") - len(str(args.nodes - 1)))
    dns_name("--namespace", args.namespace, 63)
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", args.fsx_claim) or len(args.fsx_claim) > 253:
        fail(f"--fsx-claim {args.fsx_claim!r} is not a PersistentVolumeClaim name: lower-case letters, digits, "
             f"'-' and '.' (kubectl get pvc lists them)")
    if not IMAGE.fullmatch(args.image):             # else every pod waits in InvalidImageName
        fail(f"--image {args.image!r}: give the image as a registry reference, e.g. ECR_URI:TAG")
    if not 1 <= args.port < 65535 or RUNTIME_PORT in (args.port, args.port + 1):
        fail(f"--port {args.port}: give a TCP port from 1 to 65534 whose next one is free too (the compile "
             f"Job's health check), not {RUNTIME_PORT - 1} or {RUNTIME_PORT} (the Neuron runtime's)")
    if not (m := re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMGTPE]i|[kMGTPE])?", args.shm)):
        fail(f"--shm {args.shm!r} is not a Kubernetes quantity: give e.g. 64Gi")
    # Ki..Ei: powers of 1024; k..E: of 1000; none: bytes (--shm 1 is one byte)
    scale = {"": 1} | {u: 1000 ** i for i, u in enumerate("kMGTPE", 1)}
    scale |= {u + "i": 1024 ** i for i, u in enumerate("KMGTPE", 1)}
    if float(m[1]) * scale[m[2] or ""] < 64 * 2**20:
        fail(f"--shm {args.shm!r}: give at least 64Mi, e.g. 64Gi (a container's /dev/shm without this volume is 64 MB, "
             f"the size the volume is there to exceed)")
    if args.out and (kind := path_kind(args.out)) not in ("nothing", "a directory"):
        fail(f"--out {args.out} is {kind}: give a directory")
    try:                    # one it can write into: /proc is a directory even root cannot (mkdir's traceback after the checks)
        if args.out:
            check_dir("out", args.out)
    except ConfigError as e:
        fail(str(e))
    if not 0 <= args.max_restarts < 2**31:       # the Job's backoffLimitPerIndex: an int32, else kubectl apply refuses
        fail(f"--max-restarts {args.max_restarts}: give 0 to 2147483647 (the Job's backoffLimitPerIndex is a 32-bit integer)")
    if args.grace_period > 10**9:       # configs' bound on seconds (--ckpt.grace_s follows it); a float past it rounds
        fail(f"--grace-period {args.grace_period}: give at most 1000000000 s (about 30 years), the bound of "
             f"--ckpt.grace_s, which follows it")
    # (torchrun's fixed 30 s from its SIGTERM to its SIGKILL is not in the way: launch.sh passes the pod's SIGTERM
    # to the workers alone; a budget too short for the final save skips it and says so: checkpoint.stop_budget)
    if args.grace_period <= STOP_MARGIN_S:
        fail(f"--grace-period {args.grace_period}: the final save's budget (--ckpt.grace_s) is the grace period "
             f"minus {STOP_MARGIN_S} s to stop: give more than {STOP_MARGIN_S} s (one step plus the save, "
             f"docs/checkpoints.md; default 60)")
    if not args.mount.startswith("/") or args.mount.rstrip("/") in ("", "/dev", "/dev/shm"):
        fail(f"--mount {args.mount!r}: give an absolute path such as /fsx")
    if not args.cache_dir.startswith("/") or under(args.cache_dir, args.mount):
        fail(f"--cache-dir {args.cache_dir!r}: the compile cache must be an absolute path on each node's "
             f"local disk, not on FSx ({args.mount}): a shared cache caused timeouts in the blog's run")
    # A volume over the image's code hides scripts/launch.sh, and two at one path are rejected.
    for flag, path in (("--mount", args.mount), ("--cache-dir", args.cache_dir)):
        for other, what in ((WORKDIR, "the image's code"), ("/dev/shm", "the shared-memory volume")):
            if under(path, other) or under(other, path):
                fail(f"{flag} {path!r} overlaps {other} ({what}): give another path")
    mount = args.mount.rstrip("/")
    try:
        cfg = from_args(train_args)
        # Inside a pod only the FSx mount outlives the pod: the run's outputs go there by default.
        given = lambda flag: any(a == flag or a.startswith(flag + "=") for a in train_args)  # noqa: E731
        extra = ([] if given("--out_dir") else [f"--out_dir={mount}/{args.name}"]) + \
                ([] if given("--data.cache_dir") else [f"--data.cache_dir={mount}/{args.name}/cache"]) + \
                ([] if given("--ckpt.grace_s") else [f"--ckpt.grace_s={args.grace_period - STOP_MARGIN_S}"])
        train_args = [*train_args, *extra]
        cfg = from_args(train_args)
        # The kubelet SIGKILLs the pod terminationGracePeriodSeconds after its SIGTERM: a final save
        # budgeted beyond that is killed half-written (checkpoint.stop_budget trusts --ckpt.grace_s).
        if cfg.ckpt.grace_s > args.grace_period - STOP_MARGIN_S:
            fail(f"--ckpt.grace_s={cfg.ckpt.grace_s:g} does not fit the pod's --grace-period {args.grace_period} "
                 f"(minus {STOP_MARGIN_S} s to stop): give --grace-period {math.ceil(cfg.ckpt.grace_s) + STOP_MARGIN_S} "
                 f"or more, or leave --ckpt.grace_s out (it follows --grace-period)")
        hw = INSTANCES[cfg.parallel.instance]
        check_instances(cfg, args.nodes * hw.cores)         # the planner's rule: TP inside one instance
        validate(cfg, args.nodes * hw.cores, "xla")          # launch.sh's own check, for this world size
    except ConfigError as e:
        fail(str(e))                    # "error: <what and the fix>", one line
    for key, path in (("out_dir", cfg.out_dir), ("ckpt.dir", cfg.ckpt.dir), ("log.tensorboard", cfg.log.tensorboard)):
        if path and not under(path, mount):
            fail(f"--{key}={path} is not on the FSx mount {mount}: a pod's own disk is gone when the pod "
                 f"ends; give a path under {mount}")
    # What the pods read may be in the image (not refused), but an absolute path off the mount is
    # more often this machine's: every pod would fail at start, and be retried. --data's entries
    # drop their mixture weight ('a.arrow:0.7').
    data = [re.sub(r":[0-9.eE+-]+$", "", e.strip()) for e in cfg.data.data.split(",") if e.strip()]
    off = [f"--{key} {p}" for key, paths in (("data", data), ("tokenizer", [cfg.data.tokenizer]),
                                             ("init_from", [cfg.init_from]))
           for p in paths if p.startswith("/") and not under(p, mount)]
    if off:
        print(f"warning: {', '.join(off)}: not on the FSx mount {mount}, so the pods read it from the "
              f"image {args.image} (or fail); give a path under {mount} unless the image holds it", file=sys.stderr)
    return cfg, hw, train_args


def under(path: str, mount: str) -> bool:
    """path is the mount itself or inside it."""
    path, mount = os.path.normpath(path), os.path.normpath(mount)
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def env_sh(cfg, nodes: int, cache_dir: str) -> dict[str, str]:
    """The variables scripts/env.sh exports for this run, read by sourcing it (its own list,
    NANOTRN_ENV_VARS): SLURM and EKS share one source, nothing is copied here. With them the inputs
    of env.sh given here: launch.sh sources it again in the pod, where without them the seed went
    back to 0 and the extra compiler flags were dropped, under a manifest that stated both."""
    script = 'source "$1" >&2 && for v in "${NANOTRN_ENV_VARS[@]}"; do printf "%s\\0%s\\0" "$v" "${!v}"; done'
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "NNODES": str(nodes),
           "NANOTRN_PRECISION": cfg.optim.precision, "NANOTRN_INSTANCE": cfg.parallel.instance,
           "NEURON_CACHE_DIR": cache_dir}
    inputs = {k: os.environ[k] for k in ("NANOTRN_SR_SEED", "NEURON_CC_EXTRA_FLAGS") if k in os.environ}
    r = subprocess.run(["bash", "-c", script, "env.sh", str(HERE / "env.sh")], env={**env, **inputs},
                       capture_output=True, text=True)
    if r.returncode != 0:
        fail(f"scripts/env.sh refused: {r.stderr.strip().removeprefix('error: ')}")     # (its line's own prefix)
    words = r.stdout.split("\0")[:-1]
    return {**inputs, **dict(zip(words[::2], words[1::2]))}


# ----------------------------------------------------------------------------- the objects

def labels(args, job: str = "") -> dict:
    out = {"app.kubernetes.io/name": "nanotrn", "app.kubernetes.io/instance": args.name}
    return {**out, "app.kubernetes.io/component": job} if job else out


def service(args) -> dict:
    """Headless: no virtual IP, one DNS record per pod (<host name>.<service>). publishNotReadyAddresses,
    so that pod 0 resolves as soon as it runs, before any readiness (the rendezvous starts then)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": args.name, "namespace": args.namespace, "labels": labels(args)},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels(args),
                     "ports": [{"name": name, "port": port, "targetPort": port} for name, port in ports(args).items()]}}


def ports(args) -> dict[str, int]:
    """Pod 0's rendezvous ports: the run's (train or compile), and the compile Job's health check's.
    That check runs just before the compile step, on every pod at once: on one port, a pod done with
    it could start its compile agent while pod 0's health agent still serves the port, join that
    store, and fail when it closes a moment later (the Job then retries that pod; its health check
    waits for pods that are compiling)."""
    return {"rendezvous": args.port, "health": args.port + 1}


def command(args, mode: str, cfg, train_args: list[str]) -> list[str]:
    """The container's command. It ends in `exec`: bash is replaced by launch.sh, the container's
    main process, which receives the pod's SIGTERM. In train mode it passes it on to the workers as
    SIGUSR1, keeping torchrun (and its fixed 30 s) out of it: train.py stops at the next step
    boundary and saves, within --grace-period (docs/checkpoints.md: the budget). The other modes exec torchrun."""
    run = shlex.join(["scripts/launch.sh", mode, *train_args])
    if mode == "train":
        # Node-local health check on every (re)start: this instance's NeuronCores and its TP groups.
        # It must not wait for other pods: a restarted pod joins a run that is already training. The
        # cross-node check (EFA between node pairs) runs once, in the pre-compile Job.
        health = (f'torchrun --standalone --nproc_per_node="$NPROC_PER_NODE" scripts/healthcheck.py '
                  f'--tp={cfg.parallel.tp} --ranks-per-node="$NPROC_PER_NODE" $HEALTHCHECK_ARGS')
    else:           # on a port of its own (ports)
        health = f"MASTER_PORT={ports(args)['health']} " + shlex.join(["scripts/launch.sh", "health", *train_args])
    return ["bash", "-c", f"set -e\n{health}\nexec {run}\n"]


def job(args, mode: str, cfg, hw, train_args: list[str], neuron_env: dict) -> dict:
    name = f"{args.name}-{mode}"
    multi = args.nodes > 1
    # Launch inputs of launch.sh (no NODE_RANK: torchrun's c10d rendezvous on pod 0, so that the
    # agents of surviving pods re-form the group with a restarted one), then env.sh's variables.
    env = {"NNODES": str(args.nodes), "NPROC_PER_NODE": str(hw.cores),
           "MASTER_ADDR": f"{name}-0.{args.name}", "MASTER_PORT": str(args.port), "RUN_ID": name,
           "MAX_RESTARTS": str(args.max_restarts), "NEURON_CACHE_DIR": args.cache_dir, **neuron_env}
    if multi:       # the Neuron runtime's collectives bootstrap on the pod's own interface, as AWS's
        # Trainium manifests of its EKS tests set it (aws-k8s-tester, test/cases/neuron/manifests/
        # multi-node-test-neuron.yaml, test/cases/neuron-training/manifests/bert-training.yaml). Not in
        # env.sh: a SLURM node's interface has another name.
        env["CCOM_SOCKET_IFNAME"] = "eth0"
    # Neuron device plugin: aws.amazon.com/neuron = whole Trainium devices, all of the instance
    # (Neuron docs, "Kubernetes environment setup for Neuron"; llama3_train.yaml-template). EFA only
    # between nodes, as env.sh sets FI_PROVIDER=efa only then (EFA device plugin: vpc.amazonaws.com/efa),
    # every interface of the node (more: never scheduled; fewer: less bandwidth): 8 on trn1.32xlarge,
    # 16 on trn1n (Neuron docs, "How to prepare trn1.32xlarge for multi-node execution"), 16 on
    # trn2.48xlarge (network cards 0-15 of AWS's trn2 node group: aws-neuron-eks-samples,
    # dp_bert_hf_pretrain/cfn/eks_trn2_ng_stack_al2023.yaml; its 16 Trainium2 chips each on a 200 Gbps EFA
    # interface: aws-neuron-sdk neuron-runtime/about/collectives.rst). No hugepages-2Mi, as in those manifests: with
    # env.sh's FI_EFA_FORK_SAFE=1 libfabric keeps its EFA bounce buffers out of huge pages.
    resources = {"aws.amazon.com/neuron": hw.devices, **({"vpc.amazonaws.com/efa": hw.efa} if multi else {})}
    container = {
        "name": CONTAINER, "image": args.image, "workingDir": WORKDIR,
        "command": command(args, mode, cfg, train_args),
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "resources": {"requests": resources, "limits": resources},
        "ports": [{"name": name, "containerPort": port} for name, port in ports(args).items()],
        "volumeMounts": [{"name": "fsx", "mountPath": args.mount},
                         {"name": "shm", "mountPath": "/dev/shm"},
                         {"name": "neuron-cache", "mountPath": args.cache_dir}],
    }
    pod = {
        "subdomain": args.name,                     # + the Job's host name <job>-<index>: the DNS name
        "restartPolicy": "Never",                   # a failed pod is replaced (podFailurePolicy below)
        "terminationGracePeriodSeconds": args.grace_period,
        # The pause container is PID 1 and reaps orphans; launch.sh (exec'd by the command) stays the
        # container's main process, which gets the kubelet's SIGTERM.
        "shareProcessNamespace": True,
        # The rendezvous ports and the Neuron runtime's bootstrap port (launch.sh reserves them with sudo
        # on SLURM nodes): a safe, per-pod sysctl here (Kubernetes >= 1.27), so no ephemeral port takes them.
        "securityContext": {"sysctls": [{"name": "net.ipv4.ip_local_reserved_ports",
                                         "value": ",".join(map(str, [*ports(args).values(), RUNTIME_PORT]))}]},
        "nodeSelector": {"node.kubernetes.io/instance-type": hw.name},
        "tolerations": [{"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"}],
        # One pod per instance: no two pods of this run (train or compile) share a node.
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": labels(args)}, "topologyKey": "kubernetes.io/hostname"}]}},
        "containers": [container],
        "volumes": [
            {"name": "fsx", "persistentVolumeClaim": {"claimName": args.fsx_claim}},
            # A container's /dev/shm is 64 MB (Docker's, containerd's): torch's shared tensors and
            # multiprocessing use it (nanotrn's own loader is a thread: nothing there, docs/data.md).
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": args.shm}},
            # The node's own disk, kept across pods: the compile Job fills it, the training Job reads it.
            {"name": "neuron-cache", "hostPath": {"path": args.cache_dir, "type": "DirectoryOrCreate"}}],
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": args.namespace, "labels": labels(args, mode)},
        "spec": {
            "completionMode": "Indexed", "completions": args.nodes, "parallelism": args.nodes,
            # Each pod (index) is replaced up to --max-restarts times; one index out of retries fails
            # the Job. A failure of pod 0 (the rendezvous host) ends every agent: each index uses one.
            "backoffLimitPerIndex": args.max_restarts, "maxFailedIndexes": 0,
            "podReplacementPolicy": "Failed",      # the replacement starts once the old pod is gone
            "podFailurePolicy": {"rules": [
                {"action": "FailJob",                # a bad configuration: no retry can help
                 "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [CONFIG_ERROR]}},
                {"action": "Ignore",                 # drained, preempted, evicted: not the run's fault
                 "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
            "template": {"metadata": {"labels": labels(args, mode)}, "spec": pod},
        },
    }


def manifests(args, mode: str, cfg, hw, train_args: list[str], neuron_env: dict) -> list[dict]:
    return [service(args), job(args, mode, cfg, hw, train_args, neuron_env)]


# ----------------------------------------------------------------------------- YAML

def to_yaml(obj, indent: int = 0) -> str:
    """Block-style YAML; scalars as JSON (a subset of YAML), multi-line strings as literal blocks."""
    pad = " " * indent
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        lines = []
        for k, v in obj.items():
            key = json.dumps(k) if not k.replace("-", "").replace(".", "").replace("/", "").isalnum() else k
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{key}:\n{to_yaml(v, indent + 2)}")
            else:
                lines.append(f"{pad}{key}: {scalar(v, indent + 2)}")
        return "\n".join(lines)
    if isinstance(obj, list):
        if not obj:
            return "[]"
        lines = []
        for v in obj:
            body = to_yaml(v, indent + 2) if isinstance(v, (dict, list)) and v else scalar(v, indent + 2)
            lines.append(f"{pad}- {body.lstrip() if isinstance(v, (dict, list)) else body}")
        return "\n".join(lines)
    return scalar(obj, indent)


def scalar(v, indent: int) -> str:
    if isinstance(v, (dict, list)):
        return "{}" if isinstance(v, dict) else "[]"
    if isinstance(v, str) and "\n" in v and v.endswith("\n") and not any(
            line != line.rstrip() or line.startswith(" ") for line in v.splitlines()):
        return "|\n" + "".join(" " * indent + line + "\n" if line else "\n" for line in v.splitlines()).rstrip("\n")
    return json.dumps(v)


def dump(objs: list[dict]) -> str:
    return "".join(f"---\n{to_yaml(o)}\n" for o in objs)


def main(argv: list[str]) -> None:
    args, train_args = parse(argv)
    cfg, hw, train_args = check(args, train_args)
    neuron_env = env_sh(cfg, args.nodes, args.cache_dir)
    docs = {mode: dump(manifests(args, mode, cfg, hw, train_args, neuron_env)) for mode in ("compile", "train")}
    if not args.out:
        try:
            sys.stdout.write(docs[args.job])
            sys.stdout.flush()
        except BrokenPipeError:     # `| kubectl apply -f -` and kubectl left first: its message says why
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        return
    out = Path(args.out)
    paths = {mode: out / f"{args.name}-{mode}.yaml" for mode in docs}
    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file: give a directory")
    taken = [str(p) for p in paths.values() if p.exists()]
    if taken:
        fail(f"{', '.join(taken)} already exist: give another --out or --name (nothing was overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    for mode, text in docs.items():
        paths[mode].write_text(text)
    ns = "" if args.namespace == "default" else f" -n {args.namespace}"
    # Not `kubectl apply -f` of the folder: both Jobs at once split the nodes between them (one pod per
    # node for the run's pods of either Job) and each waits for pods that cannot be scheduled.
    print(f"wrote {paths['compile']} and {paths['train']} ({args.nodes} x {hw.name}): apply the first, "
          f"`kubectl wait{ns} --for=condition=complete --timeout=3h job/{args.name}-compile`, then the second")


if __name__ == "__main__":
    main(sys.argv[1:])
