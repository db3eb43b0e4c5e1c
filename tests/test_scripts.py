"""The trn1 launch scripts and the pre-flight health check.

The scripts are checked by bash -n, shellcheck and their dry-run output (nothing here can start
a Trainium job). The health check really runs: 4 gloo ranks under torchrun, one slowed on purpose.
"""
import contextlib
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
SHELL_SCRIPTS = sorted(SCRIPTS.glob("*.sh")) + sorted(SCRIPTS.glob("*.sbatch"))
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import configs  # noqa: E402
from conftest import cache_arg, help_flags  # noqa: E402
import healthcheck  # noqa: E402
from parallel import rank_groups  # noqa: E402

ARGS_7B = ["--preset", "llama2_7b", "--data", "/fsx/data/train.arrow", "--tokenizer", "/fsx/tok.model"]


def run_script(args, **env):
    """Run a script with a clean, explicit environment (no SLURM or Neuron variables leak in)."""
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHON": sys.executable}
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=60,
                          env={**base, **env}, cwd="/tmp")


def parse_dry_run(out: str):
    """-> (environment dict, [torchrun commands as argument lists], the other lines) of a dry run."""
    env, cmds, headers = {}, [], []
    for line in out.splitlines():
        if line.startswith(("ulimit ", "sudo ")):       # the node's setup before torchrun
            headers.append(line)
        elif line.startswith("export "):
            key, value = line[len("export "):].split("=", 1)
            env[key] = shlex.split(value)[0] if value else ""
        elif line.startswith("#"):
            headers.append(line)
        elif line.startswith(("cd ", "rm ")):
            headers.append(line)
        elif line.strip():
            cmds.append(shlex.split(line))
    return env, cmds, headers


def flat_config(argv) -> dict:
    """train.py's arguments -> {"optim.lr": 3e-4, ...}, through configs.from_args."""
    out = {}
    for section, values in configs.from_args(argv).to_dict().items():
        if isinstance(values, dict):
            out.update({f"{section}.{k}": v for k, v in values.items()})
        else:
            out[section] = values
    return out


