"""Resume anywhere, exactly, and never lose the user's work (issue 17): a run moved across
TP, PP, DP and ZeRO-1 layouts equals an uninterrupted one, with real torchrun processes."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402
import ckptdir  # noqa: E402
import ckptsave  # noqa: E402
import configs  # noqa: E402
import data  # noqa: E402
import reshard  # noqa: E402
import sources  # noqa: E402
from conftest import cache_arg, mixture_counts, seeded_model  # noqa: E402
from gloo_spawn import run_train  # noqa: E402

ARGS = ["--model.n_layers=2", "--model.dim=32", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=64",
        "--data.seq_len=32", "--model.max_seq_len=32", "--data.global_batch=4", "--data.micro_batch=1",
        "--optim.warmup_steps=2", "--optim.decay_steps=10", "--optim.precision=fp32", "--ckpt.interval=4",
        "--ckpt.keep=5", "--device=cpu", "--log.interval=1", "--log.eval_interval=0", "--log.sample_tokens=0",
        "--log.tensorboard="]


def train(out: Path, *extra, nproc: int = 1, timeout: int = 300, env=None) -> subprocess.CompletedProcess:
    return run_train([f"--out_dir={out}", f"--ckpt.dir={out}/ckpt", *ARGS, *extra], nproc, env=env, timeout=timeout)


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
        src = reshard.SavedOptim(d, f"tp00_pp{p:02d}", layout, d.name)
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


@pytest.mark.slow
def test_resume_across_tp_pp_dp_zero1_equals_uninterrupted(tmp_path):
    """4 steps at TP=2 x DP=2, 4 at PP=2 x DP=2 with ZeRO-1, 4 in one process == 12 uninterrupted
    steps of one process: weights and optimizer state at each resume point and at the end (fp32,
    1e-5), the data positions exactly, and the global batches after each resume torch.equal. The data is
    a 0.7/0.3 mixture: its line at each evaluation is the uninterrupted run's, which is the hash's recount."""
    text = [Path(f).read_text() for f in sources.stdlib_files()[:30]]
    for name, part in (("a", text[:20]), ("b", text[20:])):
        (tmp_path / f"{name}.txt").write_text("\n\n".join(part))
    mix = [f"--data={tmp_path}/a.txt:0.7,{tmp_path}/b.txt:0.3", "--log.eval_interval=2", "--log.eval_windows=2"]
    refs = []                     # the uninterrupted run meanwhile: it fills the torchrun starts' idle time
    reference = threading.Thread(target=lambda: refs.append(train(tmp_path / "ref", "--optim.max_steps=12", *mix)))
    reference.start()
    a = ok(train(tmp_path / "run", "--optim.max_steps=4", "--tp=2", "--dp=2", *mix, nproc=4))
    b = ok(train(tmp_path / "run", "--optim.max_steps=8", "--pp=2", "--dp=2", "--parallel.zero1=true", *mix, nproc=4))
    c = ok(train(tmp_path / "run", "--optim.max_steps=12", *mix))
    reference.join()
    ref = ok(refs[0])
    assert "resuming from" in b.stdout and "resuming from" in c.stdout
    assert "'tp': 2" in b.stdout and "'zero1': True" in c.stdout            # both resumes changed layout
    assert "; ZeRO-1: " in b.stdout and "1 collective bucket of at most" in b.stdout      # the console names the buckets
    cfg = configs.from_args([*ARGS, *mix, cache_arg()])     # (global_batches builds the tokenizer: the session cache)
    # Each rank's loader stats, summed over the DP replicas at TP=2 and PP=2 (train.run_total): the mixture
    # line of every evaluation equals the uninterrupted run's and the recount of the stream from window 0.
    mixture = lambda *rs: re.findall(r"step +\d+ \| data mixture .*", "".join(r.stdout for r in rs))
    assert mixture(a, b, c) == mixture(ref) and len(mixture(ref)) == 6, (mixture(a, b, c), mixture(ref))
    loader = data.PackedLoader(cfg.data, data.build_tokenizer(cfg.data, cfg.model.vocab_size), prefetch=0)
    assert mixture(ref)[-1] == f"step     12 | {loader.corpus.mixture_line(mixture_counts(loader, 12))}"
    m = cfg.model
    for step in (4, 8, 12):
        want, got = (tmp_path / x / "ckpt" / f"step_{step:08d}" for x in ("ref", "run"))
        assert_close(reshard.full_model_state(want, m), reshard.full_model_state(got, m), f"weights {step}")
        if step > 4:                                                     # (step 4 is TP=2: compared at 12)
            assert_close(full_optim(want), full_optim(got), f"optimizer state {step}")
        # The same windows consumed from every stream: the positions, merged over DP ranks, are equal.
        merged = lambda d: {s: p for st in data_states(d) for s, p in st["streams"].items()}
        assert merged(want) == merged(got), step
    assert {**losses(a.stdout), **losses(b.stdout), **losses(c.stdout)} == losses(ref.stdout)
    # The monitor goes on as if never stopped (issue 10): its spike detector's running mean holds all 12
    # steps' gradient norms, not the last resume's 4 (before, meta.json held the tokens seen only).
    extra = lambda x: json.loads((tmp_path / x / "ckpt" / "step_00000012" / "meta.json").read_text())["extra"]
    want, got = extra("ref"), extra("run")
    assert got["tokens_seen"] == want["tokens_seen"] == 12 * 4 * 32 and len(got["monitor"]["spikes"]["history"]) == 12
    assert got["monitor"]["spikes"]["history"] == pytest.approx(want["monitor"]["spikes"]["history"], rel=1e-5)
    # The global batches after each resume, built from the saved positions at the new DP degree
    # exactly as train.py does, are the uninterrupted run's.
    straight = global_batches(cfg, 1, 12)
    run = tmp_path / "run" / "ckpt"
    after4 = global_batches(cfg, 2, 4, data_states(run / "step_00000004"))
    after8 = global_batches(cfg, 1, 4, data_states(run / "step_00000008"))
    assert all(torch.equal(x, y) for x, y in zip(after4 + after8, straight[4:]))


# ----------------------------------------------------------------------------- preemption

def start(out: Path, *extra, nproc: int = 1) -> subprocess.Popen:
    args = [str(ROOT / "train.py"), f"--out_dir={out}", *ARGS, "--optim.max_steps=100000", "--ckpt.interval=0", *extra,
            cache_arg()]
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def signal_after(p: subprocess.Popen, sig: int, step: int, timeout: int = 300) -> tuple[str, str, float]:
    """Send `sig` once the run logs `step`; return its whole stdout and stderr, and the seconds
    from the signal to the end of the run."""
    seen = []
    for line in p.stdout:
        seen.append(line)
        if re.match(rf"step\s+{step} \|", line):
            p.send_signal(sig)
            sent = time.monotonic()
            break
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the run did not stop after the signal")
    return "".join(seen) + out, err, time.monotonic() - sent


def stopped_step(stdout: str, name: str) -> int:
    m = re.search(rf"{name}: stopped after step (\d+), saved", stdout)
    assert m, stdout[-3000:]
    return int(m.group(1))


def heard_during(stderr: str, name: str, world: int) -> int:
    """The first step any rank heard the signal during: the step the run must stop after."""
    heard = {int(r): int(s) for r, s in re.findall(rf"\[rank (\d+)\] {name} during step (\d+):", stderr)}
    assert sorted(heard) == list(range(world)), stderr[-3000:]
    return min(heard.values())


def assert_only_checkpoint(ckpt: Path, step: int):
    steps = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_"))
    assert steps == [f"step_{step:08d}"], steps
    verdict, problem, files = ckptdir.check(ckpt / steps[0])
    assert verdict == ckptdir.OK and files                          # every rank's marker: all saved this step



@pytest.mark.slow
def test_a_reset_data_resume_at_another_dp_degree_says_only_that_the_stream_starts_afresh(tmp_path):
    """Resumed at DP=1 from DP=2 with --ckpt.reset_data, the console said both "data loaders take the saved
    positions of their streams" (reshard.read) and "the data stream starts afresh" (train.py): the second is
    what happens (data.md's "A new corpus, same run")."""
    ok(train(tmp_path / "run", "--optim.max_steps=2", "--ckpt.interval=2", "--dp=2", nproc=2))
    r = ok(train(tmp_path / "run", "--optim.max_steps=3", "--ckpt.reset_data"))
    assert "saved at layout" in r.stdout and "the data stream starts afresh" in r.stdout, r.stdout
    assert "saved positions" not in r.stdout, r.stdout

@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--dp=2"], ["--tp=2", "--pp=2"]], ids=["dp2", "tp2xpp2"])
def test_sigterm_to_torchrun_stops_after_the_step_it_came_during_within_30s(tmp_path, layout):
    """SIGTERM to a torchrun job (gloo) in the middle of its run: torchrun forwards it to every
    worker, each notes the step it came during, and the ranks agree at that step's boundary (not
    one later): a complete checkpoint of exactly that step, every rank's marker, and the run ends,
    exit 0 from the workers, well inside torchrun's fixed 30 s (it SIGKILLs them after that), with
    no traceback of ours (torchrun's own agent raises its SignalException)."""
    world = 2 if layout == ["--dp=2"] else 4
    p = start(tmp_path / "tr", *layout, nproc=world)
    out, err, took = signal_after(p, signal.SIGTERM, 3)
    step = stopped_step(out, "SIGTERM")
    assert step == heard_during(err, "SIGTERM", world) >= 3, err[-3000:]
    assert_only_checkpoint(tmp_path / "tr" / "ckpt", step)
    assert took < 30 and "Sending process" in err and "forcefully exiting via" not in err, (took, err[-3000:])
    tracebacks = err.split("Traceback (most recent call last)")[1:]
    assert all("train.py" not in t and t.rstrip().splitlines()[-1].startswith(
        "torch.distributed.elastic.multiprocessing.api.SignalException") for t in tracebacks), err[-3000:]


@pytest.mark.slow
def test_sigint_and_sigusr1_stop_a_single_process_with_a_checkpoint(tmp_path):
    """SIGINT (Ctrl-C) and SIGUSR1 (SLURM's early warning) to a single process: the same stop,
    exit status 0."""
    runs = {sig: start(tmp_path / sig.name) for sig in (signal.SIGINT, signal.SIGUSR1)}   # together: the start-ups overlap
    for sig, p in runs.items():
        out, err, _ = signal_after(p, sig, 2)
        assert p.returncode == 0 and "Traceback" not in err, err[-3000:]
        step = stopped_step(out, sig.name)
        assert step == heard_during(err, sig.name, 1)
        assert_only_checkpoint(tmp_path / sig.name / "ckpt", step)


# ----------------------------------------------------------------------------- shared directories, damage, disks

@pytest.mark.slow
def test_a_second_run_on_a_held_directory_is_refused_naming_the_holder(tmp_path):
    """This test process holds the directory (as a running job does); a second train.py, placed
    there by --out_dir alone, stops before any work with the holder named. Released, it is free."""
    cfg = configs.from_args([f"--out_dir={tmp_path}/run"])
    assert (cfg.ckpt.dir, cfg.log.tensorboard) == (f"{tmp_path}/run/ckpt", f"{tmp_path}/run/tb")
    explicit = configs.from_args([f"--out_dir={tmp_path}/run", "--ckpt.dir=elsewhere", "--log.tensorboard="])
    assert (explicit.ckpt.dir, explicit.log.tensorboard) == ("elsewhere", "")
    holder = checkpoint.Checkpointer(cfg)
    holder.claim()
    r = train(tmp_path / "run", "--optim.max_steps=2", timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert f"is in use by another run (pid {os.getpid()} on" in r.stderr and "--out_dir" in r.stderr
    assert "step" not in r.stdout.split("nanotrn:")[-1]                 # no training happened
    holder.close()
    again = checkpoint.Checkpointer(cfg)
    again.claim()                                                        # free once released
    again.close()


def save_steps(root: Path, *steps) -> configs.Config:
    cfg = configs.from_args([f"--ckpt.dir={root}", "--ckpt.async_save=false"])
    ck = checkpoint.Checkpointer(cfg)
    for s in steps:
        ck.save(s, {"w": torch.full((4,), float(s))}, None, data={"pos": s})
    ck.close()
    return cfg


@pytest.mark.parametrize("damage", [
    lambda m: m.pop("files"), lambda m: m.update(world="1"), lambda m: m.update(files={"meta.json": {"bytes": "9"}}),
    lambda m: m.update(files=[1]), lambda m: m.pop("step")])
def test_damaged_marker_is_skipped_in_resume_and_ls(tmp_path, capsys, damage):
    cfg = save_steps(tmp_path / "ck", 1, 2)
    marker = tmp_path / "ck" / "step_00000002" / "rank00000.done"
    m = json.loads(marker.read_text())
    damage(m)
    marker.write_text(json.dumps(m))
    checkpoint.cli(["ls", str(tmp_path / "ck")])
    assert "step_00000002  BAD: rank 0's completion marker is damaged" in capsys.readouterr().out
    loaded = checkpoint.Checkpointer(cfg).load_latest()
    assert loaded.step == 1 and torch.equal(loaded.model["w"], torch.full((4,), 1.0))
    assert "skipping step_00000002: rank 0's completion marker is damaged" in capsys.readouterr().out


@pytest.mark.slow
def test_full_disk_unwritable_dir_lost_latest_and_bad_dirs(tmp_path, capsys, monkeypatch):
    """A checkpoint directory on a 1 MiB tmpfs (simulated ENOSPC where mounting is not allowed): the
    run stops with "disk full", naming the save that failed, at the latest at the next save (which
    waits for the one in flight): the background writer may get no CPU for steps on a loaded host
    (it runs at background priority), and the step boundary after its failure stops the run (the
    next test). A file or a
    read-only mount as --ckpt.dir is refused before any work. A complete checkpoint whose `latest`
    could not be written is still found; a `.bad` directory stays after the next good save."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    try:
        if mounted:
            r = train(small / "out", "--optim.max_steps=100", "--ckpt.interval=5", "--ckpt.dir=" + str(small / "ckpt"))
            assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
            assert "error: disk full: no space left on the device of" in r.stderr, r.stderr[-2000:]
            assert "writing the checkpoint of step 5 " in r.stderr, r.stderr[-2000:]
            steps = losses(r.stdout)
            assert 5 in steps and max(steps) <= 10, sorted(steps)       # by the next save, not the end (100)
            assert not any(p.name.startswith(".tmp") for p in (small / "ckpt" / "step_00000005").iterdir())
            subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
            with pytest.raises(checkpoint.CheckpointError, match="is on a read-only file system"):
                checkpoint.Checkpointer(configs.from_args([f"--ckpt.dir={small}/other"])).claim()
        else:                                       # simulated: the writer's first file write fails
            def full(*a, **k):
                raise OSError(28, "No space left on device")
            monkeypatch.setattr(ckptsave, "write_file", full)
            with pytest.raises(checkpoint.CheckpointError, match="disk full: no space left"):
                save_steps(small, 1)
            monkeypatch.undo()
    finally:
        if mounted:
            subprocess.run(["umount", str(small)])
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(checkpoint.CheckpointError, match="is a file, not a directory"):
        checkpoint.Checkpointer(configs.from_args([f"--ckpt.dir={tmp_path}/a_file"])).claim()

    root = tmp_path / "ck"
    (root / "latest" / "blocker").mkdir(parents=True)      # `latest` cannot be replaced
    (root / "step_00000007.bad123").mkdir()
    cfg = save_steps(root, 1)
    assert "complete but `latest` could not be updated" in capsys.readouterr().out
    assert checkpoint.Checkpointer(cfg).load_latest().step == 1
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000007.bad123"]


def test_a_failed_background_save_stops_the_run_at_the_next_step_boundary(tmp_path, monkeypatch):
    """train.py calls ckpt.check() at every step boundary: while the background write goes on it
    neither waits nor raises (the step does not wait for the disk); the first one after the write
    failed raises "disk full", naming the step (the run stops there: "named at once"). Event-driven:
    the write fails when the test opens its gate, and the writer thread's end is joined."""
    gate = threading.Event()

    def full(*a, **k):
        gate.wait(300)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ckptsave, "write_file", full)
    ck = checkpoint.Checkpointer(configs.from_args([f"--ckpt.dir={tmp_path}/ck"]))
    assert ck.c.async_save
    ck.claim()
    ck.save(5, {"w": torch.ones(4)}, {"m": torch.zeros(4)}, data={"pos": 5}, defer_copy=True)
    ck.before_update()
    assert ck.in_flight
    ck.check()                                          # still writing: no wait, nothing to say
    assert ck.in_flight
    gate.set()
    ck.writer._thread.join(300)                         # the write has failed
    with pytest.raises(checkpoint.CheckpointError, match="disk full: no space left on the device of .* "
                                                         "writing the checkpoint of step 5 "):
        ck.check()
    ck.close()                                          # said once: the run's last wait has nothing more
    assert not (tmp_path / "ck" / "step_00000005" / ".tmp-rank00000").exists()


@pytest.mark.parametrize("keep,advice", [(1, "free space, or point --ckpt.dir at a larger disk"),
                                         (3, "free space, lower --ckpt.keep (3), or point"),
                                         (0, "free space, set --ckpt.keep (0 keeps them all), or point")])
def test_disk_full_advises_keeping_fewer_only_where_that_frees_room(tmp_path, monkeypatch, keep, advice):
    """At --ckpt.keep=1 a new save already has only the newest beside it (it is deleted once the new
    one is complete): "lower --ckpt.keep" cannot help there and is not said (it was, at any keep)."""
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ckptsave, "write_file", full)
    ck = checkpoint.Checkpointer(configs.from_args([f"--ckpt.dir={tmp_path}/ck", f"--ckpt.keep={keep}",
                                                    "--ckpt.async_save=false"]))
    ck.claim()
    with pytest.raises(checkpoint.CheckpointError, match="disk full") as e:
        ck.save(1, {"w": torch.ones(4)}, {"m": torch.zeros(4)}, data={"pos": 1})
    ck.close()
    assert advice in str(e.value), str(e.value)
    assert ("--ckpt.keep" in str(e.value)) == (keep != 1), str(e.value)


