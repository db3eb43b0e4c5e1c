"""Tied embeddings (Llama 3.2) stay ONE matrix from build to export (issue 26, defect 2).

Module.to_empty() from meta and .to() onto XLA make a new Parameter per module, so the head and
the embedding came out as two tensors that start equal and train apart, and the export (which
writes the embedding only, as HF does) was not the model that trained. Forward-only parity cannot
see it; three training steps and an export read back by transformers can. Here at TP=1 on CPU and
on XLA:CPU, in process; TP=2 and PP=2 (with the all-gather point-to-point XLA needs) run in the
gloo spawns of test_parallel.py (tp2dp2_sp1_tied) and test_pipeline.py (*_tied), which check the
same three things there.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import configs  # noqa: E402
import hf  # noqa: E402
import model as llama  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import train  # noqa: E402
from configs import ModelConfig  # noqa: E402
from conftest import seeded_model  # noqa: E402

SEQ, STEPS = 16, 3
HERE = os.path.dirname(os.path.abspath(__file__))


def tied_cfg() -> configs.Config:
    cfg = configs.tiny()
    cfg.model = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64,
                            max_seq_len=SEQ, tie_embeddings=True)
    cfg.data.seq_len, cfg.data.global_batch, cfg.data.micro_batch = SEQ, 4, 2
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-2, 1        # large steps: untied copies part visibly
    cfg.seed = 7
    return cfg


def batch(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 97, (4, SEQ), generator=g)
    return {"tokens": tokens, "targets": torch.randint(0, 97, (4, SEQ), generator=g),
            "positions": torch.arange(SEQ).expand(4, SEQ), "doc_ids": torch.zeros(4, SEQ, dtype=torch.long)}


def train3(model, device) -> None:
    """Three steps of train.train_step (two microbatches each) with our AdamW, as train.py runs them."""
    cfg, grid = tied_cfg(), parallel.Grid()
    opt = optim.build_optimizer(model, cfg, grid)
    assert [n for n, _ in opt.named].count("embed.weight") == 1 and "lm_head.weight" not in dict(opt.named)
    for step in range(STEPS):
        opt.set_lr(optim.lr_at(step, cfg.optim))
        b = {k: v.to(device) for k, v in batch(step).items()}
        micro = [{k: v[i:i + 2] for k, v in b.items()} for i in (0, 2)]
        train.train_step(model, opt, micro, grid, cfg, cut=lambda: train.sync(device))
        train.sync(device)


def is_tied(model) -> bool:
    return model.lm_head.weight is model.embed.weight and \
        (model.embed.weight.device.type == "xla" or model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr())


@pytest.fixture(scope="module")
def reference():
    """The model built tied on CPU by model.Llama (never moved: tied by construction), trained the same way."""
    cfg = tied_cfg()
    ref = llama.Llama(cfg.model).init_weights(cfg.seed)
    assert is_tied(ref)
    train3(ref, torch.device("cpu"))
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def run_tied(where: str, out: str) -> None:
    """build_model at TP=1 (to_empty from meta; on XLA the move too), check the tie and the
    optimizer's one copy, 3 steps, check the tie again; save the gathered weights and the trained
    model's logits on a held-out batch. XLA runs it in a child process (PJRT_DEVICE=CPU), as
    test_xla.py does: torch_xla must be imported before the first backward of a process."""
    if where == "xla":
        import torch_xla
        device = torch_xla.device()
    else:
        device = torch.device("cpu")
    cfg = tied_cfg()
    model = seeded_model(cfg, parallel.Grid(), device)
    tied = [is_tied(model)]
    train3(model, device)
    tied.append(is_tied(model))
    trained = {k: v.detach().cpu() for k, v in parallel.gather_full_state_dict(model, parallel.Grid()).items()}
    b = batch(99)
    with torch.no_grad():
        logits = model(b["tokens"].to(device), b["positions"].to(device)).float().cpu()
    torch.save({"tied": tied, "n_params": len(list(model.parameters())), "trained": trained, "logits": logits}, out)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["cpu", "xla"])
def test_tied_model_stays_tied_trains_and_exports(where, reference, tmp_path):
    """The head IS the embedding after build_model and after 3 steps, the optimizer holds it once,
    the trained weights equal the reference's, and the export read by transformers gives the
    trained model's logits."""
    out = str(tmp_path / "res.pt")
    if where == "xla":
        pytest.importorskip("torch_xla")
        code = f"import sys; sys.path.insert(0, {HERE!r}); import test_tied; test_tied.run_tied('xla', {out!r})"
        env = {**os.environ, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-5000:]
    else:
        run_tied("cpu", out)
    res = torch.load(out)
    cfg = tied_cfg()
    assert res["tied"] == [True, True], f"untied (after build, after {STEPS} steps): {res['tied']}"
    assert res["n_params"] == len(list(llama.Llama(cfg.model).parameters()))
    trained = res["trained"]
    assert torch.equal(trained["lm_head.weight"], trained["embed.weight"])
    tol = 1e-5 if where == "cpu" else 1e-4     # XLA:CPU fuses and orders its fp32 sums its own way
    for k, v in reference.items():             # an untied pair would be ~lr = 1e-2 off after a step
        err = (trained[k] - v).abs().max().item()
        assert err <= tol * v.abs().max().item(), f"{k} after {STEPS} steps differs from the reference by {err:.2e}"

    transformers = pytest.importorskip("transformers")
    hf.save_hf(trained, cfg.model, str(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        theirs = back(batch(99)["tokens"]).logits
    err = ((theirs - res["logits"]).abs().max() / res["logits"].abs().max()).item()
    assert err < 1e-5, f"the export's logits differ from the trained model's by {err:.2e} (relative)"


def test_check_tied_catches_an_untied_model():
    """check_tied, which move_model runs before train.py's first step, fails on the old behaviour."""
    cfg = tied_cfg()
    model = seeded_model(cfg, parallel.Grid())
    model.lm_head.weight = torch.nn.Parameter(model.embed.weight.detach().clone())
    with pytest.raises(RuntimeError, match="came untied"):
        parallel.check_tied(model)
    parallel.tie_embeddings(model)
    parallel.check_tied(model)
