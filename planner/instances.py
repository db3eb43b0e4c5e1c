"""How a layout falls on Trainium instances: TP inside one instance (NeuronLink), whole instances
past one. The planner's rule, asked by report.py (plan.py) and scripts/eks.py; it imports only the
config, so that eks.py can ask it without loading torch."""
from __future__ import annotations

from configs import INSTANCES, Config, ConfigError, Instance, ModelConfig


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
