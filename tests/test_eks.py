"""scripts/eks.py: the Kubernetes manifests of a run, and the pod contract they state.

Every generated object validates against the official Kubernetes 1.31 schema (kubernetes-validate
ships the schemas: nothing is fetched); resources, volumes, grace period, environment and commands
are checked against the planner's instance table and against what scripts/launch.sh itself does
with scripts/env.sh. The pod contract really runs: two "pods" are two local process trees running
the container command of the generated manifest, exactly, with the cluster's parts replaced by
local ones (the Service name resolves to 127.0.0.1, the hostPath is a temporary folder, CPU/gloo
instead of NeuronCores: --device=cpu, one rank per pod, a gloo health check).
"""
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(SCRIPTS))

import configs  # noqa: E402
import eks  # noqa: E402
from gloo_spawn import free_ports, run_train  # noqa: E402
from test_scripts import ARGS_7B, parse_dry_run, run_script  # noqa: E402

BASE = ["--image", "ecr.example/nanotrn:1", "--fsx-claim", "fsx-claim"]


def generate(tmp_path, *args, nodes=1, name="nanotrn") -> dict[str, list[dict]]:
    """eks.py --out DIR: {"compile": [objects], "train": [objects]}; stdout must equal the train file."""
    out = tmp_path / f"m{nodes}-{name}-{len(args)}"
    argv = [sys.executable, str(SCRIPTS / "eks.py"), f"--nodes={nodes}", "--name", name, *BASE, *args]
    r = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    stdout = subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout
    assert stdout == (out / f"{name}-train.yaml").read_text()
    return {m: list(yaml.safe_load_all((out / f"{name}-{m}.yaml").read_text())) for m in ("compile", "train")}