def test_shell_syntax():
    assert len(SHELL_SCRIPTS) >= 3, SHELL_SCRIPTS
    for path in SHELL_SCRIPTS:
        r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert r.returncode == 0, f"{path.name}: {r.stderr}"


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed: apt-get update && apt-get install -y shellcheck")
def test_shellcheck():
    r = subprocess.run(["shellcheck", "-x", *map(str, SHELL_SCRIPTS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dry_run_7b_on_16_nodes():
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], DRY_RUN="1", NNODES="16",
                   MASTER_ADDR="trn-001", RUN_ID="job7")
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    env, cmds, headers = parse_dry_run(r.stdout)
    assert "16 node(s) x 32 ranks = 512 (trn1.32xlarge); tp=8 pp=1 dp=64; precision=bf16_sr" in headers[0]
    assert cmds == [["torchrun", "--nproc_per_node=32", "--nnodes=16", "--rdzv-backend=c10d",
                     "--rdzv-endpoint=trn-001:29500", "--rdzv-id=job7-train", "--max-restarts=3",
                     "train.py", *ARGS_7B]]
    flags = env["NEURON_CC_FLAGS"].split()
    assert flags[:2] == ["--model-type=transformer", "--distribution-strategy=llm-training"]
    assert "--cache_dir=/var/tmp/neuron-compile-cache" in flags      # local disk, not FSx
    # a compile cut short (torchrun restarting every node's workers, the time limit's USR1) is cached as failed and
    # skipped by every later run on that node unless this is set (Neuron docs, neuron-caching.rst): it was not
    assert "--retry_failed_compilation" in flags
    assert env["NEURON_COMPILE_CACHE_URL"] == "/var/tmp/neuron-compile-cache"
    assert env["PJRT_DEVICE"] == "NEURON"
    assert env["NEURON_FUSE_SOFTMAX"] == "1"
    assert env["NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS"] == "3"
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"             # the preset is bf16_sr
    assert env["MALLOC_ARENA_MAX"] == "64"
    assert env["XLA_DISABLE_FUNCTIONALIZATION"] == "0"                # pytorch/xla#8640, NxD 70B scripts
    assert (env["FI_PROVIDER"], env["FI_EFA_USE_DEVICE_RDMA"], env["FI_EFA_FORK_SAFE"]) == ("efa", "1", "1")


def test_dry_run_single_node_and_precision():
    r = run_script([SCRIPTS / "launch.sh", "--dry-run", "train", *ARGS_7B, "--precision=bf16"])
    assert r.returncode == 0, r.stderr
    env, cmds, headers = parse_dry_run(r.stdout)
    assert "1 node(s) x 32 ranks = 32 (trn1.32xlarge); tp=8 pp=1 dp=4" in headers[0]
    assert cmds[0][:5] == ["torchrun", "--nproc_per_node=32", "--nnodes=1", "--standalone", "--max-restarts=3"]
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "0"             # no SR without bf16_sr
    assert not any(k.startswith("FI_") for k in env)                    # EFA only between nodes


def test_sbatch_runs_health_compile_train_with_one_environment():
    r = run_script([SCRIPTS / "slurm_train.sbatch", *ARGS_7B], DRY_RUN="1", SLURM_JOB_NUM_NODES="16",
                   SLURM_JOB_NODELIST="trn[001-016]", SLURM_JOB_ID="42", SLURM_SUBMIT_DIR=str(ROOT),
                   MASTER_ADDR="trn001", NEURON_CACHE_DIR="/opt/local-nvme/neuron-cache")
    assert r.returncode == 0, r.stderr
    steps = r.stdout.split("# srun")[1:]
    assert len(steps) == 3
    parsed = [parse_dry_run(s.split("\n", 1)[1]) for s in steps]    # drop the srun line
    (henv, (health,), _), (cenv, (compile_,), cother), (tenv, (train,), _) = parsed
    assert "rm -rf" not in r.stdout                   # the compile pass writes nothing to clean up
    assert health[-3:] == ["scripts/healthcheck.py", "--tp=8", "--pp=1"]
    # the pre-compile pass is the same torchrun command under neuron_parallel_compile, with the
    # same Neuron environment (same flags, same local cache) so the real run hits its cache
    assert compile_[0] == "neuron_parallel_compile"
    assert compile_[1:4] == train[:3] and "train.py" in compile_
    i = compile_.index("train.py")
    assert compile_[i:i + 1 + len(ARGS_7B)] == ["train.py", *ARGS_7B]
    extra = compile_[i + 1 + len(ARGS_7B):]
    assert "--optim.max_steps=10" in extra and "--ckpt.interval=5" in extra
    assert "--ckpt.dir=out/precompile/ckpt" in extra                  # never the run's checkpoints
    assert cenv == tenv == henv
    # and everything that shapes a graph is the run's own: only these keys may differ
    ours, theirs = flat_config(compile_[i + 1:]), flat_config(train[train.index("train.py") + 1:])
    differ = {k for k in ours if ours[k] != theirs[k]}
    assert differ <= {"optim.max_steps", "log.eval_interval", "ckpt.interval", "log.interval", "ckpt.dir",
                      "out_dir", "log.tensorboard"}, differ
    assert "--cache_dir=/opt/local-nvme/neuron-cache" in tenv["NEURON_CC_FLAGS"]
    # static node ranks under SLURM: torchrun does not restart, the sbatch loop starts the step again
    assert "--node_rank=0" in train and "--max-restarts=0" in train and "--max-restarts=0" in compile_
    assert "for ((attempt = 0; attempt <= MAX_RESTARTS" in (SCRIPTS / "slurm_train.sbatch").read_text()


def test_sbatch_help_and_a_run_without_the_first_node_are_one_line():
    # `slurm_train.sbatch --help` printed bash's "line 33: SLURM_JOB_NUM_NODES: run this with sbatch" (exit 1); a
    # run by hand without SLURM_JOB_NODELIST or MASTER_ADDR bash's "SLURM_JOB_NODELIST: unbound variable", and
    # with it on a machine without scontrol "scontrol: command not found" (exit 127), naming no fix.
    sbatch = SCRIPTS / "slurm_train.sbatch"
    r = run_script([sbatch, "--help"])
    assert r.returncode == 0 and "sbatch --nodes=16 scripts/slurm_train.sbatch" in r.stdout, (r.stdout, r.stderr)
    assert shutil.which("scontrol", path=os.environ["PATH"]) is None      # (as on this test machine)
    for extra in ({}, {"SLURM_JOB_NODELIST": "trn[001-002]"}):
        r = run_script([sbatch, *ARGS_7B], DRY_RUN="1", SLURM_JOB_NUM_NODES="2", SLURM_SUBMIT_DIR=str(ROOT), **extra)
        assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
        assert r.stderr.startswith("error: MASTER_ADDR is unset") and r.stderr.count("\n") == 1, r.stderr


def test_sbatch_reads_max_restarts_before_any_step():
    # MAX_RESTARTS=08 ran the health check and the compile pass, then died on bash's 'value too great for base' in
    # the restart loop (exit 1, no training); MAX_RESTARTS=x was refused only by launch.sh, inside the first srun step.
    env = dict(DRY_RUN="1", SLURM_JOB_NUM_NODES="2", MASTER_ADDR="trn001", SLURM_SUBMIT_DIR=str(ROOT),
               NEURON_CACHE_DIR="/tmp/neuron-cache-test")
    r = run_script([SCRIPTS / "slurm_train.sbatch", *ARGS_7B], MAX_RESTARTS="08", **env)
    assert r.returncode == 0 and r.stdout.count("# srun") == 3 and r.stderr == "", r.stderr
    for bad in ("x", "-1"):
        r = run_script([SCRIPTS / "slurm_train.sbatch", *ARGS_7B], MAX_RESTARTS=bad, **env)
        assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
        assert r.stderr == f"error: MAX_RESTARTS={bad}: give a whole number >= 0 (restarts of the training step)\n"


def test_a_switch_that_is_neither_0_nor_1_is_refused_not_read_as_off(tmp_path):
    # DRY_RUN=true (or yes) was not 1, so launch.sh ran the real torchrun on the machine it was typed on: a user who
    # asked to print the commands started the job. slurm_train.sbatch's HEALTHCHECK=yes and PRECOMPILE=true skipped
    # the step they meant to ask for, without a word.
    fake = tmp_path / "torchrun"
    fake.write_text(f"#!/bin/bash\ntouch {tmp_path}/started\n")
    fake.chmod(0o755)
    for value in ("true", "yes"):
        r = run_script([SCRIPTS / "launch.sh", "train", "--preset", "tiny", "--dp", "2"], DRY_RUN=value,
                       TORCHRUN=str(fake), NPROC_PER_NODE="2", NEURON_CACHE_DIR=str(tmp_path / "cache"))
        assert r.returncode == 2 and not (tmp_path / "started").exists(), (r.stdout, r.stderr)
        assert r.stderr == f"error: DRY_RUN={value}: give 1 (print the commands, run nothing) or 0\n", r.stderr
    env = dict(SLURM_JOB_NUM_NODES="2", MASTER_ADDR="trn001", SLURM_SUBMIT_DIR=str(ROOT))
    for var in ("DRY_RUN", "HEALTHCHECK", "PRECOMPILE"):
        r = run_script([SCRIPTS / "slurm_train.sbatch", *ARGS_7B], **{"DRY_RUN": "1", **env, var: "yes"})
        assert r.returncode == 2 and r.stdout == "", (var, r.stdout, r.stderr)
        assert r.stderr.startswith(f"error: {var}=yes: give 1 or 0"), r.stderr


def test_sbatch_does_not_restart_a_step_that_failed_on_its_configuration(tmp_path):
    # launch.sh exits 2 for a configuration error (eks.py's podFailurePolicy fails the Job on it at once); the sbatch
    # loop started such a training step again MAX_RESTARTS times, each refused the same way on every node.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')   # one node
    (fake / "srun").chmod(0o755)
    r = run_script([SCRIPTS / "slurm_train.sbatch", *ARGS_7B, "--tp=7"], SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0",
                   MASTER_ADDR="trn001", SLURM_SUBMIT_DIR=str(ROOT), HEALTHCHECK="0", PRECOMPILE="0",
                   PATH=f"{fake}:{os.environ['PATH']}", NEURON_CACHE_DIR=str(tmp_path / "cache"))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("config error:") == 1 and "attempt 2" not in r.stderr, r.stderr


def test_sbatch_gives_the_final_save_its_early_warning():
    """--signal=B:USR1@N asks SLURM for the stop N s before the time limit, because a 7B save does
    not fit torchrun's or KillWait's 30 s: train.py's budget (--ckpt.grace_s, checkpoint.stop_budget)
    must be those N s, or it refuses exactly the saves the early warning is there for. A value the
    user gives stays."""
    early = int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", (SCRIPTS / "slurm_train.sbatch").read_text(), re.M).group(1))
    for extra, budget in (([], early), (["--ckpt.grace_s=40"], 40), (["--ckpt.grace_s", "40"], 40),
                          (["--ckpt.grace-s=40"], 40)):       # the last was overridden by --ckpt.grace_s=300
        r = run_script([SCRIPTS / "slurm_train.sbatch", *ARGS_7B, *extra], DRY_RUN="1", SLURM_JOB_NUM_NODES="16",
                       SLURM_JOB_ID="42", SLURM_SUBMIT_DIR=str(ROOT), MASTER_ADDR="trn001")
        assert r.returncode == 0, r.stderr
        (train,) = parse_dry_run(r.stdout.split("# srun")[-1].split("\n", 1)[1])[1]
        assert flat_config(train[train.index("train.py") + 1:])["ckpt.grace_s"] == budget, train


@pytest.mark.parametrize("nodes", [16, 128])
def test_dry_run_at_scale_under_slurm(nodes):
    """What a 4096-rank launch needs, node by node (NxD/HLAT scripts): a static node rank, a raised
    open-file limit, the rendezvous and Neuron bootstrap ports reserved, a long runtime timeout,
    one stochastic-rounding seed, gloo groups that connect lazily (no full mesh)."""
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], DRY_RUN="1", SLURM_JOB_NUM_NODES=str(nodes),
                   SLURM_NODEID="5", MASTER_ADDR="trn-001", SLURM_JOB_ID="77")
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    env, cmds, headers = parse_dry_run(r.stdout)
    dp = nodes * 32 // 8
    assert f"{nodes} node(s) x 32 ranks = {nodes * 32} (trn1.32xlarge); tp=8 pp=1 dp={dp}" in headers[0]
    assert cmds == [["torchrun", "--nproc_per_node=32", f"--nnodes={nodes}", "--node_rank=5",
                     "--master_addr=trn-001", "--master_port=29500", "--max-restarts=0", "train.py", *ARGS_7B]]
    assert "ulimit -n 65535" in headers
    already = open("/proc/sys/net/ipv4/ip_local_reserved_ports").read().strip().split(",")
    sysctl = [h for h in headers if h.startswith("sudo -n sysctl")]
    for port in ("29500", "62182"):
        assert port in already or (sysctl and port in sysctl[0].split("=", 1)[1].split(","))
    if sysctl and already != [""]:         # added to what the node reserves, never replacing it
        assert sysctl[0].split("=", 1)[1].startswith(",".join(already))
    assert env["NEURON_RT_EXEC_TIMEOUT"] == "4000"
    assert env["NEURON_RT_STOCHASTIC_ROUNDING_SEED"] == "0"
    assert env["TORCH_GLOO_LAZY_INIT"] == "1"
    assert "NEURON_LOGICAL_NC_CONFIG" not in env


