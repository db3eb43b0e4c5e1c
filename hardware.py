"""The hardware a run meets: the device this process runs on, decided once (pick_device: XLA:CPU for several
processes is refused there, before torch_xla's import); whether it is Trainium, the one place that reads
torch-xla's PJRT_DEVICE for it; and what the device can do: its peak FLOP/s, which the MFU divides by, and its
peak memory. train.py decides first; optim.py (the bf16 rounding), monitor.py and scripts/healthcheck.py ask
here rather than reading the variable each in its own way.
"""
from __future__ import annotations

import importlib.util
import os
import re
import resource
import time

import torch

from configs import Config, ConfigError
import sharding


# ----------------------------------------------------------------------------- which device

def xla_platform() -> str:
    """The PJRT platform torch-xla runs on, as torch-xla picks it: PJRT_DEVICE when set ("NEURON" on Trainium,
    "CPU" for XLA:CPU, the tests); unset, "NEURON" where the Neuron venv's libneuronxla is installed (torch-xla's
    import selects it then: torch_xla/__init__.py _aws_ec2_inf_trn_init, runtime._maybe_select_default_device;
    AWS's launch scripts never set the variable), else "" (the import sets CPU). It accepts no other spelling:
    "neuron" or "cpu" is "No PjRtPlugin registered", refused by pick_device before any work."""
    if "PJRT_DEVICE" not in os.environ and importlib.util.find_spec("libneuronxla") is not None:
        return "NEURON"
    return os.environ.get("PJRT_DEVICE", "")


def xla_on_cpu() -> bool:
    """XLA runs on the host's CPU (set or torch-xla's default): one process, no collectives between them."""
    return xla_platform() in ("", "CPU")


def trainium(device: torch.device | str) -> bool:
    """Whether `device` is a NeuronCore: an XLA device with the Neuron runtime underneath."""
    return torch.device(device).type == "xla" and xla_platform() == "NEURON"


def pick_device(name: str, world: int = 1) -> torch.device:
    """The run's device, decided here once and passed down: xla when one exists or is asked for, else cuda, else cpu.
    `world` processes (torchrun's): several on XLA:CPU are refused, which has no collectives between them."""
    # An XLA device "is present" when xla_platform() names one (PJRT_DEVICE, or NEURON where the Neuron
    # venv's libneuronxla is; tests set CPU). Read it BEFORE importing torch_xla: the import sets PJRT_DEVICE.
    if name == "xla" or (name == "auto" and xla_platform()):
        if world > 1 and xla_on_cpu():      # before the import: it took 60-150 s for 2 processes on a loaded host
            raise ConfigError("multi-process XLA needs Trainium (PJRT_DEVICE=NEURON): XLA:CPU has no "
                              "collectives between processes; use --device=cpu to train with gloo")
        try:
            import torch_xla
        except ImportError:
            if name == "xla":
                raise ConfigError("--device=xla needs torch_xla (the Neuron venv has it)") from None
        else:   # a device named but missing is refused, never run on the CPU instead: "No PjRtPlugin
            try:    # registered for: X", NEURON without its runtime ("No module named 'libneuronxla'"), TPU without libtpu
                device = torch_xla.device()
            except (RuntimeError, ImportError, OSError) as e:
                raise ConfigError(f"PJRT_DEVICE={xla_platform()!r}: {str(e).split('. ')[0]}; "
                                  f"use NEURON on Trainium (its venv), CPU for XLA:CPU, or unset it") from None
            check_functionalization()
            return device
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name == "cuda":
        raise ConfigError("--device=cuda but no CUDA device is visible: give --device=cpu or auto")
    return torch.device("cpu")


