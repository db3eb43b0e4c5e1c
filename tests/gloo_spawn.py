"""Shared by the distributed tests (test_parallel.py, test_pipeline.py, test_checkpoint.py,
test_resume.py): spawning gloo worlds, running train.py (under torchrun), and the single-process
reference every layout is compared with."""
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def free_ports(n: int) -> list[int]:
    """n ports that are free now, BELOW the kernel's ephemeral range: later phases bind them minutes
    after they are picked, and gloo's own connections take ephemeral ports meanwhile (a port picked
    with bind(0) was seen taken by then: EADDRINUSE)."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports, rng = [], random.Random()
    while len(ports) < n:
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


# The workers fork from the session's forkserver, torch and pytest imported (conftest.py says what it preloads
# and why); each worker gets this process's environment as of the call, as a spawned one does.


def _in_environ(environ: dict, worker, rank: int, *args):
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, *args)


def spawn(worker, args: tuple, nprocs: int, timeout_s: float = 600):
    """mp.spawn's worker(rank, *args) in nprocs processes, forked from the server; fail if one raises or all hang."""
    ctx = mp.start_processes(functools.partial(_in_environ, dict(os.environ), worker), args=args,
                             nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.time() + timeout_s
    while not ctx.join(timeout=5):       # raises if a rank failed
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"workers did not finish in {timeout_s:.0f} s (a mismatched collective hangs)")


def spawn_and_wait(worker, n_ports: int, nprocs: int, out_dir: str, timeout_s: float = 600) -> str:
    """Run worker(rank, ports, out_dir) in nprocs new processes; fail if one raises or all hang."""
    spawn(worker, (free_ports(n_ports), out_dir), nprocs, timeout_s)
    return out_dir


def single_process_reference(cfg, global_batch, steps: int, eval_step: int = 99) -> dict:
    """Plain single-process Llama: the whole global batch in one forward, the plain loss on full
    logits, torch's own clipping and AdamW. Returns the initial weights; per step the loss and the
    clipped norm; at step 0 the logits and the gradients before and after clipping; the final
    weights; and the loss of batch eval_step after training."""
    import torch
    import model as llama
    from conftest import loss_sum
    model = llama.Llama(cfg.model).init_weights(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.1)
    out = {"init": {k: v.clone() for k, v in model.state_dict().items()}, "loss": [], "norm": []}
    for step in range(steps):
        b = global_batch(step)
        logits = model(b["tokens"], b["positions"], b["doc_ids"])
        loss = loss_sum(logits, b["targets"]) / (b["targets"] != -100).sum()
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach()
            out["grads_unclipped"] = {k: p.grad.clone() for k, p in model.state_dict(keep_vars=True).items()}
        out["norm"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip))
        if step == 0:
            out["grads"] = {k: p.grad.clone() for k, p in model.state_dict(keep_vars=True).items()}
        out["loss"].append(loss.detach())
        opt.step()
        opt.zero_grad()
    out["params"] = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        b = global_batch(eval_step)
        logits = model(b["tokens"], b["positions"], b["doc_ids"])
        out["eval"] = loss_sum(logits, b["targets"]) / (b["targets"] != -100).sum()
    return out


def run_train(args: list[str], nproc: int = 1, restarts: int = 0, env: dict | None = None,
              timeout: int = 300) -> subprocess.CompletedProcess:
    """python train.py ARGS, or under `torchrun --standalone` with nproc > 1, on one thread per
    process; env adds to this process's environment (None removes a variable). A session of its own,
    so that a timeout kills torchrun's workers too, not only torchrun. The session's data cache unless
    args name one."""
    from conftest import cache_arg
    root = Path(__file__).resolve().parents[1]
    if not any(a.startswith("--data.cache_dir=") for a in args):
        args = [*args, cache_arg()]
    cmd = [str(root / "train.py"), *args]
    if nproc > 1:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max-restarts={restarts}", *cmd]
    p = subprocess.Popen([sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=root, env={k: v for k, v in {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}.items()
                                       if v is not None}, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"train.py did not finish in {timeout} s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