def test_reserved_ports_read_back_as_ranges_are_reserved():
    """The kernel prints consecutive reserved ports as one range: an EKS pod's sysctl 29500,29501,62182
    (eks.py: the run's port and the compile Job's health port) reads back 29500-29501,62182. launch.sh
    took 29500 for missing then, and every pod tried sudo (none in the image) and warned that another
    process may take the port. Run in a network namespace of its own, whose list this test may set."""
    probe = "unshare -n sh -c 'echo 1 > /proc/sys/net/ipv4/ip_local_reserved_ports'"
    if subprocess.run(probe, shell=True, capture_output=True).returncode != 0:
        pytest.skip("no network namespace of our own here (needs root): the list cannot be set")
    for listed, want in (("29500,29501,62182", None), ("29400-29600,62182", None),
                         ("29501,62182", "29501,62182,29500")):      # added to, never replaced
        script = f'echo {listed} > /proc/sys/net/ipv4/ip_local_reserved_ports && exec bash "$@"'
        r = subprocess.run(["unshare", "-n", "bash", "-c", script, "launch.sh", str(SCRIPTS / "launch.sh"), "train",
                            *ARGS_7B], capture_output=True, text=True, timeout=60, cwd="/tmp",
                           env={"PATH": os.environ["PATH"], "PYTHON": sys.executable, "DRY_RUN": "1", "NNODES": "2",
                                "MASTER_ADDR": "x"})
        assert r.returncode == 0, r.stderr
        sysctl = [line for line in r.stdout.splitlines() if line.startswith("sudo ")]
        assert sysctl == ([f"sudo -n sysctl -q -w net.ipv4.ip_local_reserved_ports={want}"] if want else []), (listed, sysctl)


def test_dry_run_trn2():
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B, "--instance", "trn2"], DRY_RUN="1",
                   NNODES="16", MASTER_ADDR="trn-001")
    assert r.returncode == 0, r.stderr
    env, cmds, headers = parse_dry_run(r.stdout)
    assert "16 node(s) x 64 ranks = 1024 (trn2.48xlarge); tp=8 pp=1 dp=128" in headers[0]
    assert cmds[0][:3] == ["torchrun", "--nproc_per_node=64", "--nnodes=16"]
    assert env["NEURON_LOGICAL_NC_CONFIG"] == "2"
    # AWS's trn2 configs compile with '--model-type transformer' and no --distribution-strategy (NxDT's
    # hf_llama3_*_trn2_config.yaml); trn2 had trn1's llm-training (test_dry_run_7b_on_16_nodes keeps it there)
    flags = env["NEURON_CC_FLAGS"].split()
    assert flags[0] == "--model-type=transformer" and not any("distribution-strategy" in f for f in flags), flags


def test_launch_sh_help_is_not_an_error_and_an_unknown_mode_is_named():
    # `scripts/launch.sh --help` printed the usage as an error (exit 2); `launch.sh trian` did not say what was wrong
    r = run_script([SCRIPTS / "launch.sh", "--help"])
    assert r.returncode == 0 and r.stdout.startswith("usage: [DRY_RUN=1] scripts/launch.sh") and not r.stderr, r
    r = run_script([SCRIPTS / "launch.sh", "trian", "--preset", "llama2_7b"], DRY_RUN="1")
    assert r.returncode == 2 and r.stderr.startswith("launch.sh: unknown mode 'trian'; usage:") and not r.stdout, r
    r = run_script([SCRIPTS / "launch.sh"])
    assert r.returncode == 2 and r.stderr.startswith("usage:"), r


@pytest.mark.slow          # three python processes of train.py / healthcheck.py --help (torch's import each)
def test_help_after_the_mode_is_the_help_of_what_the_mode_runs():
    # `launch.sh train --help` went to the config as a key: "config error: unknown config key --help (--help lists
    # them all)", exit 2. Now launch.sh's usage and then train.py's help (health: healthcheck.py's), exit 0.
    for mode, says in (("train", "presets (--preset NAME)"), ("compile", "presets (--preset NAME)"),
                       ("health", "--ranks-per-node")):
        r = run_script([SCRIPTS / "launch.sh", mode, "--preset", "llama2_7b", "--help"])
        assert r.returncode == 0 and r.stdout.startswith("usage: [DRY_RUN=1] scripts/launch.sh"), (mode, r.stderr)
        assert says in r.stdout, (mode, r.stdout[-500:])


def test_a_command_launch_sh_runs_that_is_not_there_is_named_with_its_variable(tmp_path):
    """PYTHON or TORCHRUN naming nothing here was bash's 'launch.sh: line N: /x: No such file or directory', exit
    127 (in a pod: a failure the Job retries, not FailJob's 2), naming neither the variable nor the fix. A dry run
    needs no torchrun here (it prints the command for the nodes)."""
    r = run_script([SCRIPTS / "launch.sh", "train", "--dry-run"], PYTHON=str(tmp_path / "python"))
    assert r.returncode == 2 and r.stderr.startswith(f"error: PYTHON={tmp_path}/python: no such command here"), r
    assert len(r.stderr.splitlines()) == 1, r
    r = run_script([SCRIPTS / "launch.sh", "train", f"--out_dir={tmp_path}/run", "--device=cpu"],
                   TORCHRUN="torchrun-missing", NEURON_CACHE_DIR=str(tmp_path / "cache"), NPROC_PER_NODE="1")
    lines = [line for line in r.stderr.splitlines() if not line.startswith("warning:")]
    assert r.returncode == 2 and lines == [lines[0]] and lines[0].startswith("error: TORCHRUN=torchrun-missing"), r
    assert run_script([SCRIPTS / "launch.sh", "train", "--dry-run", *ARGS_7B], TORCHRUN="torchrun-missing").returncode == 0
    # and the compile pass's neuron_parallel_compile (torch-neuronx's; not here): bash's 'exec: ...: not found', 127
    r = run_script([SCRIPTS / "launch.sh", "compile", f"--out_dir={tmp_path}/run", "--device=cpu"], TORCHRUN="true",
                   NEURON_CACHE_DIR=str(tmp_path / "cache"), NPROC_PER_NODE="1")
    lines = [line for line in r.stderr.splitlines() if not line.startswith("warning:")]
    assert r.returncode == 2 and lines == [lines[0]] and lines[0].startswith("error: neuron_parallel_compile: no such "
                                                                             "command here"), r


@pytest.mark.slow          # a venv made here (no torch's import: seconds)
def test_a_python_without_the_runs_packages_or_the_neuron_runtime_is_refused_in_one_line(tmp_path):
    """docs/trn1.md's step 1 done but its venv not activated: launch.sh ran the DLAMI's system python3, and its
    config check died in numpy's import, a traceback with exit 1 that the sbatch loop retried 4 times. And the
    right Python without the Neuron runtime (a CPU venv on the node): env.sh's PJRT_DEVICE=NEURON failed in every
    worker, each saying "or unset it" (launch.sh sets it), torchrun retrying 3 times. Now one line each, exit 2,
    no torchrun; a dry run prints a run for other machines and asks nothing of this one."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    started = tmp_path / "started"
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(f"#!/bin/sh\ntouch {started}\n")
    torchrun.chmod(0o755)
    env = {"TORCHRUN": str(torchrun), "NPROC_PER_NODE": "1", "NEURON_CACHE_DIR": str(tmp_path / "cache")}
    args = [SCRIPTS / "launch.sh", "train", f"--out_dir={tmp_path}/run"]
    r = run_script(args, PYTHON=str(bare / "bin" / "python"), **env)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"config error: the Python launch.sh runs ({bare}/bin/python) has no torch, numpy, "
                               "pyarrow, sentencepiece, tokenizers, safetensors, tqdm, tensorboard:"), r.stderr
    assert "PyTorch venv" in r.stderr and "requirements.txt" in r.stderr and not started.exists()
    # A Python with all but tqdm (imported lazily, by the span index build of a run's first start: a traceback
    # of the worker building it, after torchrun started), hidden from this one by a sitecustomize
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['tqdm'] = None\n")   # find_spec: None
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{hide}" exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    r = run_script([*args, "--log.tensorboard="], PYTHON=str(wrapper), **env)
    assert r.returncode == 2 and not started.exists(), r.stderr
    assert r.stderr.startswith(f"config error: the Python launch.sh runs ({sys.executable}) has no tqdm: "), r.stderr
    if importlib.util.find_spec("libneuronxla") is None:     # (this host: no Neuron runtime)
        r = run_script(args, **env)
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and not started.exists(), r.stderr
        assert r.stderr.startswith("config error: --device=auto runs on Trainium under launch.sh (PJRT_DEVICE=NEURON, "
                                   "env.sh), but this Python has no libneuronxla"), r.stderr
        assert "--device=cpu" in r.stderr
    r = run_script([*args, "--device=cpu", "--log.tensorboard="], **env)
    assert r.returncode == 0 and started.exists(), r.stderr
    r = run_script(args, PYTHON=str(bare / "bin" / "python"), DRY_RUN="1", **env)
    assert r.returncode == 0 and "train.py --out_dir=" in r.stdout, r.stderr


def test_dry_run_flag_after_the_mode_is_a_dry_run_too():
    """`launch.sh train --dry-run --preset ...` was a config error (unknown key --dry_run): the flag
    was honoured only before the mode. train.py has no such key, so it is the launcher's anywhere."""
    before = run_script([SCRIPTS / "launch.sh", "--dry-run", "train", *ARGS_7B, "--data", "a b"])
    for at in (1, 3, len(ARGS_7B) + 3):
        args = ["train", *ARGS_7B, "--data", "a b"]
        r = run_script([SCRIPTS / "launch.sh", *args[:at], "--dry-run", *args[at:]])
        assert r.returncode == 0 and r.stdout == before.stdout and "--dry-run" not in r.stdout, r