@pytest.mark.parametrize("code,says", [(errno.ENOSPC, "disk full: no space left on the device of"),
                                       (errno.EDQUOT, "disk quota exceeded on"),
                                       (errno.EIO, "Input/output error")])
def test_a_write_failing_inside_torch_save_is_named_by_its_cause(tmp_path, monkeypatch, code, says):
    """torch.save's zip writer turns the file's OSError into a RuntimeError without its errno
    ("[enforce fail at inline_container.cc] unexpected pos ..."): a quota (EDQUOT: FSx for Lustre,
    NFS) or one full Lustre OST where df still shows free space was not named, only that "disk
    full" guessed from free < need. The write's own error is what the user is told."""
    class Fails:                    # a .pt file fails once torch.save has written 1 KiB into it
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 1024:
                raise OSError(code, os.strerror(code))
            return self.f.write(b)
    ck = checkpoint.Checkpointer(configs.from_args([f"--ckpt.dir={tmp_path}/ck", "--ckpt.async_save=false"]))
    monkeypatch.setattr(ck.faults, "file", lambda step, name, sizes: Fails if name.endswith(".pt") else None)
    ck.claim()
    with pytest.raises(checkpoint.CheckpointError) as e:
        ck.save(1, {"w": torch.ones(4096)}, {"m": torch.zeros(4)}, data={"pos": 1})
    ck.close()
    assert says in str(e.value) and "enforce fail" not in str(e.value), str(e.value)
    assert "writing the checkpoint of step 1" in str(e.value) or code == errno.EIO, str(e.value)
    assert not (tmp_path / "ck" / "step_00000001" / ".tmp-rank00000").exists()


