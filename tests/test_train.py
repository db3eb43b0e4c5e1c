"""train.py end to end: a real subprocess run on the embedded corpus whose loss falls."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_train(tmp_path, *args, timeout=600, env=None):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path}/out",
           f"--ckpt.dir={tmp_path}/out/ckpt", f"--log.tensorboard={tmp_path}/out/tb", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})})


def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"step\s+\d+ \| loss ([0-9.]+)", stdout)]


def test_tiny_training_run_loss_falls(tmp_path):
    # A smaller tiny model for speed; the tokenizer is trained on the stdlib corpus and cached in
    # the repository's .cache (shared with `make train`), so only the first run pays for it.
    r = run_train(tmp_path, "--model.n_layers=2", "--model.dim=128", "--model.n_heads=4", "--model.n_kv_heads=2",
                  "--model.ffn_dim=352", "--data.seq_len=128", "--data.global_batch=8", "--data.micro_batch=4",
                  "--optim.max_steps=40", "--optim.warmup_steps=5", "--optim.decay_steps=35", "--optim.lr=3e-3",
                  "--log.interval=5", "--log.eval_interval=20", "--log.eval_windows=2", "--log.sample_tokens=16")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ls = losses(r.stdout)
    assert len(ls) == 8, r.stdout
    assert ls[-1] < ls[0] - 1.0, ls                     # from ~ln(4096)=8.3 down by well over a nat
    assert "val loss" in r.stdout and "sample:" in r.stdout
    assert os.path.exists(f"{tmp_path}/out/hf/model.safetensors")
