"""checkpoint.py: async save equals what was saved, atomicity under SIGKILL mid-write, corruption
detection with fall-back, keep-K, config mismatch, fresh start, fault injection, resharding
TP=2 x DP=2 <-> one process with the real parallel.py and optim.py (gloo), and HF export.

Multi-rank bookkeeping (markers of every rank, ZeRO-1 shards) is also exercised without processes:
the ranks of one checkpoint are written one after another by Checkpointers with different Grids
(rank 0 last, since its writer waits for every other rank's marker).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402
import ckptdir  # noqa: E402
import ckptsave  # noqa: E402
import faults  # noqa: E402
import configs  # noqa: E402
import model as llama  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import pipeline  # noqa: E402
import reshard  # noqa: E402
import sharding  # noqa: E402
from checkpoint import Checkpointer, CheckpointError  # noqa: E402
from conftest import seeded_model  # noqa: E402
from faults import Faults  # noqa: E402
from gloo_spawn import run_train, spawn  # noqa: E402


def tiny_cfg(ckpt_dir, **model) -> configs.Config:
    cfg = configs.Config()
    # vocab 97: not a multiple of TP=2, so resharding goes through the vocab padding.
    cfg.model = configs.ModelConfig(**{**dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                              ffn_dim=64, max_seq_len=32), **model})
    cfg.data.seq_len, cfg.data.global_batch, cfg.data.micro_batch = 16, 4, 2
    cfg.ckpt.dir = str(ckpt_dir)
    return cfg


def random_step(model, opt, seed: int, grid=None):
    """One optimizer step on seeded random gradients (full-shape, then this rank's TP shard), so
    that every layout applies the very same update."""
    grid = grid or parallel.Grid()
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in llama.Llama(model.cfg).named_parameters()}
    for name, p in model.named_parameters():
        full = torch.randn(shapes[name], generator=g)
        p.grad = sharding.cut(name, full, model.cfg, grid.tp, grid.tp_rank).to(p.dtype, copy=True)
    opt.step()
    opt.zero_grad()


def trained(cfg, steps=2):
    model = seeded_model(cfg, parallel.Grid(), dtype=torch.bfloat16 if cfg.optim.precision.startswith("bf16") else None)
    opt = optim.build_optimizer(model, cfg)
    for s in range(steps):
        random_step(model, opt, seed=s)
    return model, opt


def assert_state_equal(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), (path, a.dtype, b.dtype)
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_state_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b), path
    else:
        assert a == b, path


def clone(sd):
    return {k: v.clone() if isinstance(v, torch.Tensor) else clone(v) if isinstance(v, dict) else v
            for k, v in sd.items()}


# ----------------------------------------------------------------------------- save / load

@pytest.mark.parametrize("defer,precision", [(False, "fp32"), (True, "fp32"), (True, "bf16")])
def test_async_save_then_load_equals(tmp_path, capsys, monkeypatch, defer, precision):
    """defer: train.py's save, whose copy of the weights and moments runs in the writer thread until
    before_update(), which training calls before the optimizer changes them. bf16: that copy goes
    through an int16 view (numpy has no bfloat16); the file holds bf16 tensors all the same."""
    cfg = tiny_cfg(tmp_path / "ckpt")
    cfg.optim.precision = precision
    model, opt = trained(cfg)
    ck = Checkpointer(cfg)
    assert ck.load_latest() is None
    assert "no checkpoint directory" in capsys.readouterr().out
    random.seed(5), np.random.seed(5), torch.manual_seed(5)
    rng = checkpoint.rng_state()
    want_model, want_opt = clone(model.state_dict()), clone(opt.state_dict())
    data = {"epoch": 1, "pos": 17, "buffer": [3, 1, 4, 1, 5]}
    # The writer thread waits at a gate until training has changed everything it was given.
    gate, write_file = threading.Event(), ckptsave.write_file
    monkeypatch.setattr(ckptsave, "write_file", lambda *a, **k: (gate.wait(60), write_file(*a, **k))[1])
    # The deferred copy starts late (a busy host): before_update() must wait for it, or the update lands in the save.
    copy, late = ckptsave.Writer._copy, threading.Event()

    def late_copy(writer, *args):
        if threading.current_thread() is writer._thread and not late.is_set():
            time.sleep(1)
            late.set()
        return copy(writer, *args)
    monkeypatch.setattr(ckptsave.Writer, "_copy", late_copy)
    ck.save(2, model.state_dict(), opt.state_dict(), data=data, extra={"tokens_seen": 128}, defer_copy=defer)
    assert ck.in_flight and not (tmp_path / "ckpt" / "step_00000002" / "rank00000.done").exists()
    ck.before_update()
    assert ck.in_flight         # before_update() waited for the copy only: the write is still held at the gate
    random_step(model, opt, seed=99)
    data["buffer"].append(9)
    draws = (random.random(), np.random.rand(), torch.rand(3))
    gate.set()
    ck.close()
    assert ck.stats["blocked_s"] >= 0 and ck.stats["write_s"] > 0

    loaded = Checkpointer(cfg).load_latest()
    assert loaded.step == 2 and loaded.extra == {"tokens_seen": 128}
    assert_state_equal(want_model, loaded.model)
    assert_state_equal(want_opt, loaded.optim)
    assert loaded.data == {"epoch": 1, "pos": 17, "buffer": [3, 1, 4, 1, 5]}
    assert loaded.meta["config"]["model"]["dim"] == 32 and loaded.meta["layout"]["tp"] == 1
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_00000002"
    # the rank's staging folder (.tmp-rank00000/) is gone once its files are renamed in: nothing left behind
    assert not [p.name for p in (tmp_path / "ckpt" / "step_00000002").iterdir() if p.name.startswith(".")]
    # Every RNG stream continues exactly where it was at save time.
    checkpoint.set_rng_state(loaded.rng)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[:2] == again[:2] and torch.equal(draws[2], again[2])
    assert_state_equal(rng["torch"], loaded.rng["torch"])


def test_keep_last_k(tmp_path):
    cfg = tiny_cfg(tmp_path)
    cfg.ckpt.keep = 2
    model, opt = trained(cfg, steps=1)
    ck = Checkpointer(cfg)
    for step in range(1, 6):
        ck.save(step, model.state_dict(), opt.state_dict())
    ck.close()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000005"]
    assert (tmp_path / "latest").read_text() == "step_00000005"


@pytest.mark.parametrize("damage", ["flip", "truncate", "marker"])
def test_damaged_newest_is_skipped(tmp_path, capsys, damage):
    cfg = tiny_cfg(tmp_path)
    cfg.ckpt.async_save = False
    model, opt = trained(cfg, steps=1)
    ck = Checkpointer(cfg)
    ck.save(1, model.state_dict(), opt.state_dict())
    want = clone(model.state_dict())
    random_step(model, opt, seed=7)
    ck.save(2, model.state_dict(), opt.state_dict())
    newest = tmp_path / "step_00000002"
    f = newest / "model_tp00_pp00.pt"
    raw = bytearray(f.read_bytes())
    if damage == "flip":                 # same size, one bit changed in the tensor data
        raw[len(raw) // 2] ^= 0x01
        f.write_bytes(raw)
    elif damage == "truncate":
        f.write_bytes(raw[: len(raw) // 2])
    else:
        (newest / "rank00000.done").unlink()
    capsys.readouterr()
    loaded = Checkpointer(cfg).load_latest()
    out = capsys.readouterr().out
    assert loaded.step == 1
    assert_state_equal(want, loaded.model)
    reason = {"flip": "crc32", "truncate": "truncated", "marker": "rank 0's completion marker is missing"}[damage]
    assert "skipping step_00000002" in out and reason in out, out
    # Said loudly, with the steps lost; set aside and kept, so that a new save of step 2 starts in a
    # new folder; the good checkpoint is untouched.
    assert "WARNING: step_00000002 is damaged" in out and "1 step (2 to 2) will be trained again" in out, out
    kept = list(tmp_path.glob("step_00000002.bad*"))
    assert not newest.exists() and len(kept) == 1 and (kept[0] / "model_tp00_pp00.pt").exists()
    ck2 = Checkpointer(cfg)
    assert ck2.load_latest().step == 1
    ck2.save(2, model.state_dict(), opt.state_dict())
    assert Checkpointer(cfg).load_latest().step == 2

def test_a_ranks_files_are_on_disk_whole_before_its_completion_marker(tmp_path, monkeypatch):
    """After a power loss, a step folder whose markers are all there is resumed from: every file a marker vouches
    for must be on the disk whole. So each file's bytes are flushed and fsynced (the size on disk at the fsync is
    the file's whole size) before the rename that gives it its name, the step folder is fsynced after the renames
    (which makes them durable), and only then is the marker written. The real calls, in the order they were made."""
    cfg = tiny_cfg(tmp_path / "ckpt")
    cfg.ckpt.async_save = False
    model, opt = trained(cfg)
    calls, fsync, replace = [], os.fsync, os.replace

    def spy_fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        return fsync(fd)

    def spy_replace(a, b):
        calls.append(("replace", str(a), str(b)))
        return replace(a, b)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    ck = Checkpointer(cfg)
    ck.save(2, model.state_dict(), opt.state_dict(), data={"pos": 1})
    ck.close()
    step = tmp_path / "ckpt" / "step_00000002"
    marker = [i for i, c in enumerate(calls) if c[0] == "replace" and c[2] == str(step / "rank00000.done")]
    assert len(marker) == 1, calls
    before = calls[:marker[0]]
    files = sorted(n for n in os.listdir(step) if n not in ("rank00000.done", "manifest.json"))
    assert {"meta.json", "model_tp00_pp00.pt", "optim_tp00_pp00.pt", "rank00000.pt"} <= set(files), files
    renames = []
    for name in files:
        tmp = str(step / ".tmp-rank00000" / name)
        synced = [i for i, c in enumerate(before) if c[:2] == ("fsync", tmp)]
        renamed = [i for i, c in enumerate(before) if c == ("replace", tmp, str(step / name))]
        assert len(synced) == 1 and len(renamed) == 1 and synced[0] < renamed[0], (name, before)
        assert before[synced[0]][2] == (step / name).stat().st_size > 0, (name, before[synced[0]])
        renames.append(renamed[0])
    folder = [i for i, c in enumerate(before) if c[:2] == ("fsync", str(step))]
    assert folder and folder[-1] > max(renames), before      # the folder synced after the last rename
    assert Checkpointer(cfg).load_latest().step == 2



@pytest.mark.slow
def test_kill_during_write_keeps_previous(tmp_path, capsys):
    """A real SIGKILL in the middle of the writer thread's write of a large file (NANOTRN_FAULT
    =0:2:save): step 2 stays incomplete and is skipped, step 1 loads intact."""
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        import configs, checkpoint
        cfg = configs.Config(); cfg.ckpt.dir = {str(tmp_path)!r}
        ck = checkpoint.Checkpointer(cfg)
        state = lambda s: {{"big": torch.arange(4_000_000, dtype=torch.float32) + s}}   # 16 MB
        ck.save(1, state(1), data={{"pos": 1}})
        ck.wait()
        ck.save(2, state(2), data={{"pos": 2}})
        ck.close()
        print("not reached")
    """)
    env = {**os.environ, "NANOTRN_FAULT": "0:2:save", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert "not reached" not in r.stdout and "NANOTRN_FAULT: rank 0 writing model_tp00_pp00.pt of step 2" in r.stderr
    partial = tmp_path / "step_00000002" / ".tmp-rank00000" / "model_tp00_pp00.pt"
    assert 0 < partial.stat().st_size < (tmp_path / "step_00000001" / "model_tp00_pp00.pt").stat().st_size
    assert (tmp_path / "latest").read_text() == "step_00000001"

    cfg = configs.Config()
    cfg.ckpt.dir = str(tmp_path)
    loaded = Checkpointer(cfg).load_latest(load_optim=False)
    out = capsys.readouterr().out
    assert "skipping step_00000002: no completion marker from rank 0" in out
    assert loaded.step == 1 and loaded.data == {"pos": 1}
    assert torch.equal(loaded.model["big"], torch.arange(4_000_000, dtype=torch.float32) + 1)


def test_model_config_mismatch_lists_differences(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path)
    cfg.data.tokenizer = "/gone/llama3"          # the folder --init_from set it to, deleted since
    model, opt = trained(cfg, steps=1)
    ck = Checkpointer(cfg)
    ck.save(1, model.state_dict(), opt.state_dict())
    ck.close()
    other = tiny_cfg(tmp_path, dim=64, n_layers=3, checkpointing="full")
    with pytest.raises(CheckpointError) as e:
        Checkpointer(other).load_latest()
    msg = str(e.value)
    assert "model.dim: checkpoint 32, now 64" in msg and "model.n_layers: checkpoint 2, now 3" in msg
    assert "checkpointing" not in msg           # activation checkpointing does not touch weights
    assert not list(tmp_path.glob("*.bad*"))      # nothing set aside or lost
    # Other sections may change on resume; they are reported, not refused.
    other = tiny_cfg(tmp_path)
    other.optim.lr = 5e-4
    assert Checkpointer(other).load_latest().step == 1
    out = capsys.readouterr().out
    assert "optim.lr: checkpoint 0.001, now 0.0005" in out
    # None given: the resume takes the run's own, kept in ckpt/tokenizer: no change (it said "checkpoint '/gone/llama3', now ''")
    assert "data.tokenizer" not in out, out
    other.data.tokenizer = "/mine/tok.model"     # one given: train.py compares it with the kept one; said here
    Checkpointer(other).load_latest()
    assert "data.tokenizer: checkpoint '/gone/llama3', now '/mine/tok.model'" in capsys.readouterr().out


def test_fresh_start_and_refusal_to_overwrite(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path / "nothing_here")
    assert Checkpointer(cfg).load_latest() is None
    out = capsys.readouterr().out
    assert "no checkpoint directory" in out and "starting fresh" in out
    assert not (tmp_path / "nothing_here").exists()
    cfg = tiny_cfg(tmp_path)
    ck = Checkpointer(cfg)
    ck.save(3, {"w": torch.ones(2)})
    ck.close()
    cfg.ckpt.resume = False
    with pytest.raises(CheckpointError, match="already holds checkpoints.*--ckpt.start_fresh to move them aside"):
        Checkpointer(cfg)


def test_save_errors_surface(tmp_path):
    cfg = tiny_cfg(tmp_path)
    ck = Checkpointer(cfg)
    with pytest.raises(CheckpointError, match="JSON-able"):
        ck.save(1, {"w": torch.ones(2)}, extra={"bad": torch.ones(1)})
    (tmp_path / "step_00000002").write_text("a file where the directory should be")
    ck.save(2, {"w": torch.ones(2)})             # the writer thread fails...
    # ...and the training thread hears of it as it was raised: train.py tells a rank's own SaveFailed (a full
    # disk) at once, and a wrapped one would read "the background save of step 2 failed: SaveFailed('...')"
    with pytest.raises(checkpoint.SaveFailed, match="^could not write the checkpoint of step 2"):
        ck.close()


def test_an_export_that_fills_the_disk_is_one_line_and_leaves_the_earlier_export(tmp_path, monkeypatch):
    """checkpoint.py export --overwrite (train.py's final export is the same hf.save_hf) on a disk
    that fills up: one line saying so, and the earlier export exactly as it was. It removed the
    earlier export's files first and then wrote until the disk was full: safetensors' traceback,
    and a folder of half an export (measured: a model beside a truncated tokenizer.json). Here the
    earlier export is bf16 and the new one fp32, twice its size: it did not fit even in its room."""
    cfg = tiny_cfg(tmp_path / "ck")
    model, opt = trained(cfg, steps=1)
    ck = Checkpointer(cfg)
    ck.save(1, model.state_dict(), opt.state_dict())
    ck.wait()
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    try:
        out = small / "hf"
        checkpoint.main(["export", "--dtype=bf16", str(tmp_path / "ck"), str(out)])
        earlier = {p.name: p.read_bytes() for p in out.iterdir()}
        random_step(model, opt, seed=1)
        ck.save(2, model.state_dict(), opt.state_dict())
        ck.close()
        if mounted:           # all but 8 KiB taken: the fp32 model (about 100 KiB) does not fit
            (small / "filler").write_bytes(b"\0" * (os.statvfs(small).f_bavail * os.statvfs(small).f_frsize - 8192))
        else:                 # simulated where mounting is not allowed: the model's write fails
            def full(*a, **k):
                raise OSError(28, "No space left on device")
            monkeypatch.setattr("safetensors.torch.save_file", full)
        with pytest.raises(SystemExit) as e:
            checkpoint.main(["export", "--overwrite", str(tmp_path / "ck"), str(out)])
        assert f"could not write the export into {out}: disk full" in str(e.value.code), e.value.code
        assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier       # as it was, nothing left over
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)


