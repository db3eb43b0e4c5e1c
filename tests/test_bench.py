"""bench.py's own plumbing (benchmarks/common.py, cli.py): what every benchmark writes, its help. The figures themselves
are ratios measured by `python bench.py WHICH`, never asserted here."""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import write_json  # noqa: E402


def test_results_are_strict_json(tmp_path):
    # `bench.py init` wrote NaN (Python's json default) for the one-step share of a run with no spikes;
    # a diverged run's losses are NaN or inf. jq, JavaScript's JSON.parse and Go refuse those tokens.
    path = tmp_path / "sub" / "r.json"
    write_json(str(path), {"loss": [2.5, math.nan, math.inf], "table": {"init": {"share": math.nan, "n": 0}},
                           "pair": (1.0, -math.inf), "name": "nan"})

    def refuse(token):
        raise ValueError(f"not JSON: {token}")
    assert json.loads(path.read_text(), parse_constant=refuse) == {
        "loss": [2.5, None, None], "table": {"init": {"share": None, "n": 0}}, "pair": [1.0, None], "name": "nan"}


def test_help_names_the_command_and_says_what_every_argument_is(capsys):
    # `python bench.py --help` said "usage: bench.py" and left WHICH, --threads and --out unexplained
    from benchmarks import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python bench.py"), out
    args = out.split("positional arguments:")[1]
    for name in ("WHICH", "-h, --help", "--threads THREADS", "--steps STEPS", "--out OUT", "--layers LAYERS", "--lr LR"):
        line = next(x for x in args.splitlines() if x.strip().startswith(name))
        assert line.strip() != name, f"{name} has no help: {out}"


@pytest.mark.slow      # ~4 s: transformers' import
def test_the_steps_compared_run_the_models_loss_as_the_trainer_does(monkeypatch):
    # benchmarks/step.py's "ours" and "bare step" called the model without grad_scale: in bf16 the fused
    # loss then takes the path the trainer never runs (rounded twice, no fp32 scale), so the step compared
    # with transformers', and the trainer's difference from the bare step, were not the trainer's model step.
    import torch
    import model
    from benchmarks.step import step_fns
    from configs import ModelConfig
    seen, forward = {}, model.Llama.forward

    def record(self, *args, **kwargs):
        scale = kwargs.get("grad_scale", args[4] if len(args) > 4 else None)
        seen[name] = None if scale is None else float(scale)
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(model.Llama, "forward", record)
    cfg = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=8)
    for name, step in step_fns(cfg, 2, 8, torch.bfloat16, ("ours", "bare step", "trainer")).items():
        step()
    assert seen == {"ours": 1 / 16, "bare step": 1 / 16, "trainer": 1 / 16}