def check_functionalization() -> None:
    """torch-xla's functionalization, which the model needs on XLA. With it off (XLA_DISABLE_FUNCTIONALIZATION=1)
    a split along a non-leading dimension returns other elements (pytorch/xla#8640; a known issue of torch-neuronx
    2.6 to 2.9 in Neuron's release notes, whose workaround is XLA_DISABLE_FUNCTIONALIZATION=0), and the model
    splits its fused qkv and gate_up on the last one: the tiny model's first loss was 8.3002 instead of 8.2975,
    silently (XLA:CPU). Off is Neuron's default (its torch-neuronx environment variables page), so on Trainium it
    must be set to 0 (scripts/env.sh exports it); elsewhere unset is torch-xla's default, on. Read as torch-xla
    reads it (sys_util::GetEnvBool: "true", "false", else the integer prefix), once the device exists."""
    value = os.environ.get("XLA_DISABLE_FUNCTIONALIZATION")
    digits = re.match(r"\s*[+-]?(\d*)", value or "").group(1)        # C's atoi: 0 without digits
    if value is None and xla_platform() == "NEURON":
        said = " unset (on Trainium: off, Neuron's default)"
    elif value == "true" or (value not in (None, "false") and int(digits or 0) != 0):
        said = f"={value}"
    else:
        return
    raise ConfigError(f"XLA_DISABLE_FUNCTIONALIZATION{said}: without torch-xla's functionalization a split along "
                      f"the last dimension (the model's qkv and gate_up) returns wrong data (pytorch/xla#8640): "
                      f"export XLA_DISABLE_FUNCTIONALIZATION=0 (scripts/env.sh does: launch with scripts/launch.sh)")


def check_auto_cast(precision: str, device: torch.device) -> None:
    """neuronx-cc's --auto-cast in NEURON_CC_FLAGS (scripts/env.sh appends NEURON_CC_EXTRA_FLAGS; the right-most one
    counts): "all" computes every FP32 operation in --auto-cast-type (bf16 by default), "matmult" every FP32 matmul
    (the compiler's CLI reference; its default, none, leaves the model's types, since 2.27 at least). "all" turns the
    fp32 arithmetic of every mode (the update, the loss, the token count in f32, the resume's 16-bit words carried
    exactly in f32: reshard._broadcast) into bf16; "matmult" makes an fp32 run's matmuls bf16, fp32 in name only."""
    if not trainium(device):
        return
    words = os.environ.get("NEURON_CC_FLAGS", "").split()
    modes = [w.split("=", 1)[1] if "=" in w else (words[i + 1] if i + 1 < len(words) else "")
             for i, w in enumerate(words) if w.split("=", 1)[0] == "--auto-cast"]
    mode = modes[-1] if modes else "none"
    if mode == "all" or (mode != "none" and precision == "fp32"):
        what = "every FP32 operation" if mode == "all" else "the FP32 matmuls"
        which = " (the update, the loss, the exact token count and resume broadcast)" if mode == "all" else ""
        raise ConfigError(f"NEURON_CC_FLAGS has --auto-cast={mode}: neuronx-cc then computes {what} in --auto-cast-type "
                          f"(bf16 unless given), and --optim.precision={precision}'s fp32 arithmetic{which} would not "
                          f"be fp32: remove it (or use --auto-cast=none)")


# ----------------------------------------------------------------------------- peak FLOPs (MFU)

