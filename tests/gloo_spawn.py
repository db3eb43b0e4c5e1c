"""Spawning gloo worlds for the distributed tests (test_parallel.py, test_pipeline.py)."""
import random
import socket
import time

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


def spawn_and_wait(worker, n_ports: int, nprocs: int, out_dir: str, timeout_s: float = 600) -> str:
    """Run worker(rank, ports, out_dir) in nprocs spawned processes; fail if one raises or all hang."""
    ctx = mp.start_processes(worker, args=(free_ports(n_ports), out_dir), nprocs=nprocs, join=False,
                             start_method="spawn")
    deadline = time.time() + timeout_s
    while not ctx.join(timeout=5):       # raises if a rank failed
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"workers did not finish in {timeout_s:.0f} s (a mismatched collective hangs)")
    return out_dir