def test_bad_layout_fails_before_anything_starts():
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B, "--tp=7"], NNODES="16", MASTER_ADDR="x")
    assert r.returncode != 0
    assert "tp 7" in r.stderr and "torchrun" not in r.stdout
    # The xla backend's own rules (configs.validate's backend="xla"): a launcher for Trainium checks them.
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B, "--pp=2", "--parallel.pp_p2p=send"], DRY_RUN="1",
                   NNODES="16", MASTER_ADDR="x")
    assert r.returncode != 0 and "pp_p2p='send' does not work on the xla backend" in r.stderr, r.stderr
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], NNODES="2", DRY_RUN="1")
    assert r.returncode != 0 and "MASTER_ADDR" in r.stderr
    # The planner's rule, as eks.py asks it: a TP group inside one instance. 70B's 64 heads split 64
    # ways, which configs.validate accepts; launch.sh ran it with every TP group across two trn1 nodes.
    r = run_script([SCRIPTS / "launch.sh", "train", "--preset", "llama2_70b", "--tp=64"], DRY_RUN="1",
                   NNODES="16", MASTER_ADDR="x")
    assert r.returncode == 2 and r.stdout == "" and r.stderr.strip().splitlines() == [
        "config error: --parallel.tp=64 does not divide the 32 NeuronCores of a trn1.32xlarge: a TP group runs on "
        "one instance's NeuronLink; pick --parallel.tp from 1, 2, 4, 8, 16, 32"], r.stderr


def test_a_compile_pass_too_short_for_its_eval_and_save_is_refused():
    """The pre-compile pass evaluates at step 4 and saves at step 5: COMPILE_STEPS=5 ran without the step after
    the save (aws-neuron-sdk #813), 3 without the save and the eval, and the run compiled them at its own (minutes)."""
    for steps in ("3", "5"):
        r = run_script([SCRIPTS / "launch.sh", "compile", *ARGS_7B], DRY_RUN="1", COMPILE_STEPS=steps)
        assert r.returncode == 2 and r.stdout == "" and r.stderr.startswith(
            f"error: COMPILE_STEPS={steps}: give 6 or more") and len(r.stderr.splitlines()) == 1, r
    r = run_script([SCRIPTS / "launch.sh", "compile", *ARGS_7B], DRY_RUN="1", COMPILE_STEPS="6")
    assert r.returncode == 0 and "--optim.max_steps=6 --log.eval_interval=4 --ckpt.interval=5" in r.stdout, r


def test_the_compile_pass_logs_whatever_the_runs_log_interval():
    """A run logging every 100 steps: its pass of 10 steps logged never, so the run compiled the log graph
    (the parameter norm) at its step 100. The pass now logs at step 5, beside its save; no graph's shape
    depends on --log.interval (scripts/xla_check.py's census at 2 and 4: the same sizes)."""
    r = run_script([SCRIPTS / "launch.sh", "compile", *ARGS_7B, "--log.interval=100"], DRY_RUN="1")
    assert r.returncode == 0, r
    (cmd,) = parse_dry_run(r.stdout)[1]
    cfg = flat_config(cmd[cmd.index("train.py") + 1:])
    assert cfg["log.interval"] <= 5 < cfg["optim.max_steps"] and cfg["ckpt.interval"] == 5, cfg
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], DRY_RUN="1", COMPILE_STEPS="3")    # not its business
    assert r.returncode == 0, r


@pytest.mark.slow
def test_a_bad_path_fails_in_launch_sh_not_in_every_worker(tmp_path):
    """A missing --tokenizer or --data, an --out_dir that is a file: launch.sh says it in one line with the
    config error's 2 (eks.py's FailJob) and starts no torchrun. It started torchrun, whose every
    worker refused it with 1, a failure torchrun (--max-restarts) and the Kubernetes Job (per pod)
    retry. A dry run prints a run for other machines, so their paths are not checked here."""
    started = tmp_path / "started"
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(f"#!/bin/sh\ntouch {started}\nexit 1\n")
    torchrun.chmod(0o755)
    (tmp_path / "a_file").write_text("")
    env = {"TORCHRUN": str(torchrun), "NPROC_PER_NODE": "1", "NEURON_CACHE_DIR": str(tmp_path / "cache")}
    for arg, says in ((f"--tokenizer={tmp_path}/none.model", "none.model' is missing"),
                      (f"--data=stdlib:0.5,{tmp_path}/none.arrow:0.5", "none.arrow' does not exist"),
                      (f"--out_dir={tmp_path}/a_file", "a_file' is a file, not a directory")):
        r = run_script([SCRIPTS / "launch.sh", "train", "--preset=tiny", arg], **env)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
        assert not started.exists()
        r = run_script([SCRIPTS / "launch.sh", "train", "--preset=tiny", arg], DRY_RUN="1", **env)
        assert r.returncode == 0 and arg in r.stdout, r.stderr


def test_compile_cache_on_network_file_system_is_refused(tmp_path):
    # No NFS/Lustre mount exists here: a `stat` shim reports the cache directory as Lustre (FSx).
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "stat").write_text("#!/bin/sh\necho lustre\n")
    (shim / "stat").chmod(0o755)
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], DRY_RUN="1",
                   NEURON_CACHE_DIR="/fsx/neuron-cache", PATH=f"{shim}:{os.environ['PATH']}")
    assert r.returncode == 2            # a configuration error, as every other (it was 1, which a Job retries)
    assert "local disk" in r.stderr and "torchrun" not in r.stdout


def test_a_compile_cache_url_is_refused_as_shared_and_no_folder_is_made(tmp_path):
    # NEURON_CACHE_DIR=s3://bucket/cache passed the local-disk check (its nearest existing parent was '.'): every
    # node's ranks would poll one shared cache in S3, the blog's timeouts, and a real run's `mkdir -p` made a
    # folder 's3:' in the repository.
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], DRY_RUN="1", NEURON_CACHE_DIR="s3://bucket/neuron-cache")
    assert r.returncode == 2 and "torchrun" not in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: NEURON_CACHE_DIR=s3://bucket/neuron-cache is a URL") and "local disk" in r.stderr
    assert not (Path("/tmp") / "s3:").exists()


