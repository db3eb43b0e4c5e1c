"""What every benchmark measures with: alternating rounds and the median of their per-round ratios
(the machine is shared and noisy: a ratio within one round sees the same load on both sides), the
report's tables, JSON results, child processes and gloo rank groups."""
from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # the repository: bench.py, train.py


def no_page_fault_churn():
    """Take glibc's allocator out of the comparison. By default it maps buffers above an adaptive
    threshold (at most 32 MiB) fresh from the OS and returns them on free, so every step page-faults
    them in again, at a cost that varies with the kernel's state; and the threshold adapts to the
    sizes freed so far, so one model's buffers change the other's costs (transformers' bf16 step
    swung from 3,660 to 4,610 tok/s with which of our attention paths ran in between). With no
    mmap and no trimming, every buffer of either model is reused from the heap after warm-up."""
    import ctypes
    libc = ctypes.CDLL(None)
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)


def take_turns(fns: dict, rounds: int) -> dict[str, list]:
    """What each function returns, per round, the functions taking turns in every round so that the
    machine's noise hits all alike. The order rotates from round to round, so that each function runs
    in each place as often as the others: one run leaves the allocator and caches in its state for the
    next. Every benchmark's rounds go through here: steps timed in-process (alternate), gloo layouts
    and checkpoint restarts that time themselves in child processes."""
    out, names = {name: [] for name in fns}, list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(fns[name]())
    return out


def alternate(fns: dict, rounds: int, reps: int = 1, sync=None) -> dict[str, list[float]]:
    """Seconds of `reps` calls of each function per round (take_turns' rotation), after one warm-up
    call each (allocator, kernels). sync: waits for an asynchronous device (a GPU) before each clock read."""
    sync = sync or (lambda: None)
    for fn in fns.values():
        fn()

    def timed(fn):
        def run():
            sync()
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            sync()
            return time.perf_counter() - t
        return run
    return take_turns({name: timed(fn) for name, fn in fns.items()}, rounds)


def median_ratio(num: list[float], den: list[float]) -> float:
    """The median over rounds of num / den, each round's pair measured side by side."""
    return median_spread(num, den)[0]


def median_spread(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """The median over rounds of num / den, and the lowest and highest round's: how far to trust it."""
    ratios = [a / b for a, b in zip(num, den)]
    return statistics.median(ratios), min(ratios), max(ratios)


def spread_text(m: tuple[float, float, float], fmt: str = ".2f", unit: str = "x") -> str:
    """A median_spread as the reports print it: '0.81x (0.75-0.88)'."""
    return f"{m[0]:{fmt}}{unit} ({m[1]:{fmt}}-{m[2]:{fmt}})"


def table(header: list[str], rows: list[list]) -> None:
    """Print a Markdown table (what the README and docs quote)."""
    print("| " + " | ".join(header) + " |")
    print("|" + " --- |" * len(header))
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")


def write_json(path: str, obj) -> None:
    """obj as strict JSON: a non-finite float (a diverged run's loss, a share of no spikes) is null,
    not Python's NaN / Infinity, which jq and other languages' parsers refuse."""
    def strict(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: strict(v) for k, v in x.items()}
        return [strict(v) for v in x] if isinstance(x, (list, tuple)) else x
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(strict(obj), f, indent=1, allow_nan=False)


def run_child(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run a child process to its end; if it fails, stop with its output's tail."""
    r = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if r.returncode != 0:
        raise SystemExit(f"bench.py: {what} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def launch_ranks(which: str, name: str, world: int, threads: int, steps: int, **env_extra):
    """Run `bench.py <which>` as `world` gloo ranks (a torchrun-like environment) and wait for them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, **env_extra, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS=str(threads))
        cmd = [sys.executable, os.path.join(ROOT, "bench.py"), which, "--threads", str(threads), "--steps", str(steps)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
    if any(p.wait() != 0 for p in procs):
        raise SystemExit(f"bench.py {which}: the {name} run failed")
