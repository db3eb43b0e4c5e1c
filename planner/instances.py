"""Trainium instance types, each one's figures per rank (INSTANCES), and how a layout falls on them: TP inside
one instance (NeuronLink), whole instances past one. The planner's table and rule, asked by cost.py and
report.py (plan.py), scripts/eks.py (a pod's devices and EFA) and train.py (the MFU's datasheet peak); it
imports only the config, so that eks.py can ask it without loading torch."""
from __future__ import annotations

from dataclasses import dataclass

from configs import Config, ConfigError, ModelConfig


@dataclass(frozen=True)
class Instance:
    """One Trainium instance type, per rank (one rank per NeuronCore; on trn2 per logical core)."""
    name: str
    cores: int                   # ranks per instance: torchrun --nproc_per_node
    hbm: int                     # bytes of device memory per core
    bf16_flops: float            # dense peak FLOP/s per core (MFU and the planner quote against it)
    fp32_flops: float
    link_bw: float               # bytes/s per core over NeuronLink, between the chips of one instance
    efa_bw: float                # bytes/s per instance over EFA, between instances
    devices: int = 16            # Trainium chips: the Neuron device plugin's aws.amazon.com/neuron (scripts/eks.py)
    efa: int = 8                 # EFA interfaces: the EFA device plugin's vpc.amazonaws.com/efa (scripts/eks.py)


# The Neuron docs (2.29, Trn1/Trn2 architecture): trn1 16 chips x 2 NeuronCore-v2, per chip 190 / 47.5
# TFLOPS bf16 / fp32, 32 GiB, NeuronLink-v2 384 GiB/s, EFA 800 Gbps (trn1n 1600). trn2 16 chips x 8
# NeuronCore-v3 at LNC=2: 4 logical cores a chip, 667 / 181 TFLOPS, 96 GiB, EFAv3 3.2 Tbps,
# NeuronLink-v3 1,024 GB/s a chip inside a trn2.48xlarge (trn2-arch).
INSTANCES = {
    "trn1": Instance("trn1.32xlarge", 32, 16 * 2**30, 95e12, 23.75e12, 192 * 2**30, 800e9 / 8, devices=16, efa=8),
    "trn1n": Instance("trn1n.32xlarge", 32, 16 * 2**30, 95e12, 23.75e12, 192 * 2**30, 1600e9 / 8, devices=16, efa=16),
    "trn2": Instance("trn2.48xlarge", 64, 24 * 2**30, 166.75e12, 45.25e12, 1.024e12 / 4, 3.2e12 / 8, devices=16, efa=16),
}


def tp_degrees(m: ModelConfig, hw: Instance) -> list[int]:
    """TP degrees inside one instance that keep whole attention heads and whole KV groups per rank."""
    return [t for t in (1, 2, 4, 8, 16, 32, 64) if t <= hw.cores
            and m.n_heads % t == 0 and (m.n_kv_heads % t == 0 or t % m.n_kv_heads == 0)]


def check_instances(cfg: Config, world: int) -> None:
    """The cost model prices TP on NeuronLink inside one instance and every other collective by how
    its groups fall on instances of hw.cores ranks (launch.sh and eks.py start that many per node):
    past one instance, the cores must be whole instances and TP must divide one."""
    hw, tp = INSTANCES[cfg.parallel.instance], cfg.parallel.tp
    if world > hw.cores and world % hw.cores:
        raise ConfigError(f"--parallel.cores={world} is {world / hw.cores:g} {hw.name} ({hw.cores} NeuronCores each): "
                          f"plan whole instances, e.g. --parallel.cores={world // hw.cores * hw.cores} or "
                          f"{-(-world // hw.cores) * hw.cores}, or at most {hw.cores} on one")
    if hw.cores % tp:
        raise ConfigError(f"--parallel.tp={tp} does not divide the {hw.cores} NeuronCores of a {hw.name}: a TP group "
                          f"runs on one instance's NeuronLink; pick --parallel.tp from "
                          + ", ".join(map(str, tp_degrees(cfg.model, hw))))