@pytest.mark.parametrize("seed", ["abc", "-1", "1.5", "7 8", "4294967296", "99999999999999999999999"])
def test_a_stochastic_rounding_seed_that_is_no_whole_number_is_refused_before_any_node_starts(seed):
    # NANOTRN_SR_SEED went into NEURON_RT_STOCHASTIC_ROUNDING_SEED unchecked: 'abc' reached the Neuron runtime of
    # every node, after the compile. launch.sh (env.sh) now refuses it in one line, before printing any command; and
    # one past the runtime's uint32 (2^32, or 23 digits, which wrap in bash's own integers too) as well.
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], DRY_RUN="1", NANOTRN_SR_SEED=seed,
                   NEURON_CACHE_DIR="/tmp/neuron-cache-test")
    assert r.returncode == 2 and "torchrun" not in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.startswith(f"error: NANOTRN_SR_SEED={seed}: give a whole number from 0 to 4294967295"), r.stderr
    for good in ("7", "4294967295"):
        ok = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], DRY_RUN="1", NANOTRN_SR_SEED=good,
                        NEURON_CACHE_DIR="/tmp/neuron-cache-test")
        assert ok.returncode == 0 and parse_dry_run(ok.stdout)[0]["NEURON_RT_STOCHASTIC_ROUNDING_SEED"] == good, ok.stderr


def test_a_master_addr_with_a_port_is_refused_and_an_ipv6_address_is_not():
    # MASTER_ADDR=node-0:29400 went into --master_addr (and the rendezvous endpoint 'node-0:29400:29500'): every
    # node then failed to reach a host of that name after torchrun's timeout. Refused now in one line, before any node.
    env = dict(DRY_RUN="1", NNODES="2", NODE_RANK="0", NEURON_CACHE_DIR="/tmp/neuron-cache-test")
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], MASTER_ADDR="node-0:29400", **env)
    assert r.returncode == 2 and "torchrun" not in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: MASTER_ADDR=node-0:29400 holds a port: give the host alone, "
                               "MASTER_ADDR=node-0, and the port as MASTER_PORT=29400"), r.stderr
    for addr in ("node-0", "fd00::12"):
        ok = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], MASTER_ADDR=addr, **env)
        assert ok.returncode == 0 and f"--master_addr={addr}" in ok.stdout, ok.stderr
    # MASTER_ADDR="$(scontrol show hostnames ...)" holds every node, one a line (NxD's scripts take the list into an
    # array and use its first): it went into --master_addr whole, a host name no node resolves, on every attempt.
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], MASTER_ADDR="trn-001\ntrn-002", **env)
    assert r.returncode == 2 and "torchrun" not in r.stdout, (r.stdout, r.stderr)
    assert r.stderr == ("error: MASTER_ADDR='trn-001 trn-002' holds several words: give the first node's host name "
                        "alone, e.g. MASTER_ADDR=trn-001\n"), r.stderr


def test_the_neuron_runtimes_bootstrap_port_is_refused_as_the_rendezvous_port():
    # MASTER_PORT=62182 was accepted: torchrun's store on the first node listens there, and so does the Neuron
    # runtime's collectives bootstrap of rank 0 (torch-xla's NEURON_RT_ROOT_COMM_ID default, MASTER_ADDR:62182,
    # torch_xla/_internal/neuron.py): on Trainium one of the two fails to bind, on every start. eks.py refused it.
    env = dict(DRY_RUN="1", NNODES="2", MASTER_ADDR="node-0", NEURON_CACHE_DIR="/tmp/neuron-cache-test")
    for extra in ({}, {"NODE_RANK": "0"}):                        # c10d rendezvous, and SLURM's static node ranks
        r = run_script([SCRIPTS / "launch.sh", "health", *ARGS_7B], MASTER_PORT="62182", **env, **extra)
        assert r.returncode == 2 and "torchrun" not in r.stdout, (r.stdout, r.stderr)
        assert r.stderr.startswith("error: MASTER_PORT=62182 is the Neuron runtime's collectives bootstrap port"), r.stderr
    ok = run_script([SCRIPTS / "launch.sh", "health", *ARGS_7B], MASTER_PORT="62183", **env)
    assert ok.returncode == 0 and "--rdzv-endpoint=node-0:62183" in ok.stdout, ok.stderr


def test_whole_numbers_with_leading_zeros_are_read_as_decimals():
    # launch.sh compared its numbers as decimals (10#) but computed with them as bash reads them: NNODES=08 died on
    # four of bash's 'value too great for base (error token is "08")' lines (exit 1: a Job retries it), and
    # NNODES=010 made a world of 8 x 32 in bash and of 10 x 32 in train.py's check.
    env = dict(DRY_RUN="1", MASTER_ADDR="node-0", NEURON_CACHE_DIR="/tmp/neuron-cache-test")
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], NNODES="08", NODE_RANK="07", MASTER_PORT="029500",
                   MAX_RESTARTS="03", **env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    _, (cmd,), headers = parse_dry_run(r.stdout)
    assert "8 node(s) x 32 ranks = 256 (trn1.32xlarge); tp=8 pp=1 dp=32" in headers[0], headers
    assert cmd[:6] == ["torchrun", "--nproc_per_node=32", "--nnodes=8", "--node_rank=7", "--master_addr=node-0",
                       "--master_port=29500"], cmd
    assert "net.ipv4.ip_local_reserved_ports=29500,62182" in headers[2], headers


def test_the_docs_launch_a_trainium_node_through_launch_sh():
    # docs/huggingface.md gave `torchrun --nproc_per_node=32 train.py ...`: a trn1 node's 32 ranks without env.sh's
    # environment (PJRT_DEVICE, NEURON_CC_FLAGS, XLA_DISABLE_FUNCTIONALIZATION=0, ...), which train.py refuses on
    # Trainium (hardware.check_functionalization). A documented command with a node's ranks goes through launch.sh.
    # train.py's own --help (its docstring) gave two such lines too.
    import ast
    from test_configs import DOCS, doc_commands
    run = re.compile(r"^\s*(?:\w+=\S+\s+)*torchrun\b[^#]*--nproc[_-]per[_-]node[= ](\d+)[^#]*\btrain\.py")
    texts = {doc: (ROOT / doc).read_text() for doc in DOCS}
    texts["train.py"] = "```\n" + ast.get_docstring(ast.parse((ROOT / "train.py").read_text())) + "\n```\n"
    bare = [(doc, c) for doc, text in texts.items() for c in doc_commands(text)
            if (m := run.search(c)) and int(m.group(1)) >= 32]
    assert bare == [], bare


def test_a_given_neuron_root_comm_id_is_reserved_and_must_name_the_first_node():
    # torch-xla keeps a NEURON_RT_ROOT_COMM_ID it is given. The Neuron docs' fix for a hang at collective init sets
    # localhost:48620 (training-troubleshooting.rst): across nodes each runtime then bootstraps alone. launch.sh took
    # it silently and reserved 62182, not its port.
    env = dict(DRY_RUN="1", MASTER_ADDR="node-0", NEURON_CACHE_DIR="/tmp/neuron-cache-test")
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], NNODES="2",
                   NEURON_RT_ROOT_COMM_ID="localhost:48620", **env)
    assert r.returncode == 2 and "torchrun" not in r.stdout, (r.stdout, r.stderr)
    assert r.stderr.startswith("error: NEURON_RT_ROOT_COMM_ID=localhost:48620 names each node itself"), r.stderr
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], NNODES="2", NEURON_RT_ROOT_COMM_ID="node-0", **env)
    assert r.returncode == 2 and r.stderr.startswith("error: NEURON_RT_ROOT_COMM_ID=node-0: give HOST:PORT"), r.stderr
    for nodes, given in (("2", "node-0:48620"), ("1", "localhost:48620")):
        r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], NNODES=nodes, NEURON_RT_ROOT_COMM_ID=given, **env)
        assert r.returncode == 0 and "net.ipv4.ip_local_reserved_ports=29500,48620" in r.stdout, r.stderr
    r = run_script([SCRIPTS / "launch.sh", "train", *ARGS_7B], NNODES="2", MASTER_PORT="48620",
                   NEURON_RT_ROOT_COMM_ID="node-0:48620", **env)
    assert r.returncode == 2 and r.stderr.startswith("error: MASTER_PORT=48620 is the Neuron runtime's"), r.stderr