def test_a_write_error_of_another_errno_on_a_disk_without_room_is_named_disk_full(tmp_path, monkeypatch):
    """A full disk does not always say ENOSPC (an NFS server's EIO, EFBIG): with less free space than the
    rank's part needs, the failed save is still named a full disk, with the free space and the fix."""
    def fails(*a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(ckptsave, "write_file", fails)
    ck = checkpoint.Checkpointer(configs.from_args([f"--ckpt.dir={tmp_path}/ck", "--ckpt.async_save=false"]))
    ck.claim()
    monkeypatch.setattr(ckptsave.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=0))
    with pytest.raises(checkpoint.CheckpointError, match="disk full: no space left on the device of") as e:
        ck.save(1, {"w": torch.ones(4096)}, {"m": torch.zeros(4)}, data={"pos": 1})
    ck.close()
    assert "0.0 MiB were free" in str(e.value), str(e.value)


def test_a_resume_takes_its_weights_from_the_checkpoint_alone(tmp_path, monkeypatch):
    """train.py on a resume fills the empty model from the checkpoint and nothing else: no
    parameter is initialized (work thrown away: 5.9 s per restart at 134M, bench.py ckpt) nor read
    from a Hugging Face folder, and the optimizer is built on exactly the saved weights."""
    import hf
    import model as llama
    import optim
    import train
    args = [f"--out_dir={tmp_path}", f"--ckpt.dir={tmp_path}/ckpt", *ARGS, "--ckpt.async_save=false",
            "--log.peak_tflops=1", cache_arg()]
    train.main([*args, "--steps=1"])
    saved = torch.load(tmp_path / "ckpt" / "step_00000001" / "model_tp00_pp00.pt", weights_only=True)

    def no_init(*a, **k):
        raise AssertionError("a parameter was initialized on resume")
    monkeypatch.setattr(llama, "init_param_part", no_init)
    monkeypatch.setattr(hf, "load_sharded", no_init)
    seen, build = {}, optim.build_optimizer
    monkeypatch.setattr(optim, "build_optimizer", lambda model, *a, **kw: seen.update(
        {k: v.clone() for k, v in model.state_dict().items()}) or build(model, *a, **kw))
    train.main([*args, "--steps=2"])
    assert set(seen) == set(saved) and all(torch.equal(seen[k], v) for k, v in saved.items())


