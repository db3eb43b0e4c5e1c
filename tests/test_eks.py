"""scripts/eks.py: the Kubernetes manifests of a run, and the pod contract they state.

Every generated object validates against the official Kubernetes 1.31 schema (kubernetes-validate
ships the schemas: nothing is fetched); resources, volumes, grace period, environment and commands
are checked against the planner's instance table and against what scripts/launch.sh itself does
with scripts/env.sh. The pod contract really runs: two "pods" are two local process trees running
the container command of the generated manifest, exactly, with the cluster's parts replaced by
local ones (the Service name resolves to 127.0.0.1, the hostPath is a temporary folder, CPU/gloo
instead of NeuronCores: --device=cpu, one rank per pod, a gloo health check).
"""
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
from planner import instances  # noqa: E402
from conftest import cache_arg, help_flags  # noqa: E402
from gloo_spawn import free_ports, run_train  # noqa: E402
from test_scripts import ARGS_7B, parse_dry_run, run_script  # noqa: E402

BASE = ["--image", "ecr.example/nanotrn:1", "--fsx-claim", "fsx-claim"]


def generate(tmp_path, *args, nodes=1, name="nanotrn") -> dict[str, list[dict]]:
    """eks.py --out DIR: {"compile": [objects], "train": [objects]}; stdout must equal the train file."""
    out = tmp_path / f"m{nodes}-{name}-{len(args)}"
    argv = [sys.executable, str(SCRIPTS / "eks.py"), f"--nodes={nodes}", "--name", name, *BASE, *args]
    r = subprocess.run([*argv, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # The order to apply them in: both Jobs at once would split the nodes (anti-affinity) and wait.
    assert f"apply the first, `kubectl wait --for=condition=complete --timeout=3h job/{name}-compile`, then" in r.stdout
    stdout = subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout
    assert stdout == (out / f"{name}-train.yaml").read_text()
    return {m: list(yaml.safe_load_all((out / f"{name}-{m}.yaml").read_text())) for m in ("compile", "train")}


def container_env(job: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_the_docs_128_node_commands_write_the_blog128_run_not_the_1_node_runs_folder(tmp_path):
    """docs/eks.md: 1 node first, 'then 128 nodes: the same three commands with --nodes 128 --name blog128
    (out_dir /fsx/blog128)'. Its `--out manifests/` line for 128 nodes had no --name: copied, its Jobs were
    nanotrn-* and its run /fsx/nanotrn, the 1-node trial's, which it resumed at 128 nodes. Each eks.py command of
    the page, with the page's $K and $ARGS, through eks.py's own parser and checks."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "docs" / "eks.md").read_text(), re.S).group(1)
    sets = dict(re.findall(r'^(ARGS|K)="(.*)"$', block, re.M))
    runs = {}
    for line in re.findall(r"^python scripts/eks.py (.*?)(?:\s+\||\s+#|$)", block, re.M):
        line = line.replace("$K", sets["K"]).replace("$ARGS", sets["ARGS"]).replace("$ECR", "ecr.example")
        args, train_args = eks.parse(shlex.split(line.replace("--out manifests/", f"--out {tmp_path}/m")))
        cfg = eks.check(args, train_args)[0]
        runs.setdefault(args.nodes, set()).add((args.name, cfg.out_dir))
    assert runs == {1: {("nanotrn", "/fsx/nanotrn")}, 128: {("blog128", "/fsx/blog128")}}, runs


@pytest.mark.parametrize("instance", ["trn1", "trn2"])
@pytest.mark.parametrize("nodes", [1, 128])
def test_manifests_are_valid_kubernetes_and_say_what_launch_sh_does(tmp_path, instance, nodes):
    import kubernetes_validate
    hw = instances.INSTANCES[instance]
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
        # The command: a health check, then exec launch.sh, so that launch.sh gets the pod's SIGTERM.
        assert c["command"][:2] == ["bash", "-c"]
        lines = c["command"][2].strip().splitlines()
        assert lines[0] == "set -e" and lines[-1].startswith(f"exec scripts/launch.sh {mode} ")
        launch = shlex.split(lines[-1])[1:]
        assert launch[2:2 + len(ARGS_7B)] == ARGS_7B and "--out_dir=/fsx/nanotrn" in launch
        if mode == "train":     # node-local: a restarted pod cannot wait for pods that are training
            assert "torchrun --standalone" in lines[1] and "scripts/healthcheck.py --tp=8" in lines[1]
        else:                   # the run's own check, node pairs over EFA included, on the next port
            assert shlex.split(lines[1]) == ["MASTER_PORT=29501", "scripts/launch.sh", "health", *launch[2:]]
        assert [p["port"] for p in svc["spec"]["ports"]] == [p["containerPort"] for p in c["ports"]] == [29500, 29501]
        assert pod["securityContext"]["sysctls"] == [{"name": "net.ipv4.ip_local_reserved_ports",
                                                      "value": "29500,29501,62182"}]
        # What launch.sh does with this environment (it sources env.sh again in the pod): the
        # manifest states env.sh's variables exactly, and torchrun's c10d rendezvous on pod 0.
        inputs = {k: v for k, v in env.items() if k in ("NNODES", "MASTER_ADDR", "MASTER_PORT", "RUN_ID",
                                                        "MAX_RESTARTS", "NEURON_CACHE_DIR", "NPROC_PER_NODE")}
        dry = lambda argv, **more: parse_dry_run(run_script([SCRIPTS / "launch.sh", *argv], DRY_RUN="1",  # noqa: E731
                                                            **{**inputs, **more}).stdout)
        r = run_script([SCRIPTS / "launch.sh", *launch[1:]], DRY_RUN="1", **inputs)
        assert r.returncode == 0, r.stderr
        exported, cmds, _ = parse_dry_run(r.stdout)
        assert exported and all(env[k] == v for k, v in exported.items()), (exported, env)
        assert ("FI_PROVIDER" in env) == (nodes > 1) and ("NEURON_LOGICAL_NC_CONFIG" in env) == (instance == "trn2")
        assert env.get("CCOM_SOCKET_IFNAME") == ("eth0" if nodes > 1 else None)      # AWS's EKS manifests
        torchrun = cmds[0][1:] if mode == "compile" else cmds[0]
        assert torchrun[:3] == ["torchrun", f"--nproc_per_node={hw.cores}", f"--nnodes={nodes}"]
        if nodes > 1:
            assert f"--rdzv-endpoint={env['MASTER_ADDR']}:29500" in torchrun and "--rdzv-backend=c10d" in torchrun
            assert ("--max-restarts=3" in torchrun) == (mode == "train")
            # Pod 0 (the Job's completion index) hosts the rendezvous store; no pod guesses it from DNS,
            # and the others wait for it (pod 0's replacement) as long as for any node to join.
            for index, host in (("0", "1"), ("1", "0"), (str(nodes - 1), "0")):
                (got,) = dry(launch[1:], JOB_COMPLETION_INDEX=index)[1]
                assert [a for a in (got[1:] if mode == "compile" else got) if a.startswith("--rdzv")] == \
                    [a for a in torchrun if a.startswith("--rdzv")] + [f"--rdzv-conf=is_host={host},read_timeout=600"]
            if mode == "compile":   # the health step's rendezvous is not the compile step's (a pod done
                # with one could join pod 0's store of the other as it closes)
                (health,) = dry(shlex.split(lines[1])[2:], MASTER_PORT="29501")[1]
                assert f"--rdzv-endpoint={env['MASTER_ADDR']}:29501" in health and "--rdzv-id=nanotrn-compile-health" in health


def test_bad_flags_are_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "out"
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "nanotrn-train.yaml").write_text("mine\n")
    with pytest.raises(configs.ConfigError) as e:       # one owner of "TP inside an instance": the planner
        instances.check_instances(configs.from_args([*ARGS_7B, "--tp=64"]), 2 * 32)
    planner_says = str(e.value)
    cases = [
        (["--nodes=0", *ARGS_7B], "--nodes 0"),
        (["--nodes=2", "--preset", "llama9_7b"], "unknown preset 'llama9_7b'"),
        (["--nodes=2", *ARGS_7B, "--tp=7"], "tp=7"),
        (["--nodes=2", *ARGS_7B, "--tp=64"], "--parallel.tp=64 does not divide the 32 NeuronCores of a trn1.32xlarge"),
        (["--nodes=2", *ARGS_7B, "--tp=64"], planner_says),        # the planner's rule, in its words
        (["--nodes=2", "--preset", "llama2_70b", "--tp=64"], "pick --parallel.tp from 1, 2, 4, 8, 16, 32"),  # heads allow 64
        (["--nodes=2", *ARGS_7B, "--out_dir=out"], "--out_dir=out is not on the FSx mount /fsx"),
        (["--nodes=2", *ARGS_7B, "--cache-dir=/fsx/neuron-cache"], "not on FSx"),
        (["--nodes=2", *ARGS_7B, "--grace-period=5"], "--grace-period 5: the final save's budget"),
        (["--nodes=2", *ARGS_7B, f"--grace-period={10**20}"], f"--grace-period {10**20}: give at most 1000000000 s"),
        (["--nodes=2", *ARGS_7B, "--port=65535"], "--port 65535"),         # its next one: the health check's
        (["--nodes=2", *ARGS_7B, "--name=Big_Run"], "not a Kubernetes name"),
        (["--nodes=2", *ARGS_7B, "--cache-dir=/dev/shm"], "--cache-dir '/dev/shm' overlaps /dev/shm"),
        (["--nodes=2", *ARGS_7B, "--shm=0.0Gi"], "--shm '0.0Gi': give at least 64Mi"),
        (["--nodes=2", *ARGS_7B, "--mount=/opt"], "--mount '/opt' overlaps /opt/nanotrn"),      # hides the code
        (["--nodes=2", *ARGS_7B, "--cache-dir=/opt/nanotrn/cache"], "overlaps /opt/nanotrn"),
    ]
    for args, message in cases:
        r = subprocess.run([sys.executable, str(SCRIPTS / "eks.py"), *BASE, *args, "--out", str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "Traceback" not in r.stderr, (args, r.stderr)
        assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert not out.exists() and r.stdout == ""
    # In a pod (an image older or newer than the generator), launch.sh refuses a bad configuration
    # with the status that the Job's podFailurePolicy fails at once, instead of retrying it per pod.
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B, "--tp=7"], NNODES="2", MASTER_ADDR="x", DRY_RUN="1")
    assert r.returncode == eks.CONFIG_ERROR and "config error: " in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, str(SCRIPTS / "eks.py"), "--nodes=2", *BASE, *ARGS_7B, "--out",
                        str(tmp_path / "held")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "already exist" in r.stderr
    assert (tmp_path / "held" / "nanotrn-train.yaml").read_text() == "mine\n"       # never overwritten



def test_an_input_env_sh_refuses_is_one_line_with_one_error_prefix():
    # env.sh's own line already starts 'error: ': eks.py said 'error: scripts/env.sh refused: error: NANOTRN_SR_SEED=x'
    r = subprocess.run([sys.executable, str(SCRIPTS / "eks.py"), "--nodes=2", *BASE, *ARGS_7B], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "NANOTRN_SR_SEED": "x"})
    assert r.returncode != 0 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: scripts/env.sh refused: NANOTRN_SR_SEED=x: give a whole number"), r.stderr


def test_help_says_every_flag_and_its_default(capsys):
    # `eks.py --help` gave --namespace no help and no flag its default (--mount /fsx, --grace-period 60, ...)
    with pytest.raises(SystemExit) as e:
        eks.parse(["--help"])
    said = help_flags(capsys.readouterr().out)
    assert e.value.code == 0 and len(said) >= 14, said
    for flag, text in said.items():
        assert text, f"{flag} has no help"
        if flag not in ("-h", "--nodes", "--image", "--fsx-claim", "--out"):      # required, or no default to give
            assert text.count("(default: ") == 1, f"{flag}: {text}"

def test_the_mount_itself_is_on_fsx(tmp_path):
    """--cache-dir=/fsx is the shared file system (and a second volume at the FSx mount's path,
    which the API server rejects): refused; --out_dir=/fsx is on it: accepted (was the reverse,
    with 'is not on the FSx mount /fsx'); --out_dir=/fsx2/run is not."""
    r = subprocess.run([sys.executable, str(SCRIPTS / "eks.py"), "--nodes=2", *BASE, *ARGS_7B, "--cache-dir=/fsx/"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stdout == "" and "not on FSx" in r.stderr, r.stderr
    (_, job) = generate(tmp_path, *ARGS_7B, "--out_dir=/fsx", nodes=2)["train"]
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert "--out_dir=/fsx" in c["command"][2]
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert len(set(mounts)) == len(mounts)
    # a path that only begins with the mount's name is off it (a pod's disk: gone with the pod)
    with pytest.raises(SystemExit) as e:
        eks.main(["--nodes=2", *BASE, *ARGS_7B, "--out_dir=/fsx2/run"])
    assert "--out_dir=/fsx2/run is not on the FSx mount /fsx" in str(e.value.code), e.value.code


def test_inputs_off_the_fsx_mount_are_said_in_one_line():
    """--data, --tokenizer, --init_from at an absolute path off the FSx mount: the pods see that path
    only if the image holds it (else every pod fails at start, and is retried), so one warning line
    names them; the manifests are still written. On the mount, or relative (the image's): silent."""
    run = lambda *a: subprocess.run([sys.executable, str(SCRIPTS / "eks.py"), "--nodes=2", *BASE, "--preset=llama2_7b", *a],
                                    capture_output=True, text=True, timeout=120)
    r = run("--data=/home/me/a.arrow:0.7,/fsx/b.arrow:0.3", "--tokenizer=/home/me/tok.model", "--init_from=/models/l2")
    assert r.returncode == 0 and "kind: \"Job\"" in r.stdout and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("warning: ") and "/fsx/b.arrow" not in r.stderr
    assert all(p in r.stderr for p in ("--data /home/me/a.arrow", "--tokenizer /home/me/tok.model",
                                       "--init_from /models/l2", "under /fsx")), r.stderr
    r = run("--data=/fsx/a.arrow,data/b.arrow", "--tokenizer=/fsx/tok.model")
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_the_pods_grace_period_is_the_final_saves_budget(tmp_path):
    """terminationGracePeriodSeconds is what checkpoint.stop_budget may spend (--ckpt.grace_s): a
    longer --grace-period must reach train.py (else it skips a final save the pod has time for) and a
    --ckpt.grace_s beyond the pod's would start a save the kubelet kills half-written."""
    for i, (args, budget) in enumerate((([], 60 - eks.STOP_MARGIN_S), (["--grace-period=300"], 300 - eks.STOP_MARGIN_S),
                         (["--grace-period=300", "--ckpt.grace_s=40"], 40),
                         # torchrun's 30 s is not in the way (launch.sh stops the workers itself): it was refused below 35
                         (["--grace-period=20"], 20 - eks.STOP_MARGIN_S))):
        docs = generate(tmp_path, *ARGS_7B, *args, nodes=2, name=f"run{i}")
        for mode, (_, job) in docs.items():
            pod = job["spec"]["template"]["spec"]
            launch = shlex.split(pod["containers"][0]["command"][2].strip().splitlines()[-1])
            assert launch[:3] == ["exec", "scripts/launch.sh", mode]
            assert configs.from_args(launch[3:]).ckpt.grace_s == budget, (args, launch)
            assert pod["terminationGracePeriodSeconds"] - budget >= eks.STOP_MARGIN_S
    r = subprocess.run([sys.executable, str(SCRIPTS / "eks.py"), "--nodes=2", *BASE, *ARGS_7B, "--ckpt.grace_s=100"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and r.stdout == "" and "Traceback" not in r.stderr
    assert "--ckpt.grace_s=100" in r.stderr and "--grace-period" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # inside the grace period but not its last STOP_MARGIN_S (the stop's own): refused too (in-process)
    with pytest.raises(SystemExit) as e:
        eks.main(["--nodes=2", *BASE, *ARGS_7B, f"--ckpt.grace_s={60 - eks.STOP_MARGIN_S + 2}"])
    assert (f"does not fit the pod's --grace-period 60 (minus {eks.STOP_MARGIN_S} s to stop): give --grace-period "
            f"{60 + 2} or more") in str(e.value.code), e.value.code


def test_the_pods_launch_exports_what_its_manifest_states(tmp_path):
    """env.sh's inputs given to eks.py (the stochastic-rounding seed, extra compiler flags) reach the run:
    launch.sh sources env.sh again in the pod, with exactly the container's environment. They were
    left out of it, so the manifest stated seed 7 and the flags while the run got seed 0 and none
    (the compile cache too: its graphs built without the flags)."""
    out = tmp_path / "m"
    given = {"NANOTRN_SR_SEED": "7", "NEURON_CC_EXTRA_FLAGS": "--verbose=35"}
    r = subprocess.run([sys.executable, str(SCRIPTS / "eks.py"), "--nodes=2", *BASE, *ARGS_7B, "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, **given})
    assert r.returncode == 0, r.stderr
    for mode in ("compile", "train"):
        job = list(yaml.safe_load_all((out / f"nanotrn-{mode}.yaml").read_text()))[1]
        env = container_env(job)
        assert env["NEURON_RT_STOCHASTIC_ROUNDING_SEED"] == "7" and "--verbose=35" in env["NEURON_CC_FLAGS"].split()
        launch = shlex.split(job["spec"]["template"]["spec"]["containers"][0]["command"][2].splitlines()[-1])
        assert launch[:3] == ["exec", "scripts/launch.sh", mode]
        # pod 1, with nothing but the pod's environment (run_script clears the rest)
        d = run_script([SCRIPTS / "launch.sh", *launch[2:]], DRY_RUN="1", JOB_COMPLETION_INDEX="1", **env)
        assert d.returncode == 0, d.stderr
        exported = parse_dry_run(d.stdout)[0]
        assert exported and {k: env.get(k) for k in exported} == exported, mode


def test_a_reader_that_leaves_is_no_traceback():
    """`python scripts/eks.py ... | kubectl apply -f -` where kubectl exits first (no cluster
    configured, a bad context): one failed status, no BrokenPipeError traceback."""
    p = subprocess.Popen([sys.executable, str(SCRIPTS / "eks.py"), "--nodes=2", *BASE, *ARGS_7B],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) != 0 and "Traceback" not in err and "BrokenPipeError" not in err, err


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


def test_the_image_build_stops_without_a_command_the_pods_run(tmp_path):
    """The Dockerfile's check of the commands the pods run outside bash, run as docker runs a RUN line
    (/bin/sh -c: dash on the Ubuntu base), with a PATH that holds them all, then lacks each in turn. It was
    `command -v torchrun neuron_parallel_compile`: dash answers for the first name alone, so an image
    without neuron_parallel_compile passed."""
    docker = (ROOT / "Dockerfile").read_text().replace("\\\n", "")
    (check,) = [line[len("RUN "):] for line in docker.splitlines() if line.startswith("RUN ") and "command -v" in line]
    needed = ["torchrun", "neuron_parallel_compile", "pkill", "pgrep"]
    launch = (SCRIPTS / "launch.sh").read_text()
    assert all(re.search(rf"\b{c}\b", launch) for c in needed)          # launch.sh runs each of them
    for missing in [None, *needed]:
        bin_dir = tmp_path / f"bin-{missing}"
        bin_dir.mkdir()
        for c in needed:
            if c != missing:        # only found, never run: an empty executable file is what command -v looks for
                (bin_dir / c).touch(mode=0o755)
        r = subprocess.run(["/bin/sh", "-c", check], env={"PATH": str(bin_dir)}, capture_output=True, text=True)
        assert (r.returncode == 0) == (missing is None), (missing, r.returncode, r.stdout, r.stderr)
        if missing:
            assert f"the image has no {missing} " in r.stdout


# ----------------------------------------------------------------------------- the pod contract, for real

TINY = ["--device=cpu", "--model.n_layers=2", "--model.dim=32", "--model.n_heads=4", "--model.n_kv_heads=2",
        "--model.ffn_dim=64", "--data.seq_len=32", "--model.max_seq_len=32", "--data.micro_batch=1",
        "--data.global_batch=64",     # valid for the manifest's 2 x 32 NeuronCores and for 2 CPU ranks here
        "--optim.warmup_steps=2", "--optim.decay_steps=10", "--optim.precision=fp32", "--log.interval=1",
        "--log.eval_interval=0", "--log.sample_tokens=0", "--log.tensorboard="]


class Pod:
    """One pod of the training Job: its container command, exactly as the manifest states it, as a
    process tree of its own. What the cluster provides is provided locally: the Service name of pod
    0 resolves to 127.0.0.1, the hostPath cache is a folder, and the Neuron parts are CPU ones (one
    gloo rank per pod instead of a NeuronCore each; the health check on gloo)."""

    def __init__(self, job: dict, index: int, local: dict):
        (c,) = job["spec"]["template"]["spec"]["containers"]
        self.job, self.index, self.local = job, index, local
        self.env = {**os.environ, **container_env(job), **local, "JOB_COMPLETION_INDEX": str(index),
                    "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHON": sys.executable,
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.lines: list[str] = []
        self.p = subprocess.Popen(c["command"], cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True).start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def tree(self) -> list[int]:
        """This pod's processes: its top process and every descendant (torchrun's workers run in
        sessions of their own, so a process group would miss them; a container's cgroup does not)."""
        parents = {}
        for d in Path("/proc").iterdir():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (ValueError, OSError, IndexError):
                continue
        tree, frontier = [self.p.pid], [self.p.pid]
        while frontier:
            frontier = [pid for pid, ppid in parents.items() if ppid in frontier and pid not in tree]
            tree += frontier
        return tree

    def kill(self):
        """What a node failure or an OOM kill does to a pod: every process of it dies at once."""
        for pid in self.tree():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.p.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pod in (self,):
                pod.kill()
            pytest.fail(f"pod {self.index} did not finish in {timeout:.0f} s:\n{self.out[-4000:]}")


def start_pods(job: dict, tmp: Path) -> list[Pod]:
    """Pod 0, then pod 1 once pod 0's torchrun hosts the rendezvous (its port answers)."""
    (port,) = free_ports(1)
    local = lambda i: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NPROC_PER_NODE": "1",  # noqa: E731
                       "NEURON_CACHE_DIR": str(tmp / f"node{i}-cache"),
                       "HEALTHCHECK_ARGS": "--backend=gloo --mb=0.25 --warmup=1 --reps=2",
                       # launch.sh's wait before it ends the torchrun of a pod drained alone (in its exit
                       # barrier, the other pod never comes): 10 s by default, 2 enough on one host
                       "STOP_LINGER_S": "2"}
    pods = [Pod(job, 0, local(0))]
    deadline = time.time() + 240
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if pods[0].p.poll() is not None or time.time() > deadline:
            pods[0].kill()
            pytest.fail(f"pod 0 never hosted the rendezvous:\n{pods[0].out[-4000:]}")
        time.sleep(0.5)
    pods.append(Pod(job, 1, local(1)))
    return pods


def wait_for(pods: list[Pod], pattern: str, timeout: float = 600):
    """Until a pod's output has a line matching pattern (the timeout only ends a run that hangs)."""
    deadline = time.time() + timeout
    while not any(re.search(pattern, p.out) for p in pods):
        if time.time() > deadline or any(p.p.poll() is not None for p in pods):
            for p in pods:
                p.kill()
            pytest.fail(f"no line {pattern!r}:\n" + "\n".join(p.out[-3000:] for p in pods))
        time.sleep(0.2)


def pod_job(tmp_path, name: str, *args) -> dict:
    docs = generate(tmp_path, *TINY, cache_arg(), *args, "--mount", str(tmp_path / name), nodes=2, name=name)
    return docs["train"][1]


@pytest.mark.slow
def test_pod_contract_sigterm_saves_a_killed_pod_rejoins_and_the_run_ends_bit_identical(tmp_path):
    """Two pods of the generated training Job (DP=2, one gloo rank each), as Kubernetes runs them.
    1. SIGTERM to pod 1's top process (what the kubelet sends on a drain): it is launch.sh (the
       command execs it), which passes it to torchrun's worker as SIGUSR1; both ranks stop at the
       same step and leave a complete checkpoint of it.
    2. The Job runs again (both pods): they resume from it. Pod 1 is killed after step 6, every
       process of it at once, and started again with the same command and environment, as the Job
       controller replaces a failed pod. (Its rank waits after step 6 in a barrier no other rank
       joins, NANOTRN_FAULT=hang:any:6, until the test kills it: a kill on seeing "step 6" could land
       after step 8 on a loaded host, and the run would end without it. 'any': the rendezvous orders
       the nodes by pid on one host, so after the pids wrap the replacement comes back as rank 0 (seen
       once: 'hang:1:6' then never fired). faults.log keeps the next replacement, same environment,
       from hanging again.) Pod 0's torchrun agent restarts its worker and waits in the rendezvous;
       the new pod 1 joins after its health check; both resume from the newest checkpoint and finish.
    The weights and optimizer state at step 8, and every logged loss, equal an uninterrupted run of
    the same layout (torchrun, DP=2) bit for bit."""
    from test_resume import full_optim, losses, stopped_step
    import reshard
    t0 = time.time()
    ref = {}
    reference = threading.Thread(target=lambda: ref.update(r=run_train(
        [*TINY, f"--out_dir={tmp_path}/ref", "--optim.max_steps=8", "--ckpt.interval=4"], nproc=2, timeout=600)))
    reference.start()                                    # meanwhile: it mostly waits on the pods' start-up
    job = pod_job(tmp_path, "pods", "--optim.max_steps=8", "--ckpt.interval=2")
    ckpt = tmp_path / "pods" / "pods" / "ckpt"
    log = lambda what: print(f"{time.time() - t0:5.1f} s: {what}")  # noqa: E731

    pods = start_pods(job, tmp_path)
    wait_for(pods, r"step\s+1 \|")     # 7 steps before the end: a margin, not a wait of the run
    pods[1].p.send_signal(signal.SIGTERM)
    log("SIGTERM to pod 1 at step 1")
    pods[1].wait(timeout=300)
    # Pod 0 did not get the signal: its worker saved (rank 0 completes the checkpoint: the manifest),
    # said so, exited 75, and its torchrun waits for the replacement instead of ending (exit 0 would
    # mark its index complete). Its line, not pod 1's end, says that its part is done.
    wait_for(pods[:1], r"SIGUSR1 reached another node: exit 75")
    assert "ending torchrun's wait for the other nodes" in pods[1].out, pods[1].out[-3000:]
    out = "".join(p.out for p in pods)
    stop = stopped_step(out, "SIGUSR1")       # launch.sh (the pod's first process) sends TERM on as USR1
    ls = subprocess.run([sys.executable, str(ROOT / "checkpoint.py"), "ls", str(ckpt)], capture_output=True,
                        text=True, timeout=120).stdout
    assert f"step_{stop:08d}  ok" in ls.splitlines(), (ls, out[-6000:])   # complete: every rank's files, verified
    assert pods[0].p.poll() is None, out[-6000:]
    log(f"pod 1 stopped, checkpoint of step {stop} complete")

    attempts = [pods[1]]
    pods[1] = Pod(job, 1, {**attempts[-1].local, "NANOTRN_FAULT": "hang:any:6"})   # the drained pod's replacement
    wait_for(pods[1:], r"NANOTRN_FAULT: rank \d hangs at step 6 ")   # the run cannot end before the kill
    pods[1].kill()
    log("pod 1 killed after step 6")
    attempts.append(pods[1])
    time.sleep(1)                                        # the replacement comes a moment later
    pods[1] = Pod(job, 1, attempts[-1].local)
    codes = [p.wait(timeout=600) for p in pods]
    attempts += pods
    out = "\n".join(p.out for p in pods)
    log("both pods done")
    assert codes == [0, 0], out[-6000:]
    # rank 0 (which says it) is on whichever pod the c10d rendezvous made it: count every attempt's output
    assert "\n".join(p.out for p in attempts).count("resuming from") >= 2 and "healthy" in pods[1].out

    reference.join()
    assert ref["r"].returncode == 0, ref["r"].stderr[-3000:]
    m = configs.from_args(TINY).model
    want, got = tmp_path / "ref" / "ckpt" / "step_00000008", ckpt / "step_00000008"
    a, b = reshard.full_model_state(want, m), reshard.full_model_state(got, m)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    a, b = full_optim(want), full_optim(got)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    run = {}
    for p in attempts:
        run.update(losses(p.out))
    assert run == losses(ref["r"].stdout) and len(run) == 8


def own_unrecognized_address() -> str:
    """An address of this host that torchrun's own guess does not take for this host (192.0.2.2 on the
    project's machines: not the host name's address), or ""."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))         # a route lookup: nothing is sent
            ip = s.getsockname()[0]
        except OSError:
            return ""
    return "" if ip.startswith("127.") or _matches_machine_hostname(ip) else ip


@pytest.mark.slow
def test_pod_0_hosts_the_rendezvous_before_its_name_resolves_to_it(tmp_path):
    """The compile Job's health step (the run's cross-pod check), exactly its line, in two local pods.
    A pod's DNS name resolves to it only once its record exists (and another pod's early miss may be
    cached), so torchrun's guess whether it hosts the rendezvous store can be 'no' on pod 0 too: then
    no agent hosts it and every pod fails after 60 s. Here MASTER_ADDR is an address of this host that
    the guess does not recognize, as pod 0's name before its record exists. Pod 0 hosts because its
    completion index says so, and both pods pass the check (they waited 60 s and failed before)."""
    ip = own_unrecognized_address()
    if not ip:
        pytest.skip("every address of this host is one torchrun recognizes: the guess cannot fail here")
    while True:                                             # the run's port and the next, the health check's
        (port,) = free_ports(1)
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port + 1)) != 0:
                break
    docs = generate(tmp_path, *TINY, cache_arg(), "--mount", str(tmp_path / "fsx"), f"--port={port}", nodes=2, name="hc")
    job = docs["compile"][1]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    health = c["command"][2].splitlines()[1]
    assert health.startswith(f"MASTER_PORT={port + 1} scripts/launch.sh health ")
    c["command"] = ["bash", "-c", f"set -e\n{health}\n"]      # the health step alone: no neuron_parallel_compile here
    local = lambda i: {"MASTER_ADDR": ip, "NPROC_PER_NODE": "1", "NEURON_CACHE_DIR": str(tmp_path / f"node{i}-cache"),  # noqa: E731
                       "HEALTHCHECK_ARGS": "--backend=gloo --mb=0.25 --warmup=1 --reps=2"}
    t0 = time.time()
    pods = [Pod(job, i, local(i)) for i in (1, 0)]          # pod 1 first: it looks pod 0 up before pod 0 hosts
    try:
        # Told by the status, not a time: without is_host both pods exit 1 after the store's 60 s. 240 s bounds
        # a hang only (50 s was the bound: 12 s here idle, 26-30 s at load 10, a loaded CI host could pass it).
        codes = [p.wait(timeout=240) for p in pods]
    finally:                                                # a failed run leaves no pod behind
        for p in pods:
            if p.p.poll() is None:
                p.kill()
    assert codes == [0, 0], "\n".join(p.out[-3000:] for p in pods)
    assert "healthy" in "".join(p.out for p in pods), "\n".join(p.out[-3000:] for p in pods)
    print(f"two pods passed the compile Job's health step in {time.time() - t0:.1f} s")