def _host_group_worker(rank, ports, out_dir):
    os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    import torch
    import torch.distributed as dist
    import parallel

    def sockets():
        fds = [os.path.join("/proc/self/fd", f) for f in os.listdir("/proc/self/fd")]
        return sum(1 for f in fds if os.path.islink(f) and os.readlink(f).startswith("socket:"))

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=8)
    before = sockets()
    group = parallel.new_host_group()
    built = sockets()
    dist.barrier(group=group)
    t = torch.tensor([1])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)      # the checkpoint's agreement
    used = sockets()
    Path(out_dir, f"{rank}.json").write_text(json.dumps([before, built, used]))
    dist.destroy_process_group()


@pytest.mark.slow
def test_host_group_connects_lazily(tmp_path):
    """The gloo host group of an XLA run opens a socket only to the peers a barrier and an
    all-reduce talk to (r +- 1, 2, 4 of 8 ranks: 5 peers), not to every rank (7): at 4096 ranks
    at most 24 instead of 4095. Sockets are counted in /proc/self/fd of each rank."""
    from gloo_spawn import spawn_and_wait
    spawn_and_wait(_host_group_worker, 1, 8, str(tmp_path), timeout_s=300)
    for rank in range(8):
        before, built, used = json.loads((tmp_path / f"{rank}.json").read_text())
        peers = {(rank + s * d) % 8 for d in (1, 2, 4) for s in (1, -1)}
        # An eager group would hold 7 (one per other rank) once built; a lazy one holds the 5
        # barrier peers once the barrier is done (some may connect while this rank still builds
        # the group: a peer that finished first starts its barrier), plus at most the one socket
        # that building a group opens.
        assert used - before <= len(peers) + 1 < 7, (rank, before, built, used)


# ----------------------------------------------------------------------------- health check

WORLD4 = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


REFUSALS = [
    (["--tp", "3"], {"WORLD_SIZE": "1"}, "no WORLD_SIZE or MASTER_ADDR: run it under torchrun"),
    (["--tp", "3"], {**WORLD4}, "world 4 must be a multiple of tp*pp=3"),
    # accepted, and no rank slept: the check it exists for passed for nothing
    (["--inject-delay", "4:1"], {**WORLD4}, "--inject-delay 4:1: rank 4 is not in the world of 4"),
    # each process was a world of its own, timed nothing between them and said "healthy"
    (["--backend=xla"], {**WORLD4, "PJRT_DEVICE": "CPU"}, "--backend=xla on XLA:CPU (PJRT_DEVICE=CPU) has no collectives"),
    (["--backend=xla"], {**WORLD4}, "--backend=xla on XLA:CPU (PJRT_DEVICE=unset) has no collectives"),
    # launch.sh health where the Python has no Neuron runtime (env.sh sets PJRT_DEVICE=NEURON): each rank's traceback
    # from torch-xla's 'No module named libneuronxla', at init_process_group
    ([], {**WORLD4, "PJRT_DEVICE": "NEURON"}, "--backend=auto: PJRT_DEVICE=NEURON but this Python has no libneuronxla"),
    # each rank's traceback once the group had formed: torch.ones' overflow, the allocator's 'can't allocate memory'
    (["--mb", "1e30"], {**WORLD4}, "--mb 1e+30: a rank holds"),
    (["--mb", "1e7"], {**WORLD4}, "--mb 1e+07: a rank holds"),
    # each rank's ValueError traceback from init_process_group ('only supported with GPUs, no GPUs found')
    (["--backend=nccl"], {**WORLD4}, "--backend=nccl: no CUDA device is visible")]


@pytest.fixture(scope="module")
def refusals(request):
    """The selected REFUSALS cases' healthcheck.py runs, two at a time (each is torch's import and one line, a
    core's worth: one after another they left the second core idle; all eight at once were slower on a loaded
    host and outran the 60 s); each case's test waits for its own run."""
    import concurrent.futures
    cases = {item.callspec.params["case"] for item in request.session.items
             if item.originalname == "test_healthcheck_refuses_before_any_process_group"}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield {i: pool.submit(subprocess.run, [sys.executable, str(SCRIPTS / "healthcheck.py"), *args],
                              capture_output=True, text=True, timeout=60,
                              env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env})
               for i, (args, env, _) in enumerate(REFUSALS) if i in cases}


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(REFUSALS)), ids=[says for _, _, says in REFUSALS])
def test_healthcheck_refuses_before_any_process_group(refusals, case):
    # WORLD_SIZE=1 without a rendezvous was init_process_group's ValueError traceback; --tp 3 on 4 ranks was
    # refused only after the process group, which waits for the other ranks (here: none come, a hang)
    args, env, says = REFUSALS[case]
    if "--backend=nccl" in args and torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: nccl runs here")
    if env.get("PJRT_DEVICE") == "NEURON" and importlib.util.find_spec("libneuronxla"):
        pytest.skip("the Neuron runtime is installed here")
    r = refusals[case].result()
    assert r.returncode == 1 and r.stderr.startswith(f"healthcheck error: {says}") and "Traceback" not in r.stderr, r


def test_healthcheck_uses_the_training_groups():
    kinds = healthcheck.group_kinds(world=64, tp=8, pp=2, ranks_per_node=32)
    ref = rank_groups(64, 8, 2)
    assert kinds["tp"] == ref["tp"] and kinds["dp"] == ref["dp"] and kinds["pp"] == ref["pp"]
    assert kinds["world"] == [list(range(64))]
    assert kinds["node_pair_a"] == [[j, 32 + j] for j in range(32)]    # rank j of node 0 with node 1's
    assert "node_pair_b" not in kinds                                   # 2 nodes: one pair only
    kinds = healthcheck.group_kinds(world=8, tp=1, pp=1, ranks_per_node=1)
    assert "tp" not in kinds                                            # groups of one are not timed
    pair_nodes = lambda k: sorted(tuple(g) for g in kinds[k])  # noqa: E731
    assert pair_nodes("node_pair_a") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert pair_nodes("node_pair_b") == [(1, 2), (3, 4), (5, 6), (7, 0)]


def synthetic_records(kinds, arrival, transfer):
    """Timings as the collectives would produce them: every member leaves when the last one has
    arrived and the transfer is done, so a rank's time is (last arrival - its arrival) + transfer."""
    records = []
    for kind, groups in kinds.items():
        for op in healthcheck.OPS:
            for gi, g in enumerate(groups):
                for rep in range(5):
                    t = transfer(kind, g) * (1 + 0.05 * ((rep * 7 + gi) % 3))   # a little jitter
                    last = max(arrival(r) for r in g)
                    records += [(kind, op, gi, rep, r, last - arrival(r) + t) for r in g]
    return records


