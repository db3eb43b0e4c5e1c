"""The hardware a run meets: the device this process runs on, decided once (pick_device), and whether
it is Trainium, the one place that reads torch-xla's PJRT_DEVICE for it. train.py decides first;
parallel.py (XLA's collectives), optim.py (the bf16 rounding), monitor.py (the MFU peak) and
scripts/healthcheck.py ask here rather than reading the variable each in its own way.
"""
from __future__ import annotations

import os

import torch

from configs import ConfigError


def xla_platform() -> str:
    """The PJRT platform torch-xla runs on, exactly as torch-xla reads it: "NEURON" on Trainium, "CPU" for
    XLA:CPU (the tests), "" when unset (its import then sets CPU). It accepts no other spelling: "neuron"
    or "cpu" is "No PjRtPlugin registered", refused by pick_device before any work."""
    return os.environ.get("PJRT_DEVICE", "")


def xla_on_cpu() -> bool:
    """XLA runs on the host's CPU (set or torch-xla's default): one process, no collectives between them."""
    return xla_platform() in ("", "CPU")


def trainium(device: torch.device | str) -> bool:
    """Whether `device` is a NeuronCore: an XLA device with the Neuron runtime underneath."""
    return torch.device(device).type == "xla" and xla_platform() == "NEURON"


def pick_device(name: str) -> torch.device:
    """The run's device, decided here once and passed down: xla when one exists or is asked for, else cuda, else cpu."""
    # An XLA device "is present" when PJRT_DEVICE names one (the Neuron venv sets NEURON; tests set
    # CPU). Read it BEFORE importing torch_xla: the import itself defaults PJRT_DEVICE to CPU.
    if name == "xla" or (name == "auto" and xla_platform()):
        try:
            import torch_xla
        except ImportError:
            if name == "xla":
                raise ConfigError("--device=xla needs torch_xla (the Neuron venv has it)") from None
        else:   # a device named but missing is refused, never run on the CPU instead: "No PjRtPlugin
            try:    # registered for: X", NEURON without its runtime ("No module named 'libneuronxla'"), TPU without libtpu
                return torch_xla.device()
            except (RuntimeError, ImportError, OSError) as e:
                raise ConfigError(f"PJRT_DEVICE={xla_platform()!r}: {str(e).split('. ')[0]}; "
                                  f"use NEURON on Trainium (its venv), CPU for XLA:CPU, or unset it") from None
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name == "cuda":
        raise ConfigError("--device=cuda but no CUDA device is visible")
    return torch.device("cpu")