def test_export_says_which_newer_checkpoint_it_passed_over_and_why(tmp_path, capsys):
    """checkpoint.py export of a directory whose newest checkpoint is damaged (or still being saved)
    exports the newest valid one and says which it passed over and why: it printed only 'exported
    .../step_00000001', a model older than the newest, without a word about step 2."""
    cfg = tiny_cfg(tmp_path / "ck")
    model, opt = trained(cfg, steps=1)
    ck = Checkpointer(cfg)
    for step in (1, 2):
        ck.save(step, model.state_dict(), opt.state_dict())
    ck.close()
    f = tmp_path / "ck" / "step_00000002" / "model_tp00_pp00.pt"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    f.write_bytes(raw)
    checkpoint.main(["export", str(tmp_path / "ck"), str(tmp_path / "hf")])
    out, err = capsys.readouterr()
    assert "skipping step_00000002: model_tp00_pp00.pt: crc32" in err, err
    assert f"exported {tmp_path}/ck/step_00000001 to {tmp_path}/hf" in out, out
    # Readable as the export's other files are (the umask's): safetensors 0.8 writes its file 0600,
    # which another user of a shared file system (a serving job) could not read.
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes


def test_export_of_a_run_without_bos_ships_a_tokenizer_without_it(tmp_path, capsys):
    """checkpoint.py export takes --data.bos from the checkpoint's config: a run that started no document with
    BOS exports a tokenizer that adds none (AutoTokenizer's ids are the run's), as train.py's own export does."""
    import sentencepiece as spm
    import transformers
    import data
    text = [f"line {i}: the quick brown fox jumps over the lazy dog {i * 7}" for i in range(200)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(tmp_path / "sp"), vocab_size=90,
                                   model_type="bpe", unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    cfg = tiny_cfg(tmp_path / "ck")
    cfg.data.bos = False
    tok = data.load_tokenizer(str(tmp_path / "sp.model"))
    checkpoint.keep_tokenizer(tok, str(tmp_path / "ck" / "tokenizer"))
    ck = Checkpointer(cfg)
    ck.save(1, llama.Llama(cfg.model).init_weights(0).state_dict())
    ck.close()
    checkpoint.main(["export", str(tmp_path / "ck"), str(tmp_path / "hf")])
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto("the lazy dog")["input_ids"] == tok.encode("the lazy dog") and tok.bos_id == 1


def test_export_into_a_folder_holding_only_a_killed_exports_leftover_needs_no_overwrite(tmp_path, capsys):
    """checkpoint.py export after a killed one (its HF_OUT_DIR holds only .export.tmp): no --overwrite asked."""
    import hf
    cfg = tiny_cfg(tmp_path / "ck")
    ck = Checkpointer(cfg)
    ck.save(1, llama.Llama(cfg.model).init_weights(0).state_dict())
    ck.close()
    (tmp_path / "hf" / hf.EXPORT_TMP).mkdir(parents=True)
    checkpoint.main(["export", str(tmp_path / "ck"), str(tmp_path / "hf")])
    assert "exported" in capsys.readouterr().out and (tmp_path / "hf" / "model.safetensors").is_file()


def test_ls_lists_the_folders_set_aside_after_the_step_folders(tmp_path, capsys):
    """A user looking for their work sees what resume set aside (kept, never deleted) and what
    --ckpt.start_fresh moved: `ls` listed only the step folders, and with none said 'holds no checkpoint'."""
    cfg = tiny_cfg(tmp_path / "ck")
    model, opt = trained(cfg, steps=1)
    ck = Checkpointer(cfg)
    ck.save(1, model.state_dict(), opt.state_dict())
    ck.close()
    for name in ("step_00000003.bad1795865382362535150", "step_00000002.incomplete1795865382362535150",
                 "previous_20261128-111111_42"):
        (tmp_path / "ck" / name).mkdir()
    checkpoint.main(["ls", str(tmp_path / "ck")])
    assert capsys.readouterr().out.splitlines() == [
        "step_00000001  ok",                                       # as before (issue 25 keeps ls's output)
        "step_00000003.bad1795865382362535150  set aside: damaged; kept, never resumed from",
        "step_00000002.incomplete1795865382362535150  set aside: interrupted; kept, never resumed from",
        "previous_20261128-111111_42  set aside: moved by --ckpt.start_fresh; kept, never resumed from"]
    os.rename(tmp_path / "ck" / "step_00000001", tmp_path / "ck" / "step_00000001.bad1")
    checkpoint.main(["ls", str(tmp_path / "ck")])          # only folders set aside: listed, not refused
    assert capsys.readouterr().out.splitlines()[0] == "step_00000003.bad1795865382362535150  set aside: damaged; kept, never resumed from"


def test_ls_and_export_of_a_runs_out_dir_name_its_ckpt_folder(tmp_path, capsys):
    """`train.py --out_dir=o1` keeps its checkpoints in o1/ckpt; `checkpoint.py ls o1` said only 'holds no
    checkpoint: is it a run's --ckpt.dir?' and `export o1 o1/hf-bf16` 'is inside the checkpoint directory
    o1'. Both now name o1/ckpt, which works; nothing is written."""
    cfg = tiny_cfg(tmp_path / "o1" / "ckpt")
    ck = Checkpointer(cfg)
    ck.save(1, llama.Llama(cfg.model).init_weights(0).state_dict())
    ck.close()
    for argv in (["ls", "o1"], ["export", "o1", "o1/hf-bf16"], ["export", "o1", "elsewhere"]):
        with pytest.raises(checkpoint.CheckpointError, match=f"o1 is a run's --out_dir: give its --ckpt.dir, {tmp_path}/o1/ckpt"):
            checkpoint.cli([argv[0]] + [str(tmp_path / a) for a in argv[1:]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o1"] and sorted(os.listdir(tmp_path / "o1")) == ["ckpt"]
    checkpoint.main(["export", str(tmp_path / "o1" / "ckpt"), str(tmp_path / "o1" / "hf-bf16")])
    assert (tmp_path / "o1" / "hf-bf16" / "model.safetensors").is_file()


@pytest.mark.parametrize("argv,says", [
    (["ls", "{ck}", "extra"], "ls takes CKPT_DIR, given '{ck}' 'extra'"),                # was the usage alone
    (["export", "{ck}"], "export takes CKPT_DIR HF_OUT_DIR, given '{ck}'"),
    (["ls", "-x", "{ck}"], "-x: unknown flag"),                                      # was counted as a path
    (["export", "--dtype=fp32", "--dtype=bf16", "{ck}", "{hf}"], "--dtype given as bf16 and fp32: give it once")])
def test_the_cli_names_what_it_was_given_in_one_line(tmp_path, capsys, argv, says):
    """checkpoint.py's bad input names the argument, not only the usage: a missing or extra path, a
    one-dash flag; two --dtype values (the first one used to win, silently). Nothing is written."""
    cfg = tiny_cfg(tmp_path / "ck")
    model, opt = trained(cfg, steps=1)
    ck = Checkpointer(cfg)
    ck.save(1, model.state_dict(), opt.state_dict())
    ck.close()
    fill = lambda a: a.format(ck=tmp_path / "ck", hf=tmp_path / "hf")       # noqa: E731
    with pytest.raises(SystemExit) as e:
        checkpoint.main([fill(a) for a in argv])
    msg = str(e.value.code)
    assert msg.startswith(f"checkpoint error: {fill(says)}") and "usage: " in msg and "\n" not in msg, msg
    assert not (tmp_path / "hf").exists()


def test_an_export_of_a_checkpoint_pruned_meanwhile_is_one_line(tmp_path, monkeypatch):
    """checkpoint.py export while a run writes into the same directory: the run's keep-N pruning (or
    a resume setting a folder aside) can remove the checkpoint being read. Here it goes right after
    its checksums pass (the moment is forced: ckptdir.verify removes it). It was FileNotFoundError's
    traceback; now one line naming the file and to run the command again."""
    import shutil
    cfg = tiny_cfg(tmp_path / "ck")
    model, opt = trained(cfg, steps=1)
    ck = Checkpointer(cfg)
    ck.save(1, model.state_dict(), opt.state_dict())
    ck.close()
    verify = ckptdir.verify

    def verify_then_pruned(d, files):
        problem = verify(d, files)
        shutil.rmtree(d)
        return problem
    monkeypatch.setattr(ckptdir, "verify", verify_then_pruned)
    with pytest.raises(SystemExit) as e:
        checkpoint.main(["export", str(tmp_path / "ck"), str(tmp_path / "hf")])
    assert "step_00000001" in str(e.value.code) and "was removed while it was read" in str(e.value.code), e.value.code


@contextlib.contextmanager
def handlers_kept():
    """checkpoint.StopSignal installs its signal handlers: pytest's are back after the block."""
    handlers = {sig: signal.getsignal(sig) for sig in checkpoint.StopSignal.SIGNALS}
    try:
        yield
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)


def test_a_stop_heard_past_its_grace_period_says_0_s_left_not_minus(tmp_path):
    """checkpoint.stop_budget after the grace period has run out (the previous save in flight took it
    all): the stop's save is not started, and the reason says 0.0 s are left. It said "-0.0 s of
    the 1.5 s grace period are left" (vckpt's black-box run)."""
    cfg = tiny_cfg(tmp_path / "ckpt")
    cfg.ckpt.async_save = False
    model, opt = trained(cfg)
    grid = parallel.Grid()
    ck = Checkpointer(cfg, grid)
    ck.claim()
    ck.save(2, model.state_dict(), opt.state_dict(), data={"d": 0})
    with handlers_kept():
        stop = checkpoint.StopSignal(grid)
    stop.heard_at = time.monotonic() - 1.51                     # heard 1.51 s ago, the grace is 1.5 s
    fits, why = checkpoint.stop_budget(ck, stop, grid, 1.5)
    ck.close()
    assert not fits and why.startswith("0.0 s of the 1.5 s grace period are left and this rank's last save"), why


def test_a_stops_save_is_budgeted_by_the_last_saves_time_less_its_wait_for_a_cpu(tmp_path):
    """checkpoint.stop_budget: without an earlier save in this run the stop's save is tried (nothing to time it by);
    after one, its need is that save's staging, deferred copy and write less what the write waited for a CPU at
    SCHED_IDLE (the stop's save runs at normal priority), + 1 s. The stats are set: a wait for a CPU is the host's."""
    cfg = tiny_cfg(tmp_path / "ckpt")
    model, opt = trained(cfg)
    grid = parallel.Grid()
    ck = Checkpointer(cfg, grid)
    ck.claim()
    with handlers_kept():
        stop = checkpoint.StopSignal(grid)
    stop.heard_at = time.monotonic()
    fits, why = checkpoint.stop_budget(ck, stop, grid, 5.0)
    assert fits and why.endswith("(no earlier save in this run to time)"), why
    ck.save(2, model.state_dict(), opt.state_dict(), data={"d": 0})
    ck.wait()
    ck.stats.update(blocked_s=0.5, deferred_copy_s=0.5, write_s=3.0, starved_s=2.5)     # needs 0.5 + 0.5 + 3 - 2.5 + 1
    fits, why = checkpoint.stop_budget(ck, stop, grid, 5.0)
    ck.close()
    assert fits and why.endswith("took 2.5 s"), why


def test_a_signal_during_a_step_stops_the_run_at_that_steps_boundary(capsys):
    """checkpoint.StopSignal: a SIGTERM that arrives during step 1 (after the boundary of step 0) counts for the
    boundary after step 1: every rank stops there, with that step's checkpoint; a step later would spend a step
    of the grace period (1.5 s at 7B on 128 nodes). A real signal, raised in this process."""
    grid = parallel.Grid()
    with handlers_kept():
        stop = checkpoint.StopSignal(grid)
        assert stop.requested(0) is None                 # nothing heard: step 1 begins
        signal.raise_signal(signal.SIGTERM)              # heard during step 1
    assert "SIGTERM during step 1: stopping after it with a checkpoint" in capsys.readouterr().err
    assert stop.requested(1) == "SIGTERM"


def test_a_tensor_saved_again_in_another_dtype_is_saved_in_that_dtype(tmp_path):
    """The background save stages into host buffers kept from the previous save (ckptsave.Writer._copy): a tensor of
    the same name and shape in another dtype (bf16 weights where the last save had fp32 ones) needs a buffer of its
    own dtype; the last save's would hold it converted, saved in the wrong dtype."""
    cfg = tiny_cfg(tmp_path / "ckpt")
    cfg.ckpt.async_save = True
    ck = Checkpointer(cfg)
    ck.claim()
    w = torch.arange(6, dtype=torch.float32) / 3
    ck.save(1, {"w": w}, None, data={"d": 0})
    ck.save(2, {"w": w.bfloat16()}, None, data={"d": 0})
    ck.close()
    saved = torch.load(tmp_path / "ckpt" / "step_00000002" / "model_tp00_pp00.pt")["w"]
    assert saved.dtype == torch.bfloat16 and torch.equal(saved, w.bfloat16()), saved


# ----------------------------------------------------------------------------- multi-rank bookkeeping

def ranks_save(cfg, step, world, tp, dp, make_state, skip_ranks=()):
    """Write one checkpoint as `world` ranks would, one rank after another, rank 0 last."""
    for r in reversed(range(world)):
        if r in skip_ranks:
            continue
        g = parallel.Grid(world=world, rank=r, tp=tp, dp=dp, tp_rank=r % tp, dp_rank=(r // tp) % dp)
        c = Checkpointer(cfg, g, marker_timeout_s=2.0)
        model, opt, data = make_state(g)
        c.save(step, model, opt, data=data)
        c.close()


def _agree_worker(rank: int, root: str, out: str):
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    try:
        g = parallel.Grid(world=2, rank=rank, dp=2, dp_rank=rank)
        d, _ = checkpoint.find_newest_valid(Path(root), g, say=lambda m: None, log=lambda m: None)
        Path(out, f"chose{rank}").write_text(d.name)
    finally:
        dist.destroy_process_group()


def test_every_rank_falls_back_when_one_ranks_share_finds_damage(tmp_path):
    """At resume each rank checks a 1/world share of the markers and their files, then the ranks agree on the worst
    verdict (MIN). A file only rank 1's share covers, damaged in place (same size, one byte flipped), must make rank 0
    fall back with it: agreeing on the best verdict, both resumed from the damaged step. Two gloo processes."""
    from gloo_spawn import spawn
    cfg = tiny_cfg(tmp_path / "ckpt")
    cfg.ckpt.async_save = False
    state = lambda g: ({"w": torch.full((4,), 1.0)}, None, {"dp_rank": g.dp_rank})
    for step in (1, 2):
        ranks_save(cfg, step, world=2, tp=1, dp=2, make_state=state)
    d2 = tmp_path / "ckpt" / "step_00000002"
    raw = bytearray((d2 / "rank00001.pt").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (d2 / "rank00001.pt").write_bytes(bytes(raw))
    files = [ckptdir.check(d2, (r, 2)) for r in range(2)]
    assert [ckptdir.verify(d2, f[2]) is None for f in files] == [True, False]     # only rank 1's share sees it
    spawn(_agree_worker, (str(tmp_path / "ckpt"), str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"chose{r}").read_text() for r in range(2)] == ["step_00000001"] * 2


def test_zero1_shards_and_missing_rank(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path)
    cfg.parallel.zero1 = True
    cfg.ckpt.async_save = False
    state = lambda g: ({"w": torch.full((4,), 1.0 + g.tp_rank)},
                       {"layout": {"kind": "zero1"}, "state": {"exp_avg": torch.full((2,), 10.0 * g.rank)}},
                       {"dp_rank": g.dp_rank})
    ranks_save(cfg, 1, world=4, tp=2, dp=2, make_state=state)
    names = sorted(p.name for p in (tmp_path / "step_00000001").iterdir())
    assert [n for n in names if n.startswith(("model", "optim"))] == [
        "model_tp00_pp00.pt", "model_tp01_pp00.pt", "optim_dp000_tp00_pp00.pt", "optim_dp000_tp01_pp00.pt",
        "optim_dp001_tp00_pp00.pt", "optim_dp001_tp01_pp00.pt"]
    # Same layout: each rank gets its own shard, data and RNG back.
    g3 = parallel.Grid(world=4, rank=3, tp=2, dp=2, tp_rank=1, dp_rank=1)
    got = Checkpointer(cfg, g3).load_latest()
    assert torch.equal(got.optim["state"]["exp_avg"], torch.full((2,), 30.0)) and got.data == {"dp_rank": 1}
    assert torch.equal(got.model["w"], torch.full((4,), 2.0)) and got.rng is not None
    # Another layout: shards without their index (not optim.py's) are refused; the model alone still loads.
    with pytest.raises(CheckpointError, match=r"cannot be resharded.*load_optim=False"):
        Checkpointer(cfg, parallel.Grid()).load_latest()
    # ZeRO-1 again at another DP degree is another layout too: DP rank 1 of 4 must not take the shard of
    # DP rank 1 of 2 as its own (the same file name, another slice of the flat state).
    with pytest.raises(CheckpointError, match=r"cannot be resharded.*load_optim=False"):
        Checkpointer(cfg, parallel.Grid(world=8, rank=3, tp=2, dp=4, tp_rank=1, dp_rank=1)).load_latest()
    one = Checkpointer(cfg, parallel.Grid()).load_latest(load_optim=False)
    assert one.optim is None and one.rng is None
    assert list(one.data) == [{"dp_rank": 0}, {"dp_rank": 1}]
    # On resume each rank checks only its 1/world share of the markers (then all ranks agree): the
    # share of rank 2 finds a marker lost after the save; rank 0's does not even look at it.
    ranks_save(cfg, 2, world=4, tp=2, dp=2, make_state=state)
    d2 = tmp_path / "step_00000002"
    (d2 / "rank00002.done").unlink()
    assert ckptdir.check(d2, (0, 4))[0] == ckptdir.OK
    assert ckptdir.check(d2, (2, 4))[:2] == (ckptdir.DAMAGED, "no completion marker from rank(s) [2] of 4, "
                                             "although its manifest says every rank finished")
    assert "rank(s) [2] of 4" in ckptdir.check(d2)[1]
    capsys.readouterr()
    g0 = parallel.Grid(world=4, rank=0, tp=2, dp=2)       # no process group: rank 0 checks every marker
    assert Checkpointer(cfg, g0).load_latest().step == 1
    assert "no completion marker from rank(s) [2] of 4" in capsys.readouterr().out


def test_the_one_read_broadcast_carries_tensors_of_any_dtype_and_length_exactly():
    """reshard.broadcast_state packs a state's tensors into int32 buckets and views them back: byte lengths that are
    no multiple of 4 or of the next tensor's element size (3 bf16 values, a bool, 0-d tensors) must come back bit
    for bit, with the non-tensor leaves. Here the reader's side of it, in one process (no DP group)."""
    state = {"a": torch.arange(3, dtype=torch.bfloat16) / 3, "b": torch.randn(5), "c": {"d": torch.tensor(True),
             "e": torch.arange(3, dtype=torch.float64) / 7, "i": torch.tensor(2**40)}, "n": [5, "x"]}
    got = reshard.broadcast_state(state, parallel.Grid(), reader=0)
    assert got["n"] == [5, "x"] and set(got["c"]) == {"d", "e", "i"}
    for want, have in ((state["a"], got["a"]), (state["b"], got["b"]), *((state["c"][k], got["c"][k]) for k in "dei")):
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want), (want, have)


def test_the_one_read_broadcast_is_exact_through_neurons_f32_all_reduce(monkeypatch):
    """Neuron's collective engine adds in f32 whatever the operand's dtype (no integer datapath: neuronx-cc 2.32's
    release notes; NCC_EVRF061): the one-read broadcast sent the state's bytes as int32 words, which came back rounded
    above 2^24, so a resume at DP > 1 on Trainium read a corrupt pickle and weights. Under an all-reduce that adds as
    Neuron's does (through f32: the source's value and three ranks' zeros), every bit pattern comes back: float32 NaN
    payloads, -0, subnormals, bf16 pairs, int64s and a 2^24 + 1 length."""
    def neurons(t, group, op=None):
        acc = t.to(torch.float32)
        for _ in range(3):
            acc = acc + torch.zeros_like(acc)
        return t.copy_(acc.round() if not t.is_floating_point() else acc)
    monkeypatch.setattr(parallel, "all_reduce", neurons)
    g = torch.Generator().manual_seed(0)
    odd = torch.tensor([0x7FC00001, -0x7FFFFFFF - 1, 1, 0x7F800000, 0x3C23D70A], dtype=torch.int32).view(torch.float32)
    state = {"f": torch.cat([odd, torch.randn(1000, generator=g)]), "b": torch.randn(777, generator=g).bfloat16(),
             "i": torch.randint(-2**62, 2**62, (9,), generator=g), "u": torch.arange(2**24 + 1, dtype=torch.uint8),
             "n": "x" * 1001}
    got = reshard.broadcast_state(state, parallel.Grid(), reader=0)
    assert got["n"] == state["n"]
    for k in "fbiu":
        assert got[k].dtype == state[k].dtype and torch.equal(got[k].view(torch.uint8), state[k].view(torch.uint8)), k


def test_the_one_read_broadcast_moves_a_state_in_buckets_of_at_most_bucket_bytes(monkeypatch):
    """reshard.broadcast_state sends a state bucket by bucket (a 7B rank's state is gigabytes, four times that as
    float32 carriers): consecutive tensors up to BUCKET_BYTES (1 KB here), a larger tensor alone; after the two
    sends of the pickled header, one send per bucket, and every tensor back bit for bit."""
    monkeypatch.setattr(reshard, "BUCKET_BYTES", 1024)
    sizes, send = [], reshard._broadcast

    def spy(raw, *args):
        sizes.append(raw.numel())
        return send(raw, *args)
    monkeypatch.setattr(reshard, "_broadcast", spy)
    state = {**{f"w{i}": torch.randn(100) for i in range(5)}, "big": torch.randn(750)}     # 400 bytes each, 3000
    got = reshard.broadcast_state(state, parallel.Grid(), reader=0)
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert sizes[2:] == [800, 800, 400, 3008]


def test_shared_files_are_written_by_spread_replicas(tmp_path):
    """TP=2 x DP=4: the 4 files the DP replicas hold alike (model and optimizer of each TP rank) are
    written by 4 different replicas (dp 0, 1, 2, 3), not all by dp 0; every rank writes its own
    RNG/data file; a rank that wrote none of them reads its model and optimizer back."""
    cfg = tiny_cfg(tmp_path)
    cfg.ckpt.async_save = False
    state = lambda g: ({"w": torch.full((4,), 1.0 + g.tp_rank)},                       # noqa: E731
                       {"layout": {"kind": "full"}, "state": {"m": torch.full((2,), 5.0 + g.tp_rank)}},
                       {"dp_rank": g.dp_rank})
    ranks_save(cfg, 1, world=8, tp=2, dp=4, make_state=state)
    d = tmp_path / "step_00000001"
    wrote = {r: sorted(json.loads((d / f"rank{r:05d}.done").read_text())["files"]) for r in range(8)}
    shared = {r: [n for n in names if n.startswith(("model", "optim"))] for r, names in wrote.items()}
    assert shared == {0: ["model_tp00_pp00.pt"], 3: ["model_tp01_pp00.pt"], 4: ["optim_tp00_pp00.pt"],
                      7: ["optim_tp01_pp00.pt"], 1: [], 2: [], 5: [], 6: []}
    assert all(f"rank{r:05d}.pt" in names for r, names in wrote.items())
    assert [r for r, names in wrote.items() if "meta.json" in names] == [0]
    assert [checkpoint.writer_dp_rank(k, parallel.Grid(world=8, tp=2, dp=4, tp_rank=t), False)
            for k in (0, 1) for t in (0, 1)] == [0, 1, 2, 3]
    # at 7B on 128 trn1 nodes (TP 8, DP 512, 32 ranks a node) the 16 shared files are written, and read back, by 16
    # nodes, not by the first 4: each node's link to the shared file system carries one file
    nodes = {(checkpoint.writer_dp_rank(k, g, False) * 8 + t) // 32 for k in (0, 1) for t in range(8)
             for g in [parallel.Grid(world=4096, tp=8, dp=512, tp_rank=t)]}
    assert len(nodes) == 16, sorted(nodes)
    g6 = parallel.Grid(world=8, rank=6, tp=2, dp=4, tp_rank=0, dp_rank=3)
    got = Checkpointer(cfg, g6).load_latest()
    assert torch.equal(got.model["w"], torch.full((4,), 1.0)) and torch.equal(got.optim["state"]["m"], torch.full((2,), 5.0))
    assert got.data == {"dp_rank": 3}


# ----------------------------------------------------------------------------- fault injection

def test_fault_spec_and_random_restarts(tmp_path, monkeypatch):
    for bad in ("7", "a:b", "1:2:write", "1:2:save:3", "p=2", "p=0.1,foo=1"):
        with pytest.raises(configs.ConfigError, match="NANOTRN_FAULT"):
            Faults(bad, 0, tmp_path)

    class Killed(Exception):
        pass

    def fake_kill(pid, sig):
        assert pid == os.getpid() and sig == signal.SIGKILL
        raise Killed
    monkeypatch.setattr(faults.os, "kill", fake_kill)
    capture = lambda spec, rank, steps: [s for s in steps if _dies(Faults(spec, rank, tmp_path), s, Killed)]

    # Fixed: only that rank, only that step, only once (the restart goes through it).
    assert capture("1:7", 0, range(10)) == []
    assert capture("1:7", 1, range(10)) == [7]
    assert capture("1:7", 1, range(10)) == []
    # Random: the draw depends on the number of earlier deaths, so restarts do not repeat it.
    (tmp_path / "faults.log").unlink()
    first = [_dies(Faults("p=0.5", 0, tmp_path), s, Killed, log=False) for s in range(40)]
    (tmp_path / "faults.log").write_text("rank 0 step 3 at random (p=0.5)\n")
    second = [_dies(Faults("p=0.5", 0, tmp_path), s, Killed, log=False) for s in range(40)]
    assert first != second and 5 < sum(first) < 35
    # A run restarting from 2 steps back after each death always finishes; max caps the deaths.
    (tmp_path / "faults.log").unlink()
    step, deaths = 0, 0
    while step < 30:
        try:
            Faults("p=0.2,seed=1,max=3", 0, tmp_path).maybe_crash(step)
            step += 1
        except Killed:
            deaths, step = deaths + 1, max(0, step - 2)
    assert deaths == 3 == len((tmp_path / "faults.log").read_text().splitlines())


def test_random_faults_draw_apart_by_rank_and_by_seed(tmp_path):
    """NANOTRN_FAULT=p=: 'every rank, every step, dies with probability p', each rank on its own draws (a node
    lost, not the whole cluster at once), and seed=N gives another pattern of deaths."""
    killed = type("Killed", (Exception,), {})
    draws = lambda spec, rank: [_dies(Faults(spec, rank, tmp_path), s, killed, log=False) for s in range(64)]
    assert draws("p=0.5", 0) != draws("p=0.5", 1)
    assert draws("p=0.5,seed=1", 0) != draws("p=0.5", 0) == draws("p=0.5,seed=0", 0)


def test_a_save_fault_dies_halfway_through_the_file(tmp_path, monkeypatch):
    """NANOTRN_FAULT=0:2:save kills the rank halfway through its largest file (a kill at the end would leave a
    whole file, and test the atomic save less): here, at the write after the first 500 of its 1000 bytes."""
    killed = type("Killed", (Exception,), {})

    def fake_kill(pid, sig):
        raise killed
    monkeypatch.setattr(faults.os, "kill", fake_kill)
    sizes = {"model_tp00_pp00.pt": 1000, "rank00000.pt": 10}
    wrap = Faults("0:2:save", 0, tmp_path).file(2, "model_tp00_pp00.pt", sizes)
    with open(tmp_path / "model_tp00_pp00.pt", "wb") as raw, pytest.raises(killed):
        f = wrap(raw)
        for _ in range(10):
            f.write(b"x" * 100)
    assert (tmp_path / "model_tp00_pp00.pt").stat().st_size == 500


def test_fault_hooks_fire_only_where_asked(tmp_path):
    """The hooks the product calls: Faults.step (train.py) makes step S's gradients NaN under
    NANOTRN_FAULT=nan:S and leaves the steps around it untouched (its hooks are removed); Faults.file
    wraps only the largest file of the save it names; with no NANOTRN_FAULT both do nothing."""
    m = torch.nn.Linear(3, 2)
    finite = []
    for step in range(3):
        m.zero_grad()
        with Faults("nan:1", 0, tmp_path).step(step, m):
            m(torch.ones(1, 3)).sum().backward()
        finite.append(bool(torch.isfinite(m.weight.grad).all() and torch.isfinite(m.bias.grad).all()))
    assert finite == [True, False, True]
    sizes = {"model_tp00_pp00.pt": 10, "optim_tp00_pp00.pt": 20, "rank00000.pt": 1}
    save = Faults("0:2:save", 0, tmp_path)
    assert [n for n in sizes if save.file(2, n, sizes)] == ["optim_tp00_pp00.pt"]
    assert not save.file(1, "optim_tp00_pp00.pt", sizes)                          # another step
    assert not Faults("0:2:save", 1, tmp_path).file(2, "optim_tp00_pp00.pt", sizes)   # another rank
    assert not Faults("", 0, tmp_path).file(2, "optim_tp00_pp00.pt", sizes)


def test_hang_fires_once_where_asked_and_a_restart_goes_through_it(tmp_path):
    """NANOTRN_FAULT=hang:1:5: only rank 1, only once 5 steps are done, it hangs (here, with no process
    group, in a wait nothing ends: a daemon thread); noted in faults.log, so the restarted run does not
    hang again."""
    Faults("hang:1:5", 0, tmp_path).maybe_hang(5)                  # another rank: nothing
    Faults("hang:1:5", 1, tmp_path).maybe_hang(4)                  # another step: nothing
    hung = threading.Thread(target=Faults("hang:1:5", 1, tmp_path).maybe_hang, args=(5,), daemon=True)
    hung.start()
    log, deadline = tmp_path / "faults.log", time.monotonic() + 60
    while not (log.exists() and log.read_text().endswith("\n")) and time.monotonic() < deadline:
        time.sleep(0.01)
    hung.join(timeout=0.5)
    assert hung.is_alive() and log.read_text() == "rank 1 hangs at step 5 (hang:1:5)\n"
    Faults("hang:1:5", 1, tmp_path).maybe_hang(5)                  # the restart: goes through


def test_a_fault_for_any_rank_fires_in_the_process_that_has_it_once_per_run(tmp_path, monkeypatch):
    """NANOTRN_FAULT=hang:any:6 / any:7: the process given the variable (one pod) fires at whatever rank
    the rendezvous gave it (torchrun orders nodes by address and pid: a replacement pod may come back
    as rank 0), and a later attempt at another rank does not fire again (faults.log)."""
    killed = type("Killed", (Exception,), {})

    def fake_kill(pid, sig):
        raise killed
    monkeypatch.setattr(faults.os, "kill", fake_kill)
    assert not _dies(Faults("any:7", 0, tmp_path), 6, killed, log=False)
    assert _dies(Faults("any:7", 0, tmp_path), 7, killed)                      # fires at rank 0 ...
    assert not _dies(Faults("any:7", 1, tmp_path), 7, killed, log=False)       # ... once, whatever rank comes next
    hung = threading.Thread(target=Faults("hang:any:6", 0, tmp_path).maybe_hang, args=(6,), daemon=True)
    hung.start()
    log, deadline = tmp_path / "faults.log", time.monotonic() + 60
    while "hangs" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.01)
    hung.join(timeout=0.5)
    assert hung.is_alive() and log.read_text().endswith("rank 0 hangs at step 6 (hang:any:6)\n")
    Faults("hang:any:6", 1, tmp_path).maybe_hang(6)                # the replacement, now rank 1: goes through


def _dies(fi, step, killed, log=True) -> bool:
    if not log:       # only ask whether it would fire, leaving faults.log as it is
        def die(what):
            raise killed
        fi.die = die
    try:
        fi.maybe_crash(step)
        return False
    except killed:
        return True


# ----------------------------------------------------------------------------- resharding and export

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reshard_worker(rank: int, port: int, dir_a: str, dir_b: str):
    """TP=2 x DP=2: resume from a 1-process checkpoint, check it, take one step, save."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    cfg = tiny_cfg(dir_a)
    cfg.parallel.tp = 2
    grid = parallel.new_grid(4, rank, 2, 1, sharding.kv_replicas(cfg.model, 2), "gloo")
    model = seeded_model(cfg, grid)
    opt = optim.build_optimizer(model, cfg, grid)
    loaded = Checkpointer(cfg, grid).load_latest()
    model.load_state_dict(loaded.model)
    opt.load_state_dict(loaded.optim)
    assert loaded.step == 2 and list(loaded.data) == [{"pos": 7}]
    # What this rank holds is exactly its shard of the 1-process state.
    full = reshard.full_model_state(loaded.path, cfg.model)
    for name, t in parallel.gather_full_state_dict(model, grid).items():
        assert torch.equal(t, full[name]), name
    random_step(model, opt, seed=2, grid=grid)
    cfg.ckpt.dir = dir_b
    ck = Checkpointer(cfg, grid)
    ck.save(3, model.state_dict(), opt.state_dict(), data={"pos": 8 + grid.dp_rank})
    ck.close()
    dist.destroy_process_group()


def test_zero1_shards_are_cut_back_into_parameters_up_to_the_flat_spaces_last_element(tmp_path):
    """reshard.SavedOptim cuts saved ZeRO-1 shards back into per-parameter tensors, each from the one or two shards
    holding it (at another layout, and `checkpoint.py export`'s masters). Where DP divides the flat space, the last
    parameter ends exactly at the last shard's end: no shard past it is opened (there is none). Where it does not,
    the shards are ceil(N / DP) long, the last one padded."""
    cfg = tiny_cfg(tmp_path)
    named = list(seeded_model(cfg, parallel.Grid()).named_parameters())
    n = sum(p.numel() for _, p in named)
    for dp in (2, 3):
        assert (n % dp == 0) == (dp == 2), n
        d = tmp_path / f"dp{dp}"
        d.mkdir()
        for r in range(dp):
            opt = optim.Zero1AdamW(named, cfg.optim, parallel.Grid(dp=dp, dp_rank=r))
            opt.flat["exp_avg"].copy_(torch.arange(r * opt.shard, (r + 1) * opt.shard))     # each element its flat index
            torch.save(opt.state_dict(), d / reshard.optim_name(r, reshard.tag(0, 0), True))
        saved, off = reshard.SavedOptim(d, reshard.tag(0, 0), {"zero1": True}, "step_00000001"), 0
        for name, p in named:
            want = torch.arange(off, off + p.numel(), dtype=torch.float32).view(p.shape)
            assert torch.equal(saved[f"{name}.exp_avg"], want), (dp, name)
            off += p.numel()


@pytest.mark.slow
def test_reshard_tp2_dp2_and_back_and_export(tmp_path):
    """1 process -> TP=2 x DP=2 -> 1 process, with the real model, parallel.py and optim.py:
    AdamW is elementwise, so the update is the same at any layout and the states are bit-equal."""
    cfg = tiny_cfg(tmp_path / "a")
    model, opt = trained(cfg, steps=2)
    ck = Checkpointer(cfg)
    ck.save(2, model.state_dict(), opt.state_dict(), data={"pos": 7})
    ck.close()
    spawn(_reshard_worker, (_free_port(), str(tmp_path / "a"), str(tmp_path / "b")), nprocs=4)
    random_step(model, opt, seed=2)                 # the same step, in one process

    cfg.ckpt.dir = str(tmp_path / "b")
    loaded = Checkpointer(cfg).load_latest()
    assert loaded.step == 3 and loaded.meta["layout"] == {"world": 4, "tp": 2, "pp": 1, "dp": 2, "zero1": False}
    assert list(loaded.data) == [{"pos": 8}, {"pos": 9}]
    assert_state_equal(model.state_dict(), loaded.model)
    want = opt.state_dict()
    assert_state_equal(want["state"], loaded.optim["state"])
    assert loaded.optim["step"] == want["step"] == 3
    # The same TP degree at another layout (ZeRO-1 turned on at a resume): the state is rebuilt per parameter,
    # and TP rank 1 takes its own shard's moments, not TP rank 0's
    layout = loaded.meta["layout"]
    state = reshard._read_optim(loaded.path, layout, {**layout, "zero1": True}, parallel.Grid(tp=2, tp_rank=1),
                                cfg.model)["state"]
    for key, t in want["state"].items():
        assert torch.equal(state[key], sharding.cut(key.rsplit(".", 1)[0], t, cfg.model, 2, 1)), key

    # Export the TP=2 checkpoint offline; transformers must give our logits.
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    checkpoint.cli(["export", str(tmp_path / "b"), str(out)])      # python checkpoint.py export B OUT
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = llama.Llama(cfg.model)
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        diff = (hf(tokens).logits - ref(tokens)).abs().max().item()
    assert diff < 1e-5, diff


# ----------------------------------------------------------------------------- end to end with train.py

TRAIN_ARGS = ["--model.n_layers=2", "--model.dim=32", "--model.n_heads=4", "--model.n_kv_heads=2",
              "--model.ffn_dim=64", "--data.seq_len=32", "--data.global_batch=4", "--data.micro_batch=2",
              "--optim.max_steps=6", "--optim.warmup_steps=2", "--optim.decay_steps=4", "--ckpt.interval=2",
              "--device=cpu", "--log.interval=1", "--log.eval_interval=0", "--log.sample_tokens=4", "--log.tensorboard="]

needs_train = pytest.mark.skipif(
    "Checkpointer(" not in (ROOT / "train.py").read_text(),
    reason="train.py does not create a checkpoint.Checkpointer yet (the integration is in the checkpoint "
           "report: load_latest before the loop, fault.maybe_crash and save in it, close after it)")


def train(out: Path, *extra, fault: str | None = None, nproc: int = 1, restarts: int = 0, timeout: int = 300):
    return run_train([f"--out_dir={out}", f"--ckpt.dir={out}/ckpt", *TRAIN_ARGS, *extra], nproc, restarts,
                     {"NANOTRN_FAULT": fault}, timeout)


def assert_same_final_state(ref: Path, run: Path, step: int):
    a, b = final_state(ref, step), final_state(run, step)
    assert sorted(a) == sorted(b)
    for name in sorted(a, key=lambda n: n.startswith("rank")):     # model and optimizer first
        try:
            assert_state_equal(a[name], b[name], name)
        except AssertionError as e:
            hint = ("" if not name.startswith("rank") else ": the model and optimizer are bit-exact, but a "
                    "random stream or the data position differs after the resume; something draws from a "
                    "global RNG between load_latest() and the first step (or the loader was not restored)")
            raise AssertionError(f"{e}{hint}") from None


def final_state(out: Path, step: int = 6) -> dict:
    """Every file of the final checkpoint but meta.json's time: model, optimizer, RNG and data states."""
    d = out / "ckpt" / f"step_{step:08d}"
    state = {p.name: torch.load(p, weights_only=False) for p in sorted(d.glob("*.pt"))}
    state["extra"] = checkpoint.json.loads((d / "meta.json").read_text())["extra"]
    return state


@pytest.mark.slow
@needs_train
def test_e2e_sigkill_at_random_step_resumes_bit_exact(tmp_path):
    """An uninterrupted run and a run SIGKILLed as a random step begins, then restarted, end with
    bitwise-identical parameters, optimizer, RNG and data-loader states. Saves every 2 steps; a
    kill at step 5-7 comes after save(4) waited for step 2 to be on disk, so there is always a
    checkpoint to resume from, and the save of the step before may still be in flight (skipped).
    The final HF export gives our logits."""
    longer = ["--optim.max_steps=8", "--optim.decay_steps=6"]
    refs = []                                   # the uninterrupted run meanwhile: two single processes, two cores
    reference = threading.Thread(target=lambda: refs.append(train(tmp_path / "ref", *longer)))
    reference.start()
    k = random.randint(5, 7)
    print(f"killing at step {k}")
    run = train(tmp_path / "run", *longer, fault=f"0:{k}")
    reference.join()
    (ref,) = refs
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    assert run.returncode == -signal.SIGKILL and f"NANOTRN_FAULT: rank 0 step {k}" in run.stderr, run.stderr[-2000:]
    run = train(tmp_path / "run", *longer, fault=f"0:{k}")    # same environment: it does not fire twice
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "ckpt: resuming from" in run.stdout, run.stdout
    assert_same_final_state(tmp_path / "ref", tmp_path / "run", 8)

    transformers = pytest.importorskip("transformers")
    d = tmp_path / "run" / "ckpt" / "step_00000008"
    m = configs.ModelConfig(**checkpoint.json.loads((d / "meta.json").read_text())["config"]["model"])
    ours = llama.Llama(m)
    ours.load_state_dict(reshard.full_model_state(d, m))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "run" / "hf").eval()
    tokens = torch.randint(0, m.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() < 1e-5


@pytest.mark.slow
@needs_train
def test_e2e_torchrun_restarts_by_itself_after_a_rank_dies_mid_save(tmp_path):
    """DP=2 under `torchrun --max-restarts=2`: rank 1 is SIGKILLed halfway through writing the
    checkpoint of step 4; the survivor ends at once with one line (its collective fails; it does
    not wait for rank 1's marker until torchrun's SIGKILL, 30 s after its SIGTERM); torchrun restarts
    both ranks, they skip the incomplete step 4, resume from step 2 and finish with the same final
    state as an uninterrupted DP=2 run."""
    ref = train(tmp_path / "ref", "--dp=2", nproc=2)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]
    run = train(tmp_path / "run", "--dp=2", fault="1:4:save", nproc=2, restarts=2)
    # (torch 2.9's torchrun keeps one TCPStore over restarts: unless parallel.init_distributed
    # prefixes it per TORCHELASTIC_RESTART_COUNT, the restarted gloo ranks cannot connect.)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "NANOTRN_FAULT: rank 1 writing" in run.stderr
    # From the death (faults.log, written just before the SIGKILL) to torchrun's line once no worker
    # is left ("E<MMDD HH:MM:SS.us> ... failed (exitcode"): 0.4 s here; 30 s and more before.
    died = datetime.datetime.fromtimestamp((tmp_path / "run" / "ckpt" / "faults.log").stat().st_mtime)
    stamp = re.search(r"^E(\d{4} [\d:.]+) \d+ .*\] failed \(exitcode", run.stderr, re.M)
    gone = datetime.datetime.strptime(f"{died.year}{stamp.group(1)}", "%Y%m%d %H:%M:%S.%f")
    assert (gone - died).total_seconds() < 15, (died, gone)
    assert "error: [rank 0] a collective failed: another rank is gone" in run.stderr and "Traceback" not in run.stderr
    assert "skipping step_00000004" in run.stdout and "resuming from" in run.stdout
    assert len((tmp_path / "run" / "ckpt" / "faults.log").read_text().splitlines()) == 1
    assert_same_final_state(tmp_path / "ref", tmp_path / "run", 6)


@pytest.mark.slow
def test_precompile_pass_writes_no_checkpoint_and_no_export(tmp_path):
    """neuron_parallel_compile's pass (NEURON_EXTRACT_GRAPHS_ONLY, values invalid): train.py goes
    through its saves (staged to host memory: the same transfers and graph cuts) and a resume's
    optimizer load, and writes nothing: no checkpoint directory, no tokenizer copy, no export.
    Its losses are a normal run's (the load round trip changes no value)."""
    refs = []                                   # the normal run meanwhile: two single processes, two cores
    reference = threading.Thread(target=lambda: refs.append(run_train([f"--out_dir={tmp_path}/ref", *TRAIN_ARGS])))
    reference.start()
    run = run_train([f"--out_dir={tmp_path}/o", *TRAIN_ARGS], env={"NANOTRN_FAULT": None, "NEURON_EXTRACT_GRAPHS_ONLY": "1"})
    reference.join()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "pre-compile pass: 6 steps traced, nothing saved or exported" in run.stdout
    assert not (tmp_path / "o").exists(), sorted(map(str, (tmp_path / "o").rglob("*")))
    (ref,) = refs
    assert ref.returncode == 0 and (tmp_path / "ref" / "ckpt" / "step_00000006").is_dir()
    loss = lambda out: [l for l in out.splitlines() if "| loss" in l and l.startswith("step")]   # noqa: E731
    assert [l.split("|")[1] for l in loss(run.stdout)] == [l.split("|")[1] for l in loss(ref.stdout)]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_tied_model_saved_without_pp_resumes_at_pp2_with_the_heads_moments(tmp_path, tp):
    """A tied matrix is saved once without PP (embed.weight); at PP=2 the last stage holds a copy
    of it (lm_head.weight), whose moments are the embedding's. The resume refused: "optimizer state
    does not match the model: missing ['lm_head.weight.exp_avg', ...]" (found by a black-box run:
    train.py --model.tie_embeddings=true saved in one process, resumed under torchrun --pp=2)."""
    cfg = tiny_cfg(tmp_path, tie_embeddings=True)
    cfg.ckpt.async_save = False
    model, opt = trained(cfg)
    c = Checkpointer(cfg, parallel.Grid())
    c.claim()
    c.save(2, model.state_dict(), opt.state_dict(), data={"d": 0})
    c.close()
    saved = opt.state_dict()["state"]
    cfg.parallel.pp, cfg.parallel.tp = 2, tp
    for tp_rank in range(tp):
        g = parallel.Grid(world=2 * tp, rank=tp + tp_rank, tp=tp, pp=2, pp_rank=1, tp_rank=tp_rank)
        bounds = pipeline.stage_bounds(cfg)
        last = parallel.build_model(cfg, g, "cpu", stage=lambda m: pipeline.PipelineStage(m, bounds, 1))
        got = Checkpointer(cfg, g).load_latest(names=set(last.state_dict()))
        last.load_state_dict(got.model)
        resumed = optim.build_optimizer(last, cfg, g)
        resumed.load_state_dict(got.optim)
        state = resumed.state_dict()["state"]
        for moment in ("exp_avg", "exp_avg_sq"):
            want = sharding.cut("embed.weight", saved[f"embed.weight.{moment}"], cfg.model, tp, tp_rank)
            assert torch.equal(state[f"lm_head.weight.{moment}"], want)
        assert torch.equal(last.lm_head.weight, sharding.cut("embed.weight", model.embed.weight, cfg.model, tp, tp_rank))


@pytest.mark.parametrize("cuts", ["3", "", "1"])
def test_a_pp_checkpoint_resumes_at_other_stage_cuts(tmp_path, cuts):
    """Saved at PP=2 with --parallel.pp_cuts=1 (stages [0,1), [1,4)), resumed at the same PP degree
    but other cuts (3, or even): each stage gets its layers' weights and moments from whichever
    saved stage held them. Before, only the PP degree decided a reshard: each rank read its own
    stage's file, and load_state_dict failed on the layers it had not saved (found by a black-box
    train.py resume under torchrun --pp=2). At the same cuts it is the same layout: each rank's own files,
    its RNG streams included."""
    cfg = tiny_cfg(tmp_path, n_layers=4)
    cfg.ckpt.async_save = False
    cfg.parallel.pp, cfg.parallel.pp_cuts = 2, "1"
    full, full_opt = trained(cfg)                  # the whole model and its moments: what each stage must get
    want = full_opt.state_dict()["state"]
    for rank in (1, 0):                            # rank 0 last: it completes the save once both have written
        g = parallel.Grid(world=2, rank=rank, pp=2, pp_rank=rank)
        stage = parallel.build_model(cfg, g, "cpu", stage=lambda m: pipeline.PipelineStage(m, pipeline.stage_bounds(cfg), rank))
        stage.load_state_dict({k: v for k, v in full.state_dict().items() if k in stage.state_dict()})
        opt = optim.build_optimizer(stage, cfg, g)
        sd = opt.state_dict()
        opt.load_state_dict({**sd, "state": {k: want[k] for k in sd["state"]}})
        c = Checkpointer(cfg, g)
        if rank == 0:
            c.claim()
        c.save(2, stage.state_dict(), opt.state_dict(), data={"d": 0})
        c.close()
    cfg.parallel.pp_cuts = cuts
    for rank in (0, 1):
        g = parallel.Grid(world=2, rank=rank, pp=2, pp_rank=rank)
        stage = parallel.build_model(cfg, g, "cpu", stage=lambda m: pipeline.PipelineStage(m, pipeline.stage_bounds(cfg), rank))
        got = Checkpointer(cfg, g).load_latest(names=set(stage.state_dict()))
        assert (got.rng is not None) == (cuts == "1"), (cuts, rank)      # None: read as another layout
        stage.load_state_dict(got.model)
        resumed = optim.build_optimizer(stage, cfg, g)
        resumed.load_state_dict(got.optim)
        for k, v in stage.state_dict().items():
            assert torch.equal(v, full.state_dict()[k]), (cuts, rank, k)
        for k, v in resumed.state_dict()["state"].items():
            assert torch.equal(v, want[k]), (cuts, rank, k)


def test_a_resharded_piece_holds_its_own_memory_not_the_tensor_joined_for_it():
    """reshard.reshard joins each tensor from every saved TP rank's piece and cuts this rank's: the cut is
    a view of the joined tensor (chunk, the vocabulary's padding slice) or, replicated, the saved piece
    itself. Kept as a view, each rank would hold every full tensor while it loads (a 128256 x 8192 bf16
    embedding at TP=32: 2 GiB a rank, not 64 MiB), and a save of it would write the whole storage."""
    m = configs.ModelConfig(vocab_size=97, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128)
    full = {k: torch.randn(s) for k, s in llama.param_shapes(m).items()}
    shards = [{k: sharding.cut(k, v, m, 2, r).clone() for k, v in full.items()} for r in range(2)]
    for tp, rank in ((4, 1), (1, 0)):
        for k, t in reshard.reshard(shards, m, tp, rank).items():
            assert torch.equal(t, sharding.cut(k, full[k], m, tp, rank)), k
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (k, tp)
            assert all(t.data_ptr() != s[k].data_ptr() for s in shards), (k, tp)


def test_a_killed_writes_leftover_temporary_folder_does_not_fail_the_next_save_of_that_step(tmp_path):
    """A write killed in step_N/.tmp-rankR leaves files there; a restart that trains to step N again (from
    an older checkpoint, perhaps at another layout, whose files have other names) writes into the same
    folder: the leftovers are cleared first, or the folder's last rmdir failed the save."""
    cfg = tiny_cfg(tmp_path)
    model, opt = trained(cfg, steps=1)
    stale = tmp_path / "step_00000002" / ".tmp-rank00000"
    stale.mkdir(parents=True)
    (stale / "optim_dp01_tp00_pp00.pt").write_bytes(b"half a file")
    ck = Checkpointer(cfg)
    ck.save(2, model.state_dict(), opt.state_dict())
    ck.close()
    assert not stale.exists() and (tmp_path / "latest").read_text() == "step_00000002"
    assert Checkpointer(cfg).load_latest().step == 2