def test_a_failed_last_save_still_closes_the_hang_watchdog(tmp_path, monkeypatch):
    """train.main's error from its last save (ckpt.close: a full disk, a lost rank) still closes the
    watchdog: its thread and faulthandler backstop (exit=True) would end the process minutes later."""
    import monitor
    import train
    closed, close = [], monitor.Watchdog.close
    monkeypatch.setattr(monitor.Watchdog, "close", lambda self: closed.append(self) or close(self))

    def fails(self):
        raise checkpoint.CheckpointError("the last save failed")
    monkeypatch.setattr(checkpoint.Checkpointer, "close", fails)
    with pytest.raises(checkpoint.CheckpointError, match="the last save failed"):
        train.main([f"--out_dir={tmp_path}", f"--ckpt.dir={tmp_path}/ckpt", *ARGS, "--ckpt.async_save=false",
                    "--log.peak_tflops=1", "--steps=1", cache_arg()])
    assert len(closed) == 1 and closed[0].factor > 0 and closed[0]._closed


# ----------------------------------------------------------------------------- reads per rank

def _count_reads_worker(rank: int, port: int, root: str):
    """TP=2 x DP=2, gloo: save a trained state (without and with ZeRO-1), resume it with every
    checkpoint read counted (reshard.load_file wrapped), and check that it is what was saved."""
    import json as json_
    import torch.distributed as dist
    import optim
    import parallel
    import sharding
    from test_checkpoint import assert_state_equal, clone, random_step, tiny_cfg
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=4)
    counts, crcs = {}, {}
    real, real_crc = reshard.load_file, ckptdir.crc_of

    def counting(path, *a, **k):
        counts.setdefault(kind, []).append([Path(path).name, Path(path).stat().st_size])
        return real(path, *a, **k)

    def counting_crc(path):                  # the checksum pass reads every byte of a file too
        crcs.setdefault(kind, []).append(Path(path).name)
        return real_crc(path)
    reshard.load_file, ckptdir.crc_of = counting, counting_crc
    for kind in ("replicated", "zero1"):
        cfg = tiny_cfg(f"{root}/{kind}")
        cfg.parallel.tp, cfg.parallel.zero1, cfg.ckpt.async_save = 2, kind == "zero1", False
        grid = parallel.new_grid(4, rank, 2, 1, sharding.kv_replicas(cfg.model, 2), "gloo")
        model = seeded_model(cfg, grid)
        opt = optim.build_optimizer(model, cfg, grid)
        if kind == "zero1":                  # ZeRO-1 reduces the gradients into each rank's shard first
            opt.step = (lambda step: lambda: (opt.reduce_scatter_and_clip(1e9), step()))(opt.step)
        random_step(model, opt, seed=1, grid=grid)
        want_model, want_optim = clone(model.state_dict()), opt.state_dict()
        ck = checkpoint.Checkpointer(cfg, grid)
        ck.save(1, model.state_dict(), opt.state_dict(), data={"dp_rank": grid.dp_rank})
        ck.close()
        dist.barrier()
        loaded = checkpoint.Checkpointer(cfg, grid).load_latest(names=set(want_model))
        assert_state_equal(want_model, loaded.model)
        assert_state_equal(want_optim["state"], loaded.optim["state"])
        assert loaded.data == {"dp_rank": grid.dp_rank}
    Path(f"{root}/reads{rank}.json").write_text(json_.dumps(counts))
    Path(f"{root}/crcs{rank}.json").write_text(json_.dumps(crcs))
    dist.destroy_process_group()


