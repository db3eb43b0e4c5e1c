"""hardware.py: "is this Trainium" answered in one place, and the paths that ask it.

PJRT_DEVICE is torch-xla's variable; each test sets it with monkeypatch (in-process torch_xla is
never imported here: its import sets PJRT_DEVICE for the whole session, see conftest.SESSION_ENV).
The other askers have their own tests: optim.check_rounding (test_optim's bf16_sr on Trainium),
hardware.pick_device (test_bad_input's PJRT_DEVICE torch-xla does not know), the health check's
XLA:CPU refusal (test_scripts)."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import configs  # noqa: E402
import hardware  # noqa: E402
from planner.instances import INSTANCES  # noqa: E402

XLA = torch.device("xla")       # a device type torch knows without torch_xla: nothing runs on it here


def test_trainium_is_an_xla_device_on_the_neuron_runtime(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    assert hardware.trainium(XLA) and hardware.trainium("xla") and not hardware.xla_on_cpu()
    assert not hardware.trainium(torch.device("cpu"))         # the CPU of a Trainium host is not a NeuronCore
    for pjrt in ("CPU", "TPU", "neuron"):                   # torch-xla refuses "neuron" (pick_device: one line)
        monkeypatch.setenv("PJRT_DEVICE", pjrt)
        assert not hardware.trainium(XLA)
    assert not hardware.xla_on_cpu()                        # neuron: not XLA:CPU either
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert hardware.xla_on_cpu() and hardware.xla_platform() == "CPU"
    monkeypatch.delenv("PJRT_DEVICE")                       # torch-xla's import would set CPU
    assert hardware.xla_on_cpu() and hardware.xla_platform() == ""


def test_an_unset_pjrt_device_is_neuron_where_torch_xla_picks_it(monkeypatch, tmp_path):
    """Unset, PJRT_DEVICE is NEURON to torch-xla where the Neuron venv's libneuronxla is installed (its import
    selects it: torch_xla/__init__.py _aws_ec2_inf_trn_init, runtime._maybe_select_default_device), and AWS's
    launch scripts never set it. hardware read "" there: pick_device('auto') ran a bare `torchrun train.py` on a
    trn1 on the CPU with gloo, unrefused, and the health check timed gloo. libneuronxla is not installed here:
    an empty package of that name stands in for it (only looked up, never imported)."""
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert hardware.xla_platform() == ""                        # no Neuron venv: torch-xla's import sets CPU
    (tmp_path / "libneuronxla").mkdir()
    (tmp_path / "libneuronxla" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert hardware.xla_platform() == "NEURON" and not hardware.xla_on_cpu() and hardware.trainium(XLA)
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import healthcheck
    assert healthcheck.resolve("auto") == "xla"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")                    # given, it is what counts
    assert hardware.xla_platform() == "CPU"


def test_the_mfu_peak_is_the_datasheets_on_trainium_only(monkeypatch):
    """hardware.device_peak_flops (the MFU's peak): a NeuronCore's figure from the instance table (the
    caller's row), not measured; an XLA device elsewhere is measured (not here: that needs torch_xla),
    as is the CPU."""
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    assert hardware.device_peak_flops(XLA, torch.bfloat16, datasheet=INSTANCES["trn1"]) == (
        95e12, "nominal: trn1.32xlarge datasheet, 95 TFLOPS bfloat16 per NeuronCore")
    assert hardware.device_peak_flops(XLA, torch.float32, datasheet=INSTANCES["trn2"])[0] == 45.25e12
    shapes = [(64, 64, 64)]
    assert hardware.device_peak_flops(torch.device("cpu"), torch.float32, shapes=shapes)[1].startswith("measured")


@pytest.mark.parametrize("pjrt", ["CPU", None])
def test_multi_process_xla_off_trainium_is_refused_before_any_group(monkeypatch, pjrt):
    """hardware.pick_device for a world of 2: XLA:CPU (set, or torch-xla's default when unset) has no collectives
    between processes; refused with the fix before torch_xla's import (test_bad_input checks that) and any group."""
    if pjrt is None:
        monkeypatch.delenv("PJRT_DEVICE", raising=False)
    else:
        monkeypatch.setenv("PJRT_DEVICE", pjrt)
    with pytest.raises(configs.ConfigError, match=r"multi-process XLA needs Trainium \(PJRT_DEVICE=NEURON\)"):
        hardware.pick_device("xla" if pjrt is None else "auto", world=2)
    assert not dist.is_initialized()


def test_functionalization_must_be_on_and_on_trainium_said_so(monkeypatch):
    """hardware.check_functionalization, read as torch-xla's GetEnvBool reads it: "true", "false", else C's atoi.
    Unset is on (torch-xla's default) except on Trainium, where Neuron's default is off; set off anywhere on XLA, the
    model's last-dimension splits return wrong data (pytorch/xla#8640; test_bad_input runs train.py with it)."""
    for pjrt, value, refused in [("NEURON", None, True), ("CPU", None, False), ("NEURON", "0", False),
                                 ("NEURON", "false", False), ("CPU", "1", True), ("NEURON", "true", True),
                                 ("CPU", "-1", True), ("CPU", " 7x", True), ("CPU", "TRUE", False), ("CPU", "", False),
                                 ("CPU", "+0", False), ("CPU", "no", False)]:
        monkeypatch.setenv("PJRT_DEVICE", pjrt)
        if value is None:
            monkeypatch.delenv("XLA_DISABLE_FUNCTIONALIZATION", raising=False)
        else:
            monkeypatch.setenv("XLA_DISABLE_FUNCTIONALIZATION", value)
        if refused:
            with pytest.raises(configs.ConfigError, match="export XLA_DISABLE_FUNCTIONALIZATION=0"):
                hardware.check_functionalization()
        else:
            hardware.check_functionalization()


def test_auto_cast_that_would_undo_the_precisions_fp32_is_refused_on_trainium(monkeypatch):
    """hardware.check_auto_cast: neuronx-cc's --auto-cast in NEURON_CC_FLAGS (scripts/env.sh appends
    NEURON_CC_EXTRA_FLAGS to it), the right-most one, either spelling. "all" computes every FP32 operation in
    bf16 (every mode's update, loss, token count and resume broadcast); "matmult" an fp32 run's matmuls. Was
    accepted: the run said fp32 (or mixed) and computed in bf16. Off Trainium the variable does nothing."""
    base = "--model-type=transformer --distribution-strategy=llm-training --cache_dir=/var/tmp/c"
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    for flags, precision, refused in [("", "fp32", False), (base, "fp32", False), (f"{base} --auto-cast=none", "fp32", False),
                                      (f"{base} --auto-cast=all", "bf16", True), (f"{base} --auto-cast all", "mixed", True),
                                      (f"{base} --auto-cast=matmult --auto-cast-type=tf32", "fp32", True),
                                      (f"{base} --auto-cast=matmult", "bf16", False),
                                      (f"{base} --auto-cast=all --auto-cast=none", "fp32", False),
                                      (f"{base} --auto-cast-type=fp16", "fp32", False)]:
        monkeypatch.setenv("NEURON_CC_FLAGS", flags)
        if refused:
            with pytest.raises(configs.ConfigError, match=f"--auto-cast=(all|matmult).*precision={precision}"):
                hardware.check_auto_cast(precision, XLA)
        else:
            hardware.check_auto_cast(precision, XLA)
    monkeypatch.setenv("NEURON_CC_FLAGS", f"{base} --auto-cast=all")
    hardware.check_auto_cast("fp32", torch.device("cpu"))
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    hardware.check_auto_cast("fp32", XLA)
