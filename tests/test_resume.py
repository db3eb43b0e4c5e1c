"""Resume anywhere, exactly, and never lose the user's work (issue 17): a run moved across
TP, PP, DP and ZeRO-1 layouts equals an uninterrupted one, with real torchrun processes."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402
import configs  # noqa: E402
import data  # noqa: E402

ARGS = ["--model.n_layers=2", "--model.dim=32", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=64",
        "--data.seq_len=32", "--model.max_seq_len=32", "--data.global_batch=4", "--data.micro_batch=1",
        "--optim.warmup_steps=2", "--optim.decay_steps=10", "--optim.precision=fp32", "--ckpt.interval=4",
        "--ckpt.keep=5", "--device=cpu", "--log.interval=1", "--log.eval_interval=0", "--log.sample_tokens=0",
        "--log.tensorboard="]


def train(out: Path, *extra, nproc: int = 1, timeout: int = 300, env=None) -> subprocess.CompletedProcess:
    args = [str(ROOT / "train.py"), f"--out_dir={out}", f"--ckpt.dir={out}/ckpt", *ARGS, *extra]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    p = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"train.py did not finish in {timeout} s:\n{stdout[-2000:]}\n{stderr[-3000:]}")
    r = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return r


def ok(r):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def losses(stdout: str) -> dict[int, str]:
    return {int(s): x for s, x in re.findall(r"step\s+(\d+) \| loss ([0-9.]+)", stdout)}


def assert_close(a: dict, b: dict, what: str):
    assert sorted(a) == sorted(b), what
    for k in a:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=1e-5, atol=1e-5, msg=f"{what}: {k}")


def full_optim(d: Path) -> dict:
    """Every per-parameter optimizer tensor of a checkpoint at TP=1, whatever PP and ZeRO-1 saved it."""
    layout = json.loads((d / "meta.json").read_text())["layout"]
    assert layout["tp"] == 1
    out = {}
    for p in range(layout["pp"]):
        src = checkpoint.SavedOptim(d, f"tp00_pp{p:02d}", layout, d.name)
        out.update({k: src[k] for k in src})
    return out


def data_states(d: Path) -> list:
    """Each saved DP rank's loader state, as Checkpointer reads them (the rank at pp 0, tp 0)."""
    layout = json.loads((d / "meta.json").read_text())["layout"]
    return [torch.load(d / f"rank{r * layout['tp']:05d}.pt", weights_only=False)["data"] for r in range(layout["dp"])]


def global_batches(cfg: configs.Config, dp: int, n: int, states=None) -> list[torch.Tensor]:
    tok = data.build_tokenizer(cfg.data, cfg.model.vocab_size)
    loaders = [data.PackedLoader(cfg.data, tok, r, dp, prefetch=0) for r in range(dp)]
    for x in loaders if states is not None else ():
        x.load_state_dict(states)
    accum = cfg.data.global_batch // (dp * cfg.data.micro_batch)
    return [torch.cat([next(x)["tokens"] for x in loaders for _ in range(accum)]) for _ in range(n)]


def test_resume_across_tp_pp_dp_zero1_equals_uninterrupted(tmp_path):
    """4 steps at TP=2 x DP=2, 4 at PP=2 x DP=2 with ZeRO-1, 4 in one process == 12 uninterrupted
    steps of one process: weights and optimizer state at each resume point and at the end (fp32,
    1e-5), the data positions exactly, and the global batches after each resume torch.equal."""
    ref = ok(train(tmp_path / "ref", "--optim.max_steps=12"))
    a = ok(train(tmp_path / "run", "--optim.max_steps=4", "--tp=2", "--dp=2", nproc=4))
    b = ok(train(tmp_path / "run", "--optim.max_steps=8", "--pp=2", "--dp=2", "--parallel.zero1=true", nproc=4))
    c = ok(train(tmp_path / "run", "--optim.max_steps=12"))
    assert "resuming from" in b.stdout and "resuming from" in c.stdout
    assert "'tp': 2" in b.stdout and "'zero1': True" in c.stdout            # both resumes changed layout
    cfg = configs.from_args(ARGS)
    m = cfg.model
    for step in (4, 8, 12):
        want, got = (tmp_path / x / "ckpt" / f"step_{step:08d}" for x in ("ref", "run"))
        assert_close(checkpoint.full_model_state(want, m), checkpoint.full_model_state(got, m), f"weights {step}")
        if step > 4:                                                     # (step 4 is TP=2: compared at 12)
            assert_close(full_optim(want), full_optim(got), f"optimizer state {step}")
        # The same windows consumed from every stream: the positions, merged over DP ranks, are equal.
        merged = lambda d: {s: p for st in data_states(d) for s, p in st["streams"].items()}
        assert merged(want) == merged(got), step
    assert {**losses(a.stdout), **losses(b.stdout), **losses(c.stdout)} == losses(ref.stdout)
    # The global batches after each resume, built from the saved positions at the new DP degree
    # exactly as train.py does, are the uninterrupted run's.
    straight = global_batches(cfg, 1, 12)
    run = tmp_path / "run" / "ckpt"
    after4 = global_batches(cfg, 2, 4, data_states(run / "step_00000004"))
    after8 = global_batches(cfg, 1, 4, data_states(run / "step_00000008"))
    assert all(torch.equal(x, y) for x, y in zip(after4 + after8, straight[4:]))