@pytest.mark.slow
def test_resume_reads_each_shared_file_once_per_dp_group_and_zero1_shards_by_their_owners(tmp_path):
    """A counting wrapper around every checkpoint read (reshard.load_file) and every checksum pass
    (ckptdir.crc_of), at TP=2 x DP=2: each model file, and without ZeRO-1 each optimizer file, is
    read by ONE rank of its DP group and broadcast to the other (before: by both); a ZeRO-1 shard
    only by its owner; every rank reads its own rank file. The rank that loads a file is the one
    that checksummed it (its writer), so the second read is that node's page cache: no file's bytes
    go from the shared file system to two ranks (before: the verifier and another replica's reader).
    The resumed state equals the saved one, tensor for tensor."""
    from gloo_spawn import free_ports, spawn
    spawn(_count_reads_worker, (free_ports(1)[0], str(tmp_path)), nprocs=4)
    reads = {r: json.loads((tmp_path / f"reads{r}.json").read_text()) for r in range(4)}
    crcs = {r: json.loads((tmp_path / f"crcs{r}.json").read_text()) for r in range(4)}
    # rank = dp_rank * tp + tp_rank; writer_dp_rank: file k of n (model files, then optimizer files
    # without ZeRO-1) on replica k * 2 // n: replicated, the models on 0 and 1, the optimizers on 2 and 3
    want = {"replicated": [["model_tp00_pp00.pt"], ["model_tp01_pp00.pt"], ["optim_tp00_pp00.pt"], ["optim_tp01_pp00.pt"]],
            "zero1": [["model_tp00_pp00.pt", "optim_dp000_tp00_pp00.pt"], ["optim_dp000_tp01_pp00.pt"],
                      ["optim_dp001_tp00_pp00.pt"], ["model_tp01_pp00.pt", "optim_dp001_tp01_pp00.pt"]]}
    for kind in ("replicated", "zero1"):
        names = {r: sorted(n for n, _ in reads[r][kind]) for r in range(4)}
        assert names == {r: sorted(want[kind][r] + [f"rank{r:05d}.pt"]) for r in range(4)}, names
        files = [n for r in range(4) for n, _ in reads[r][kind]]
        assert len(files) == len(set(files))          # no file read twice, on any rank
        for r in range(4):                            # checksummed where loaded, nowhere else
            shards = {n for n in crcs[r].get(kind, []) if n.startswith(("model_", "optim_"))}
            assert shards == set(want[kind][r]), (r, crcs[r])