def test_a_group_slower_by_less_than_the_minimum_gap_is_not_called_slow():
    """A collective of tens of microseconds doubles with any scheduling hiccup: a group is slow only when it is both
    --factor times the median and --min-gap slower (5x, but 40 us beside the 1 ms gap: healthy, nothing named)."""
    world, per_node = 8, 4
    kinds = healthcheck.group_kinds(world, tp=2, pp=1, ranks_per_node=per_node)
    node_of = [r // per_node for r in range(world)]
    records = synthetic_records(kinds, lambda r: 0.0, lambda k, g: 5e-5 if 3 in g else 1e-5)
    rep = healthcheck.analyze(records, kinds, node_of, 2**20, factor=2.0, min_gap_s=1e-3)
    assert rep["healthy"] and rep["slow_groups"] == [] and rep["suspect_ranks"] == [], rep["slow_groups"]
    rep = healthcheck.analyze(records, kinds, node_of, 2**20, factor=2.0, min_gap_s=1e-5)     # the same, noticed
    assert not rep["healthy"] and rep["suspect_ranks"] == [3]


def test_analyze_locates_bad_link_and_bad_node():
    world, per_node = 32, 4
    kinds = healthcheck.group_kinds(world, tp=2, pp=1, ranks_per_node=per_node)
    node_of = [r // per_node for r in range(world)]
    ok = lambda r: 0.0  # noqa: E731

    # rank 13's link is bad: every group it is in moves data 5x slower
    rep = healthcheck.analyze(synthetic_records(kinds, ok, lambda k, g: 5e-3 if 13 in g else 1e-3),
                              kinds, node_of, 2**20, factor=2.0, min_gap_s=1e-3)
    assert rep["suspect_ranks"] == [13] and rep["late_ranks"] == [] and rep["slow_nodes"] == []
    assert not rep["healthy"]

    # node 5's network is bad: everything that leaves node 5 is slow (its TP groups are not)
    def node5(kind, g):
        return 5e-3 if kind != "tp" and any(node_of[r] == 5 for r in g) else 1e-3
    rep = healthcheck.analyze(synthetic_records(kinds, ok, node5), kinds, node_of, 2**20, 2.0, 1e-3)
    assert rep["slow_nodes"] == [5] and rep["suspect_ranks"] == [] and rep["late_ranks"] == []

    # nothing wrong: nothing named
    rep = healthcheck.analyze(synthetic_records(kinds, ok, lambda k, g: 1e-3), kinds, node_of, 2**20, 2.0, 1e-3)
    assert rep["healthy"]
    bw = {(g["kind"], g["op"]): g["busbw_gbps"] for g in rep["groups"]}
    assert bw[("tp", "all_reduce")] == pytest.approx(2**20 / 1e-3 / 1e9, rel=0.1)  # 2(n-1)/n = 1


def _health_worker(rank, ports, out_dir):
    import healthcheck
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    analyze = healthcheck.analyze

    def counted(records, *a, **k):                    # the real analysis, counted
        (Path(out_dir) / f"analyzed{rank}").write_text(str(len(records)))
        return analyze(records, *a, **k)
    healthcheck.analyze = counted
    code = healthcheck.main(["--backend=gloo", "--mb=0.01", "--warmup=0", "--reps=2", "--ranks-per-node=1",
                             "--inject-delay=1:0.2", "--min-gap-ms=50"])
    (Path(out_dir) / f"code{rank}").write_text(str(code))


@pytest.mark.slow
def test_healthcheck_judges_on_rank_0_and_every_rank_exits_alike(tmp_path):
    """2 gloo ranks, rank 1 late: rank 0 alone receives and analyzes everyone's records (an
    all-gather gave each of 4096 ranks all 4096 ranks' records and the analysis); both exit 1."""
    from gloo_spawn import spawn_and_wait
    spawn_and_wait(_health_worker, 1, 2, str(tmp_path), timeout_s=240)
    assert sorted(p.name for p in tmp_path.glob("analyzed*")) == ["analyzed0"]
    assert int((tmp_path / "analyzed0").read_text()) > 0
    assert [(tmp_path / f"code{r}").read_text() for r in (0, 1)] == ["1", "1"]


@pytest.mark.slow
def test_healthcheck_names_the_slowed_rank(tmp_path):
    """4 gloo ranks under torchrun, each its own 'node'; rank 2 arrives 60 ms late at every
    collective. It must be named, and nobody else."""
    out = tmp_path / "health.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(SCRIPTS / "healthcheck.py"), "--backend=gloo", "--tp=2", "--mb=0.25", "--warmup=1",
           "--reps=5", "--ranks-per-node=1", "--min-gap-ms=20", "--inject-delay=2:0.06", f"--json={out}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    print(r.stdout[-3000:])
    assert r.returncode != 0, "an unhealthy check must fail the launch"
    rep = json.loads(out.read_text())
    assert rep["late_ranks"] == [2]
    assert rep["late_ms"][2] == pytest.approx(60, abs=40)
    assert rep["slow_nodes"] == [2] and rep["suspect_ranks"] == [] and rep["slow_groups"] == []
    kinds = {g["kind"] for g in rep["groups"]}
    assert {"tp", "dp", "world", "node_pair_a", "node_pair_b"} <= kinds
    assert all(g["busbw_gbps"] > 0 for g in rep["groups"])
    assert "SLOW: rank 2" in r.stdout


# ----------------------------------------------------------------------------- stopping inside the grace period

TINY_RUN = ["--model.n_layers=2", "--model.dim=32", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=64",
            "--data.seq_len=32", "--model.max_seq_len=32", "--data.global_batch=4", "--data.micro_batch=1",
            "--optim.precision=fp32", "--optim.max_steps=100000", "--ckpt.interval=0", "--device=cpu", "--log.interval=1",
            "--log.eval_interval=0", "--log.sample_tokens=0", "--log.tensorboard="]


def run_until_step(cmd, env, step: int, sig, target=None, timeout: int = 240):
    """Start cmd (a session of its own), send `sig` to `target(p)` (default: the process) once a
    line `step N |` appears, and return (exit status, stdout, stderr)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd="/tmp",
                         start_new_session=True)
    seen = []
    try:
        for line in p.stdout:
            seen.append(line)
            if line.startswith(f"step {step:6d} |"):
                os.kill(target(p) if target else p.pid, sig)
                break
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the run did not stop after the signal")
    return p.returncode, "".join(seen) + out, err


def launch_env(tmp_path, **extra) -> dict:
    venv_bin = Path(sys.executable).parent
    return {"PATH": f"{tmp_path}/bin:{venv_bin}:{os.environ['PATH']}", "HOME": os.environ.get("HOME", "/tmp"),
            "PYTHON": sys.executable, "TORCHRUN": str(venv_bin / "torchrun"), "NPROC_PER_NODE": "2",
            "NEURON_CACHE_DIR": str(tmp_path / "neuron-cache"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            **extra}


def assert_stopped_with_checkpoint(out: str, err: str, ckpt: Path, name: str):
    import re
    import ckptdir
    m = re.search(rf"{name}: stopped after step (\d+), saved", out)
    assert m, out[-2000:] + err[-3000:]
    step = int(m.group(1))
    heard = [int(s) for s in re.findall(rf"\[rank \d\] {name} during step (\d+):", err)]
    assert len(heard) == 2 and min(heard) == step, err[-3000:]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == [f"step_{step:08d}"]
    verdict, problem, files = ckptdir.check(ckpt / f"step_{step:08d}")
    assert verdict == ckptdir.OK and files, problem
    # torchrun was never asked to stop: no "Sending process N closing signal", no 30 s SIGKILL timer
    assert "closing signal" not in err and "forcefully exiting" not in err, err[-3000:]


@pytest.mark.slow
def test_sbatch_early_usr1_reaches_the_workers_not_torchrun(tmp_path):
    """slurm_train.sbatch for real on one CPU "node", with stand-ins for srun (runs the step once,
    in a process group of its own, as slurmstepd does) and scancel (signals that whole group, as
    SLURM's proctrack does). SIGUSR1 to the batch script (what --signal=B:USR1@300 sends): its
    trap signals the step; torchrun ignores USR1 (launch.sh), the workers stop after the step they
    heard it during with a complete checkpoint, everything exits 0 and no step starts again."""
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin"
    (fake / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n'
                               f'exec setsid -w bash -c \'echo $$ > {tmp_path}/step.pgid; exec "$@"\' srun-step "$@"\n')
    (fake / "scancel").write_text(f'#!/bin/bash\necho "scancel $*" >> {tmp_path}/scancel.log\n'
                                  f'[[ "$1" == --signal=USR1 ]] && kill -USR1 -- -"$(cat {tmp_path}/step.pgid)"\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    env = launch_env(tmp_path, SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="cpu1", SLURM_JOB_ID="42",
                     SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(ROOT), MASTER_ADDR="127.0.0.1",
                     HEALTHCHECK="0", PRECOMPILE="0")
    rc, out, err = run_until_step(["bash", str(SCRIPTS / "slurm_train.sbatch"), f"--out_dir={tmp_path}/run",
                                   "--dp=2", *TINY_RUN, cache_arg()], env, 3, signal.SIGUSR1)
    assert rc == 0, err[-3000:]
    assert (tmp_path / "scancel.log").read_text() == "scancel --signal=USR1 42\n"
    assert "SIGUSR1 (the time limit is near)" in err and "training step failed" not in err
    assert_stopped_with_checkpoint(out, err, tmp_path / "run" / "ckpt", "SIGUSR1")


@pytest.mark.slow
def test_sigterm_to_launch_sh_stops_the_workers_without_torchruns_30s(tmp_path):
    """Kubernetes sends SIGTERM to the container's first process, launch.sh: it passes it on as
    SIGUSR1 to torchrun's workers only, so the pod's terminationGracePeriodSeconds, not torchrun's
    fixed 30 s, bounds the final save. The run stops with a checkpoint. The pod is the one pod of a
    1-node Indexed Job (eks.py's, JOB_COMPLETION_INDEX 0): it exits 143, not the workers' 0, which
    marked the pod Succeeded and its index complete, so the Job was Complete at the step of the
    drain or `kubectl delete pod` and nothing resumed it."""
    (tmp_path / "bin").mkdir()
    env = launch_env(tmp_path, JOB_COMPLETION_INDEX="0")
    rc, out, err = run_until_step(["bash", str(SCRIPTS / "launch.sh"), "train", f"--out_dir={tmp_path}/run",
                                   "--dp=2", *TINY_RUN, cache_arg()], env, 3, signal.SIGTERM)
    assert rc == 143, err[-3000:]
    assert "launch.sh: SIGTERM: asking the workers of torchrun" in err
    assert "launch.sh: stopped by the signal: exit 143, so that the Job replaces this pod" in err
    # Ports it cannot reserve (no sudo here, or one that asks a password): its one warning, not sudo's line too.
    assert "sudo:" not in err, err[:2000]
    assert_stopped_with_checkpoint(out, err, tmp_path / "run" / "ckpt", "SIGUSR1")
    assert "[Gloo]" not in out, out[:2000]       # each group's connectivity lines (monitor.quiet_gloo)


@pytest.mark.slow
def test_sigterm_during_the_last_step_is_no_stop_the_pod_exits_0(tmp_path):
    """A SIGTERM to launch.sh during the run's last step (or after it, while the workers export) stops
    nothing: the run ends, saved and exported. A 1-node Indexed Job's pod still exited 143, taken for a
    stop (a multi-node Job's replacement then waited for pods that had finished, and the Job could end
    Failed with the run complete). Each worker that ends the run now leaves a file in launch.sh's
    NANOTRN_ENDED_DIR: the pod exits 0; a stop short of the end keeps 143 (the test above)."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "tmp").mkdir()
    env = launch_env(tmp_path, JOB_COMPLETION_INDEX="0", TMPDIR=str(tmp_path / "tmp"))
    args = [a for a in TINY_RUN if not a.startswith("--optim.max_steps")] + ["--optim.max_steps=3"]
    rc, out, err = run_until_step(["bash", str(SCRIPTS / "launch.sh"), "train", f"--out_dir={tmp_path}/run",
                                   "--dp=2", *args, cache_arg()], env, 3, signal.SIGTERM)
    assert rc == 0, err[-3000:]
    assert "launch.sh: SIGTERM: asking the workers of torchrun" in err
    assert "launch.sh: the run had ended (--optim.max_steps) before the signal: exit 0" in err
    assert "exit 143" not in err and "stopped after step" not in out
    assert f"saved the final model to {tmp_path}/run" in out
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").glob("step_*")) == ["step_00000003"]
    assert not list((tmp_path / "tmp").glob("tmp.*"))       # the folder of the workers' files is gone


@pytest.mark.slow
def test_sigterm_before_the_workers_handlers_still_stops_them(tmp_path):
    """A SIGTERM to launch.sh in a worker's first seconds (torchrun has started it; it imports torch, checks the
    config, forms the group: a pod deleted or drained as it starts, or a restart of the workers): launch.sh's
    SIGUSR1 reached a worker that still ignored it (torchrun's disposition, inherited), and was lost. The run
    trained on until the kubelet's SIGKILL (here: 90 s and ~1,600 steps, no checkpoint). launch.sh now also leaves
    'stop' in NANOTRN_ENDED_DIR, which each worker reads once its handlers exist: it stops in the set-up."""
    (tmp_path / "bin").mkdir()
    env = launch_env(tmp_path, JOB_COMPLETION_INDEX="0")
    p = subprocess.Popen(["bash", str(SCRIPTS / "launch.sh"), "train", f"--out_dir={tmp_path}/run", "--dp=2",
                          *TINY_RUN, cache_arg()], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd="/tmp", start_new_session=True)
    children = lambda pid: [int(c) for c in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,  # noqa: E731
                                                          text=True).stdout.split()]
    workers = []

    def kill_all():
        for pid in workers:         # in sessions of their own (torch elastic): not in launch.sh's group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    try:
        for _ in range(6000):       # torchrun (launch.sh's child), then its 2 workers: signalled as they start
            workers = [w for t in children(p.pid) for w in children(t)]
            if len(workers) == 2:
                break
            time.sleep(0.02)
        assert len(workers) == 2, "torchrun did not start 2 workers"
        os.kill(p.pid, signal.SIGTERM)
        out, err = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        kill_all()
        out, err = p.communicate()
        pytest.fail(f"the stop was lost: the run went on to step {out.count('step ')}\n{err[-2000:]}")
    finally:
        kill_all()
    assert p.returncode == 143, err[-3000:]
    assert len(re.findall(r"\[rank \d\] SIGUSR1 during the set-up: stopping", err)) == 2, err[-3000:]
    assert "SIGUSR1: stopped after step 0, not saved" in out and "step      1 |" not in out, out[-2000:]


def test_healthcheck_help_says_every_flag_and_its_default(capsys):
    # `healthcheck.py --help` gave --backend no help at all and no flag its default (--mb 64, --reps 10, ...)
    with pytest.raises(SystemExit) as e:
        healthcheck.main(["--help"])
    said = help_flags(capsys.readouterr().out)
    assert e.value.code == 0
    assert len(said) >= 14, said
    for flag, text in said.items():
        assert text, f"{flag} has no help"
        if flag not in ("-h", "--json", "--warn-only", "--inject-delay"):      # no default to give
            assert text.count("(default: ") == 1, f"{flag}: {text}"


@pytest.mark.parametrize("script,no_default", [("pp_graphs.py", ("-h", "--json")),
                                               ("xla_check.py", ("-h", "--json", "--graphs"))])
def test_the_xla_scripts_help_says_every_flag_and_its_default(script, no_default):
    # `pp_graphs.py --help` said nothing of --steps, --resume-steps and --json, and neither script gave a default
    r = subprocess.run([sys.executable, str(SCRIPTS / script), "--help"], capture_output=True, text=True, timeout=60)
    said = help_flags(r.stdout)
    assert r.returncode == 0 and len(said) >= 6, r
    for flag, text in said.items():
        assert text, f"{script} {flag} has no help"
        if flag not in no_default:
            assert text.count("(default: ") == 1, f"{script} {flag}: {text}"


def _measure_worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch.distributed as dist
    dist.init_process_group("gloo")
    real, largest = dist.all_reduce, []

    def all_reduce(t, *a, **k):              # the real call, then the buffer's largest magnitude
        out = real(t, *a, **k)
        largest.append(t.abs().max().item())
        return out
    dist.all_reduce = all_reduce
    healthcheck.measure({"world": [[0, 1]]}, "gloo", torch.device("cpu"), lambda: None, dist.group.WORLD,
                        nbytes=64, warmup=0, reps=130, delay=None)
    Path(out_dir, f"largest.{rank}").write_text(json.dumps(largest))
    dist.destroy_process_group()


def test_healthcheck_all_reduce_sums_stay_finite_over_the_reps(tmp_path):
    """measure() all-reduces one buffer in place rep after rep: its values must not grow with the group's size a
    rep (ones became 2^k at 2 ranks, inf after 128 reps; at 4096 ranks after 11, the default --reps is 10)."""
    from gloo_spawn import free_ports, spawn
    spawn(_measure_worker, (free_ports(1)[0], str(tmp_path)), nprocs=2, timeout_s=300)
    for rank in range(2):
        largest = json.loads((tmp_path / f"largest.{rank}").read_text())
        assert len(largest) == 130 and all(math.isfinite(x) and x <= 2 for x in largest), largest[-3:]