def matmul_shapes(cfg: Config, tp: int = 1) -> list[tuple[int, int, int]]:
    """(m, k, n) of every matmul one microbatch's forward and backward runs through the weights on
    one rank (x @ W.T, g @ W, g.T @ x per linear layer, TP-split). The attention scores are left
    out: counted in flops_per_token, they run at head_dim, slower, so can only lower the MFU."""
    m, rows = cfg.model, cfg.data.micro_batch * cfg.data.seq_len
    kv = sharding.kv_heads_per_rank(m, tp)
    linears = [(m.dim, (m.n_heads // tp + 2 * kv) * m.head_dim),        # qkv_proj (column)
               (m.n_heads // tp * m.head_dim, m.dim),                    # o_proj (row)
               (m.dim, 2 * m.ffn_dim // tp),                             # gate_up_proj (column)
               (m.ffn_dim // tp, m.dim),                                 # down_proj (row)
               (m.dim, sharding.padded_vocab(m.vocab_size, tp) // tp)]  # lm_head (vocab-parallel)
    return [shape for fan_in, fan_out in linears
            for shape in ((rows, fan_in, fan_out), (rows, fan_out, fan_in), (fan_out, rows, fan_in))]


def measure_matmul_flops(device: torch.device, dtype: torch.dtype,
                         shapes: list[tuple[int, int, int]] = ((1024, 1024, 1024),), trials: int = 3) -> float:
    """FLOP/s of the given (m, k, n) matmuls on this device and dtype, with the run's threads: their
    FLOPs over the sum of each one's best of `trials` times (a busy neighbour only slows a sample)."""
    g = torch.Generator().manual_seed(0)     # its own stream: the training RNG stays untouched
    flops = seconds = 0.0
    for m, k, n in dict.fromkeys(tuple(x) for x in shapes):
        a = torch.randn(m, k, generator=g).to(device, dtype)
        b = torch.randn(k, n, generator=g).to(device, dtype)
        reps = max(1, min(10, int(5e8 // (2 * m * k * n))))     # ~0.5 GFLOP per sample: long enough to time

        def run():
            c = a
            for _ in range(reps):
                c = a @ b
            return c[0, 0].float().item()    # .item() waits for the device
        run()
        best = float("inf")
        for _ in range(trials):
            t = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - t)
        flops, seconds = flops + 2.0 * m * k * n * reps, seconds + best
    return flops / seconds


def device_peak_flops(device: torch.device, dtype: torch.dtype, configured_tflops: float = 0.0,
                      datasheet=None, shapes: list[tuple[int, int, int]] | None = None) -> tuple[float, str]:
    """Peak FLOP/s of ONE device and where it comes from: the stated figure, on Trainium a NeuronCore's
    datasheet (the caller's planner.instances.Instance, the --parallel.instance type's row), else the
    measured rate of the model's own matmul shapes (a large square matmul is not the peak of this
    work: on 2 CPU cores the tiny model trained at 99-104% of one)."""
    name = str(dtype).replace("torch.", "")
    if configured_tflops > 0:
        return configured_tflops * 1e12, f"stated: --log.peak_tflops={configured_tflops:g}"
    if trainium(device) and datasheet is not None:
        peak = datasheet.fp32_flops if dtype == torch.float32 else datasheet.bf16_flops
        return peak, f"nominal: {datasheet.name} datasheet, {peak / 1e12:g} TFLOPS {name} per NeuronCore"
    shapes = list(shapes or ((1024, 1024, 1024),))
    flops = measure_matmul_flops(device, dtype, shapes)
    n_threads, one = torch.get_num_threads(), 0.0
    if device.type == "cpu" and n_threads > 1:
        # On a busy host the OpenMP team waits for a descheduled thread: 2 threads measured 0.002x
        # of one thread's rate, and MFU read 0.2% or 56% by luck. The run's threads do at least
        # what one of them does, so one thread's rate is the floor (0.05-0.2 s more at start).
        torch.set_num_threads(1)
        try:
            one = measure_matmul_flops(device, dtype, shapes)
        finally:
            torch.set_num_threads(n_threads)
    flops, threads = thread_floor(flops, one, n_threads) if device.type == "cpu" else (flops, "")
    n = len(set(map(tuple, shapes)))
    return flops, f"measured: the model's {n} matmul shapes in {name} on {device.type}{threads}"


def thread_floor(team: float, one: float, n_threads: int) -> tuple[float, str]:
    """The CPU peak: the run's n_threads' measured rate, or one thread's where that is higher (a
    busy host), and the words naming which threads measured it."""
    if one > team:
        return one, f", 1 thread (the run's {n_threads} threads measured {team / 1e9:.3g} GFLOP/s: a busy host)"
    return team, f", {n_threads} thread{'s' if n_threads > 1 else ''}"


def device_memory_gib(device: torch.device) -> float | None:
    """Peak memory of this device as it reports it (CPU: peak resident set of the process)."""
    try:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "xla":
            import torch_xla.core.xla_model as xm
            info = xm.get_memory_info(device)
            return info.get("peak_bytes_used", info.get("bytes_used", 0)) / 2**30 or None
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # Linux: KiB
    except Exception:            # a backend without memory stats: say nothing rather than guess
        return None