# ----------------------------------------------------------------------------- the rare abort at resume

SOAK = int(os.environ.get("NANOTRN_SOAK", "0"))


@pytest.mark.slow
@pytest.mark.skipif(not SOAK, reason="NANOTRN_SOAK=20 runs it: 20 resumes of an 8-rank run, about 25 s each on "
                                     "an idle 2-core machine (8 min)")
def test_8_rank_resume_never_aborts(tmp_path):
    """Issue 25's rare crash: an 8-rank run (TP=2, PP=2, DP=2, SP, ZeRO-1, fp32) stopped by SIGTERM
    and resumed under torchrun once died with "terminate called without an active exception"
    (SIGABRT) on one rank: a gloo thread dropping the last reference to a finished collective's
    tensor takes the GIL while the interpreter finalizes. train.py now waits for every collective
    (the stop agreement is blocking) and ends with os._exit (train.exit_now): no finalization.
    The stopped run is resumed NANOTRN_SOAK times from a pristine copy; every resume must end
    with status 0 and no abort."""
    import shutil
    layout = ["--tp=2", "--pp=2", "--dp=2", "--sp=true", "--zero1=true"]
    p = start(tmp_path / "base", *layout, "--optim.max_steps=6", nproc=8)
    out, err, _ = signal_after(p, signal.SIGTERM, 2)
    step = stopped_step(out, "SIGTERM")
    assert step < 6, out[-2000:]
    for i in range(SOAK):
        run = tmp_path / "run"
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(tmp_path / "base", run)
        r = run_train([f"--out_dir={run}", *ARGS, "--optim.max_steps=6", "--ckpt.interval=0", *layout], 8, timeout=600)
        assert r.returncode == 0 and "terminate called" not in r.stderr, f"resume {i}: {r.stderr[-3000:]}"
        assert f"resuming from {run}/ckpt/step_{step:08d}" in r.stdout and "step      6 |" in r.stdout