def container_env(job: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("instance", ["trn1", "trn2"])
@pytest.mark.parametrize("nodes", [1, 128])
def test_manifests_are_valid_kubernetes_and_say_what_launch_sh_does(tmp_path, instance, nodes):
    import kubernetes_validate
    hw = configs.INSTANCES[instance]
    docs = generate(tmp_path, *ARGS_7B, "--instance", instance, nodes=nodes)
    for mode, objs in docs.items():
        assert [o["kind"] for o in objs] == ["Service", "Job"]
        for o in objs:          # strict: an unknown or misspelt field fails too
            assert kubernetes_validate.validate(o, "1.31", strict=True) == "1.31"
        svc, job = objs
        spec, pod = job["spec"], job["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert job["metadata"]["name"] == f"nanotrn-{mode}" and ("compile" in job["metadata"]["name"]) == (mode == "compile")
        # The headless Service gives pod i the name <job>-i.<service>, pod 0 the rendezvous.
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
        assert pod["subdomain"] == svc["metadata"]["name"]
        env = container_env(job)
        assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
        assert env["MASTER_PORT"] == str(svc["spec"]["ports"][0]["port"]) == "29500"
        # One pod per instance, all of it: every Neuron device, every EFA interface between nodes.
        assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nodes
        assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": hw.name}
        anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert anti["labelSelector"]["matchLabels"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
        want = {"aws.amazon.com/neuron": hw.devices, **({"vpc.amazonaws.com/efa": hw.efa} if nodes > 1 else {})}
        assert c["resources"] == {"requests": want, "limits": want}
        assert env["NPROC_PER_NODE"] == str(hw.cores) and env["NNODES"] == str(nodes)
        # Volumes: FSx for the run's outputs, memory-backed /dev/shm, the compile cache on the node.
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert vols["fsx"]["persistentVolumeClaim"] == {"claimName": "fsx-claim"} and mounts["fsx"] == "/fsx"
        assert vols["shm"]["emptyDir"]["medium"] == "Memory" and mounts["shm"] == "/dev/shm"
        assert vols["neuron-cache"]["hostPath"]["path"] == mounts["neuron-cache"] == env["NEURON_CACHE_DIR"]
        assert f"--cache_dir={env['NEURON_CACHE_DIR']}" in env["NEURON_CC_FLAGS"].split()
        # Restarts: a failed pod is replaced (per index), a config error is not retried, drains don't count.
        assert pod["restartPolicy"] == "Never" and spec["backoffLimitPerIndex"] == 3
        rules = spec["podFailurePolicy"]["rules"]
        assert rules[0]["action"] == "FailJob" and rules[0]["onExitCodes"]["values"] == [2]
        assert rules[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
        # The grace period covers torchrun's 30 s between its SIGTERM to the workers and its SIGKILL.
        assert pod["terminationGracePeriodSeconds"] >= 35
        # The command: a health check, then exec launch.sh, so that torchrun gets the pod's SIGTERM.
        assert c["command"][:2] == ["bash", "-c"]
        lines = c["command"][2].strip().splitlines()
        assert lines[0] == "set -e" and lines[-1].startswith(f"exec scripts/launch.sh {mode} ")
        launch = shlex.split(lines[-1])[1:]
        assert launch[2:2 + len(ARGS_7B)] == ARGS_7B and "--out_dir=/fsx/nanotrn" in launch
        if mode == "train":     # node-local: a restarted pod cannot wait for pods that are training
            assert "torchrun --standalone" in lines[1] and "scripts/healthcheck.py --tp=8" in lines[1]
        else:                   # the run's own check, node pairs over EFA included
            assert shlex.split(lines[1]) == ["scripts/launch.sh", "health", *launch[2:]]
        # What launch.sh does with this environment (it sources env.sh again in the pod): the
        # manifest states env.sh's variables exactly, and torchrun's c10d rendezvous on pod 0.
        r = run_script([SCRIPTS / "launch.sh", *launch[1:]], DRY_RUN="1",
                       **{k: v for k, v in env.items() if k in ("NNODES", "MASTER_ADDR", "MASTER_PORT", "RUN_ID",
                                                                "MAX_RESTARTS", "NEURON_CACHE_DIR", "NPROC_PER_NODE")})
        assert r.returncode == 0, r.stderr
        exported, cmds, _ = parse_dry_run(r.stdout)
        assert exported and all(env[k] == v for k, v in exported.items()), (exported, env)
        assert ("FI_PROVIDER" in env) == (nodes > 1) and ("NEURON_LOGICAL_NC_CONFIG" in env) == (instance == "trn2")
        torchrun = cmds[0][1:] if mode == "compile" else cmds[0]
        assert torchrun[:3] == ["torchrun", f"--nproc_per_node={hw.cores}", f"--nnodes={nodes}"]
        if nodes > 1:
            assert f"--rdzv-endpoint={env['MASTER_ADDR']}:29500" in torchrun and "--rdzv-backend=c10d" in torchrun
            assert ("--max-restarts=3" in torchrun) == (mode == "train")


def test_bad_flags_are_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "nanotrn-train.yaml").write_text("mine\n")
    cases = [
        (["--nodes=0", *ARGS_7B], "--nodes 0"),
        (["--nodes=2", "--preset", "llama9_7b"], "unknown preset 'llama9_7b'"),
        (["--nodes=2", *ARGS_7B, "--tp=7"], "tp 7"),
        (["--nodes=2", *ARGS_7B, "--tp=64"], "--tp 64 does not divide the 32 NeuronCores of a trn1.32xlarge"),
        (["--nodes=2", "--preset", "llama2_70b", "--tp=64"], "use a TP of 1, 2, 4, 8, 16, 32"),   # heads would allow it
        (["--nodes=2", *ARGS_7B, "--out_dir=out"], "--out_dir=out is not on the FSx mount /fsx"),
        (["--nodes=2", *ARGS_7B, "--cache-dir=/fsx/neuron-cache"], "not on FSx"),
        (["--nodes=2", *ARGS_7B, "--grace-period=30"], "--grace-period 30"),
        (["--nodes=2", *ARGS_7B, "--name=Big_Run"], "not a Kubernetes name"),
    ]
    for args, message in cases:
        r = subprocess.run([sys.executable, str(SCRIPTS / "eks.py"), *BASE, *args, "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "Traceback" not in r.stderr, (args, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert not out.exists() and r.stdout == ""
    r = subprocess.run([sys.executable, str(SCRIPTS / "eks.py"), "--nodes=2", *BASE, *ARGS_7B, "--out",
                        str(tmp_path / "held")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "already exist" in r.stderr
    assert (tmp_path / "held" / "nanotrn-train.yaml").read_text() == "mine\n"       # never overwritten


def test_dockerfile_is_the_release_env_sh_pins():
    env_sh = (SCRIPTS / "env.sh").read_text()
    sdk = re.search(r"^NANOTRN_NEURON_SDK=(\S+)$", env_sh, re.M).group(1)
    torch_neuronx = re.search(r"^NANOTRN_TORCH_NEURONX=(\S+)$", env_sh, re.M).group(1)
    assert f"Neuron {sdk.rsplit('.', 1)[0]} DLAMI (torch-neuronx {torch_neuronx}" in env_sh   # the header says so too
    docker = (ROOT / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)$", docker, re.M)
    repo, tag = base.rsplit(":", 1)
    assert repo.endswith("/pytorch-training-neuronx")
    assert tag.startswith(torch_neuronx.rsplit(".", 2)[0] + "-neuronx-") and f"-sdk{sdk}-" in tag, tag
    assert re.search(r"^WORKDIR (\S+)$", docker, re.M).group(1) == eks.WORKDIR     # the pods' workingDir
    assert "-r requirements.txt" in docker and "-r requirements-torch.txt" not in docker   # the image's torch stays
