"""train.py end to end: a real subprocess run on the embedded corpus whose loss falls."""
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from conftest import cache_arg  # noqa: E402
import configs  # noqa: E402
import optim  # noqa: E402
pytestmark = pytest.mark.slow         # each test runs train.py in a subprocess


def run_train(tmp_path, *args, timeout=1500, env=None):
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path}/out",
           f"--ckpt.dir={tmp_path}/out/ckpt", f"--log.tensorboard={tmp_path}/out/tb", cache_arg(), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "2", **(env or {})})


def losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"step\s+\d+ \| loss ([0-9.]+)", stdout)]


def test_tiny_training_run_loss_falls(tmp_path):
    # A smaller tiny model for speed; the tokenizer is trained on the stdlib corpus and cached in
    # the session's cache (conftest.cache_arg), so only the session's first run pays for it.
    # 16 steps: the loss falls ~2 nats by then (8.2 at step 2, 6.2 at 16); 40 steps cost 2.5x the time for no
    # more claim. Logged every 2 steps: 8 lines, 2 evaluations.
    r = run_train(tmp_path, "--model.n_layers=2", "--model.dim=128", "--model.n_heads=4", "--model.n_kv_heads=2",
                  "--model.ffn_dim=352", "--data.seq_len=128", "--data.global_batch=8", "--data.micro_batch=4",
                  "--optim.max_steps=16", "--optim.warmup_steps=4", "--optim.decay_steps=12", "--optim.lr=3e-3",
                  "--log.interval=2", "--log.eval_interval=8", "--log.eval_windows=2", "--log.sample_tokens=16")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ls = losses(r.stdout)
    assert len(ls) == 8, r.stdout
    assert ls[-1] < ls[0] - 1.0, ls                     # from ~ln(4096)=8.3 down by well over a nat
    # the line of step s says the lr that step s trained with: the schedule's at its 0-based index s - 1
    o = configs.from_args(["--optim.max_steps=16", "--optim.warmup_steps=4", "--optim.decay_steps=12",
                           "--optim.lr=3e-3"]).optim
    lrs = re.findall(r"step\s+(\d+) \| loss [0-9.]+ \| lr (\S+) ", r.stdout)
    assert lrs == [(s, f"{optim.lr_at(int(s) - 1, o):.2e}") for s, _ in lrs] and len(lrs) == 8, lrs
    assert "val loss" in r.stdout and "sample:" in r.stdout
    # the last line says what to do next (it was the sample's text): where the export, checkpoints, curves are
    assert r.stdout.splitlines()[-1] == (f"next: {tmp_path}/out/hf loads in transformers (docs/huggingface.md); checkpoints: "
                                         f"python checkpoint.py ls {tmp_path}/out/ckpt; curves: tensorboard --logdir {tmp_path}/out/tb")
    # Honest MFU on a CPU run: the peak is named, and no interval reads above 100%. (xla: an earlier
    # test of the session imported torch_xla, which sets PJRT_DEVICE, and train.py follows it.)
    # (cpu: one thread's rate where the run's two measured less, a busy host; hardware.thread_floor)
    assert re.search(r"MFU peak: .* \(measured: the model's \d+ matmul shapes in float32 on "
                     r"(cpu, 2 threads|cpu, 1 thread \(the run's 2 threads .*\)|xla)\)", r.stdout), r.stdout
    mfus = [float(x) for x in re.findall(r"MFU ([0-9.]+)%", r.stdout)]
    assert len(mfus) == 8 and max(mfus) <= 100.0, mfus
    assert os.path.exists(f"{tmp_path}/out/hf/model.safetensors")


SMALL = ["--model.n_layers=1", "--model.dim=64", "--model.n_heads=4", "--model.n_kv_heads=2", "--model.ffn_dim=128",
         "--data.seq_len=64", "--model.max_seq_len=64", "--data.global_batch=4", "--data.micro_batch=4",
         "--optim.max_steps=8", "--log.interval=1", "--log.eval_interval=0", "--log.sample_tokens=0",
         "--ckpt.interval=3", "--ckpt.async_save=false"]


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory) -> dict:
    """mode -> (folder, finished run) of the two injected-NaN runs, started together: each is mostly
    one busy core (start-up, a 1-layer model's steps), so on 2 cores the pair takes about one's time."""
    folders = {mode: tmp_path_factory.mktemp(f"nan_{mode}") for mode in ("skip", "stop")}
    with ThreadPoolExecutor(2) as pool:
        runs = {mode: pool.submit(run_train, d, *SMALL, f"--log.on_nonfinite={mode}", env={"NANOTRN_FAULT": "nan:4"})
                for mode, d in folders.items()}
    return {mode: (folders[mode], runs[mode].result()) for mode in folders}


def test_injected_nan_is_skipped(nan_runs):
    """on_nonfinite=skip: the poisoned step changes nothing, training goes on and finishes."""
    tmp_path, r = nan_runs["skip"]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "step 5: non-finite loss" in r.stdout and "update skipped" in r.stdout
    assert os.path.isdir(f"{tmp_path}/out/ckpt/step_00000008")
    import torch
    sd = torch.load(f"{tmp_path}/out/ckpt/step_00000008/model_tp00_pp00.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in sd.values())


def test_injected_nan_stops_and_keeps_last_good_checkpoint(nan_runs):
    """on_nonfinite=stop: a clear message, no checkpoint of the poisoned state, the last good one intact."""
    tmp_path, r = nan_runs["stop"]
    assert r.returncode != 0
    assert "non-finite" in r.stderr, r.stderr[-2000:]
    ckpts = sorted(d for d in os.listdir(f"{tmp_path}/out/ckpt") if d.startswith("step_"))
    assert ckpts == ["step_00000003"], ckpts
    import checkpoint
    import configs
    cfg = configs.from_args(SMALL + [f"--ckpt.dir={tmp_path}/out/ckpt"])
    loaded = checkpoint.Checkpointer(cfg).load_latest()
    assert loaded is not None and loaded.step == 3
    import torch
    assert all(torch.isfinite(v).all() for v in loaded.model.values())


def test_main_in_process_gives_back_the_signal_handlers(tmp_path, monkeypatch):
    """train.main in a test or a notebook: the handlers StopSignal installs (SIGTERM, SIGUSR1, SIGINT:
    stop at the next step boundary) are the caller's again when it returns, and when it raises."""
    import signal
    import checkpoint
    import monitor
    import train
    mine = lambda signum, frame: None                  # noqa: E731
    before = {sig: signal.signal(sig, mine) for sig in checkpoint.StopSignal.SIGNALS}
    try:
        args = [*SMALL, "--optim.max_steps=2", f"--out_dir={tmp_path}/out", f"--ckpt.dir={tmp_path}/out/ckpt",
                "--log.tensorboard=", "--device=cpu", cache_arg()]
        train.main(args)
        assert all(signal.getsignal(sig) is mine for sig in before)
        monkeypatch.setenv("NANOTRN_FAULT", "nan:1")
        with pytest.raises(monitor.NonFiniteError):
            train.main([*args, f"--out_dir={tmp_path}/o2", f"--ckpt.dir={tmp_path}/o2/ckpt", "--log.on_nonfinite=stop"])
        assert all(signal.getsignal(sig) is mine for sig in before)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)



def test_a_sigterm_while_a_rank_ends_on_an_error_does_not_take_its_error_line(tmp_path):
    """`python train.py` ending on an error (here NaN gradients, --log.on_nonfinite=stop; in CI a collective failed
    once rank 1 died) while torchrun's SIGTERM to every rank comes: main() put the default handler back as the error
    went up to cli, and a SIGTERM then ended the rank silently (exit -15, no error line: CI failed once on
    test_e2e_torchrun_restarts_by_itself_after_a_rank_dies_mid_save). The SIGTERM is sent here at that very moment:
    when the error reaches cli (a trace of the real entry point, run as __main__)."""
    args = [*SMALL, "--optim.max_steps=3", f"--out_dir={tmp_path}/out", f"--ckpt.dir={tmp_path}/out/ckpt",
            "--log.tensorboard=", "--device=cpu", "--log.on_nonfinite=stop", cache_arg()]
    script = ("import os, runpy, signal, sys\n"
              "def trace(frame, event, arg):\n"
              "    if frame.f_code.co_name != 'cli':\n"
              "        return None\n"
              "    def local(frame, event, arg):\n"
              "        if event == 'exception':                # main() raised into cli: its finally has run\n"
              "            os.kill(os.getpid(), signal.SIGTERM)\n"
              "        return None\n"
              "    return local\n"
              f"sys.argv = [{ROOT + '/train.py'!r}, *{args!r}]\n"
              "sys.settrace(trace)\n"
              f"runpy.run_path({ROOT + '/train.py'!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "2", "NANOTRN_FAULT": "nan:1"})
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "error: step 2: non-finite loss" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "[rank 0] SIGTERM while this rank ends on an error" in r.stderr, r.stderr     # not: stopping after step 2

def test_the_last_step_is_evaluated_once_and_changes_nothing(tmp_path, capsys, monkeypatch):
    """The run's last step is evaluated even when --log.eval_interval does not divide it (a user expects the final
    validation loss, as Megatron's evaluation after training), once when it does, never on a signal's stop (the
    grace period is for the save); and evaluating leaves the training stream alone: 3 steps (evaluated at 2, 3)
    resumed to 4 end with the weights of 4 steps not evaluated at all. In-process runs of the SMALL model."""
    import signal
    import torch
    import configs
    import optim
    import train

    def val_steps(args):
        capsys.readouterr()
        argv = [*SMALL, "--log.tensorboard=", "--device=cpu", "--log.peak_tflops=1", cache_arg(), *args]
        train.main(argv)
        out = capsys.readouterr().out
        # each step's lr is the schedule's at that step (0-based), from warmup's lr / 20 on: a shift passed unseen
        lrs = [float(x) for x in re.findall(r"step\s+\d+ \| loss [0-9.]+ \| lr ([0-9.e+-]+) \|", out)]
        start = len(lrs) and int(re.findall(r"step\s+(\d+) \| loss", out)[0]) - 1
        o = configs.from_args(argv).optim
        assert lrs == [float(f"{optim.lr_at(s, o):.2e}") for s in range(start, start + len(lrs))] and lrs, out
        return [int(s) for s in re.findall(r"step\s+(\d+) \| val loss", out)]

    def where(name):
        return [f"--out_dir={tmp_path}/{name}", f"--ckpt.dir={tmp_path}/{name}/ckpt"]
    assert val_steps([*where("a"), "--optim.max_steps=3", "--log.eval_interval=2"]) == [2, 3]
    assert val_steps([*where("a"), "--optim.max_steps=4", "--log.eval_interval=2"]) == [4]     # resumed at 3
    assert val_steps([*where("b"), "--optim.max_steps=4"]) == []                                # eval_interval=0: off
    weights = [torch.load(f"{tmp_path}/{n}/ckpt/step_00000004/model_tp00_pp00.pt", weights_only=True) for n in "ab"]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    step = train.train_step             # a real SIGTERM during step 1: the run stops after it, saved, not evaluated

    def signalled(*a, **k):
        if signalled.calls == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        signalled.calls += 1
        return step(*a, **k)
    signalled.calls = 0
    monkeypatch.setattr(train, "train_step", signalled)
    assert val_steps([*where("c"), "--optim.max_steps=4", "--log.eval_interval=2"]) == []
    assert [n for n in os.listdir(f"{tmp_path}/c/ckpt") if n.startswith("step_")] == ["step_00000001"]


def test_a_run_shorter_than_the_log_interval_plots_its_parameter_norm(tmp_path, capsys):
    """The parameter norm is taken at log steps and at the last: a run shorter than --log.interval took none, and
    `monitor.py plot`'s parameter-norm panel was empty. Its one point is drawn with a marker (a line of one point is
    invisible). In-process, the SMALL model, 3 steps."""
    import matplotlib.image
    import monitor
    import train
    train.main([*SMALL, "--optim.max_steps=3", "--log.interval=10", f"--out_dir={tmp_path}/out",
                f"--ckpt.dir={tmp_path}/out/ckpt", f"--log.tensorboard={tmp_path}/tb", "--device=cpu",
                "--log.peak_tflops=1", cache_arg()])
    assert re.search(r"step +3 \| loss .* \| param norm [0-9.]+ \|", capsys.readouterr().out)
    norms = monitor.read_scalars(f"{tmp_path}/tb")["train/param_norm"]
    assert [s for s, _ in norms] == [3], norms
    png = matplotlib.image.imread(monitor.plot_curves(f"{tmp_path}/tb", f"{tmp_path}/curves.png"))
    panel = png[:, 2 * png.shape[1] // 3:, :3]          # the third panel: drawn in C0 blue (31, 119, 180)
    assert (abs(panel - [31 / 255, 119 / 255, 180 / 255]).max(axis=2) < 0.1).sum() > 10


@pytest.mark.parametrize("message", [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4242: Connection reset by peer",
    "[torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356] NCCL error: remote process exited\nLast error:\nsocket "
    "closed\nncclRemoteError"])
def test_a_failed_collective_is_one_line_naming_the_restart(monkeypatch, message):
    """A collective that fails because a peer is gone (gloo: 'Connection reset'; nccl's DistError, whose message
    runs over several lines) ends train.py with one line, not a traceback: torchrun restarts the workers."""
    import torch
    import train
    error = torch.distributed.DistError if "NCCL" in message else RuntimeError

    def run(argv, keep_signals=False):
        raise error(message)
    monkeypatch.setattr(train, "main", run)
    with pytest.raises(SystemExit) as e:
        train.cli([])
    said = str(e.value.code)
    assert "\n" not in said and said.startswith("error: [rank 0] a collective failed") and "resumes from" in said
    # who restarts it: torchrun (--max-restarts), or under slurm_train.sbatch (static node ranks, torchrun's
    # --max-restarts=0) the sbatch loop (MAX_RESTARTS); it named torchrun's alone, which does not there
    assert "torchrun --max-restarts" in said and "slurm_train.sbatch's MAX_RESTARTS" in said
    assert ("Connection reset by peer" if error is RuntimeError else "NCCL error: remote process exited") in said


def test_a_tokenizer_copy_cut_short_leaves_no_part_of_it(tmp_path, monkeypatch):
    """Rank 0 keeps the run's tokenizer in <ckpt.dir>/tokenizer while the other ranks look there for a user's own
    (tokenizer_for_run), and a kill can come mid-copy: a part of the file seen there made a fresh 2-rank torchrun
    start refuse at random ("... is not this run's tokenizer ... move that folder out"), and after a kill, every
    rerun. The copy is whole or absent: here it stops halfway (as a kill would), and the same command runs."""
    import shutil
    import hf
    import train
    real = shutil.copyfile

    def half(src, dst):
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read()[:1000])
        raise KeyboardInterrupt          # the process ends here, as a SIGKILL would end it
    args = [*SMALL, "--optim.max_steps=1", f"--out_dir={tmp_path}/out", f"--ckpt.dir={tmp_path}/out/ckpt",
            "--log.tensorboard=", "--device=cpu", "--log.peak_tflops=1", cache_arg()]
    monkeypatch.setattr(hf.shutil, "copyfile", half)
    with pytest.raises(KeyboardInterrupt):
        train.main(args)
    monkeypatch.setattr(hf.shutil, "copyfile", real)
    train.main(args)
    assert os.listdir(f"{tmp_path}/out/ckpt/tokenizer") == ["tokenizer.model"]


def test_a_signal_in_the_set_up_stops_the_run_before_its_first_step(tmp_path, capsys, monkeypatch):
    """SIGTERM while the run sets up (data, tokenizer, a resume's load: minutes at scale) stops it before a step:
    nothing new to save, so no step and no save spend the launcher's grace period (a 2-rank torchrun took 7-8 s
    from SIGTERM to exit here, set-up then step 1 then its save). Fresh: nothing written; resumed: its checkpoint."""
    import signal
    import train
    setup = train.tokenizer_for_run

    def signalled(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return setup(*a, **k)
    args = [*SMALL, "--optim.max_steps=2", f"--out_dir={tmp_path}/out", f"--ckpt.dir={tmp_path}/out/ckpt",
            "--log.tensorboard=", "--device=cpu", "--log.peak_tflops=1", cache_arg()]
    monkeypatch.setattr(train, "tokenizer_for_run", signalled)
    train.main(args)
    out, err = capsys.readouterr()
    assert "SIGTERM during the set-up" in err and "SIGTERM: stopped after step 0, not saved" in out, out + err
    assert "| loss" not in out and not [n for n in os.listdir(f"{tmp_path}/out/ckpt") if n.startswith("step_")]
    monkeypatch.setattr(train, "tokenizer_for_run", setup)
    train.main(args)                                            # 2 steps, saved at 2
    monkeypatch.setattr(train, "tokenizer_for_run", signalled)
    capsys.readouterr()
    train.main([*args, "--optim.max_steps=4"])                  # resumed at 2, stopped there
    out = capsys.readouterr().out
    assert "| loss" not in out and "SIGTERM: stopped after step 2, saved in" in out, out
    assert [n for n in os.listdir(f"{tmp_path}/out/ckpt") if n.startswith("step_")] == ["step_00000002"]


def test_a_signal_after_the_last_step_is_not_told_as_a_step_to_come(tmp_path, capsys, monkeypatch):
    """SIGTERM / Ctrl-C once the last step is done (its save, the export, the sample): it said "SIGINT during step 13:
    stopping after it with a checkpoint" in a 12-step run, a step that never comes, while the run finished its
    export and sample and exited 0 (15 s here). Now it says the run is ending; the export is written whole."""
    import signal
    import train
    export = train.hf.save_hf

    def signalled(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return export(*a, **k)
    monkeypatch.setattr(train.hf, "save_hf", signalled)
    train.main([*SMALL, "--optim.max_steps=2", f"--out_dir={tmp_path}/out", f"--ckpt.dir={tmp_path}/out/ckpt",
                "--log.tensorboard=", "--device=cpu", "--log.peak_tflops=1", "--log.sample_tokens=0", cache_arg()])
    out, err = capsys.readouterr()
    assert "SIGTERM after the last step: the run is ending" in err and "during step" not in err, err
    assert "saved the final model" in out and os.path.isfile(f"{tmp_path}/out/hf/model.safetensors"), out


def test_a_finished_runs_command_again_says_so_and_redoes_nothing(tmp_path, capsys):
    """The command of a finished run, run again: one line says the run is complete and where its model is; no step,
    and the export the user has is not written again (nor the sample drawn); an export that is missing is written."""
    import train
    args = [*SMALL, "--optim.max_steps=2", f"--out_dir={tmp_path}/out", f"--ckpt.dir={tmp_path}/out/ckpt",
            "--log.tensorboard=", "--device=cpu", "--log.peak_tflops=1", "--log.sample_tokens=4", cache_arg()]
    train.main(args)
    export = f"{tmp_path}/out/hf/model.safetensors"
    before = os.stat(export).st_mtime_ns
    capsys.readouterr()
    train.main(args)
    out = capsys.readouterr().out
    assert out.count("already complete") == 1 and f"its final model is in {tmp_path}/out/hf" in out, out
    assert "| loss" not in out and "saved the final model" not in out and "sample:" not in out, out
    assert os.stat(export).st_mtime_ns == before
    os.rename(f"{tmp_path}/out/hf", f"{tmp_path}/moved")
    train.main(args)
    assert "saved the final model" in capsys.readouterr().out and os.path.isfile(export)


def test_a_ranks_own_failed_save_is_said_at_once(monkeypatch):
    """A full disk fails one rank's write (ckptsave.SaveFailed): no other rank meets that error, so the rank says it
    at once. Through monitor.say_once (for refusals every rank reaches) a 2-rank torchrun run sat 30 s silent, rank 1
    waiting for rank 0's line while rank 0 waited in the next step's collective (black-box, a 60 MB tmpfs)."""
    import ckptsave
    import monitor
    import torch
    import train

    def run(argv, keep_signals=False):
        raise ckptsave.SaveFailed("disk full: no space left on the device of /x writing the checkpoint of step 15")

    def say_once(message, *a, **k):
        raise AssertionError(f"said through say_once, which waits for rank 0: {message}")
    monkeypatch.setattr(train, "main", run)
    monkeypatch.setattr(monitor, "say_once", say_once)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    with pytest.raises(SystemExit) as e:
        train.cli([])
    assert str(e.value.code) == "error: disk full: no space left on the device of /x writing the checkpoint of step 15"


def _rerun_on_two_nodes(rank: int, port: int, args: list):
    """A rank of a 2-rank rerun whose rank 1 sees no export in --out_dir (a node's own disk, not shared)."""
    import torch
    import train
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    torch.set_num_threads(1)
    if rank == 1:
        real = os.path.isfile
        os.path.isfile = lambda p: not str(p).endswith(os.path.join("hf", "config.json")) and real(p)
    train.main(args)


def test_a_finished_runs_rerun_skips_the_export_on_every_rank_together(tmp_path):
    """Whether the export is already there is rank 0's view, which every rank follows: the export gathers the model
    (a collective), so a rank whose node does not see <out_dir>/hf (a node-local out_dir) must not gather alone while
    rank 0 skips it (it failed: 'Connection closed by peer', or hung until the timeout)."""
    import train
    from gloo_spawn import free_ports, spawn
    args = [*SMALL, "--optim.max_steps=1", f"--out_dir={tmp_path}/out",
            f"--ckpt.dir={tmp_path}/out/ckpt", "--log.tensorboard=", "--device=cpu", "--log.peak_tflops=1", cache_arg()]
    train.main(args)                                   # the finished run, one process
    before = os.stat(f"{tmp_path}/out/hf/model.safetensors").st_mtime_ns
    spawn(_rerun_on_two_nodes, (free_ports(1)[0], [*args, "--tp=2"]), 2, timeout_s=120)
    assert os.stat(f"{tmp_path}/out/hf/model.safetensors").st_mtime_ns == before


def test_plain_make_and_make_help_list_the_targets_and_install_nothing(tmp_path):
    """`make` alone installed the venv (its first target, .venv/.installed: gigabytes, minutes) and `make help` was
    "No rule to make target": both now print the header's list of commands and touch nothing."""
    import shutil
    shutil.copy(os.path.join(ROOT, "Makefile"), tmp_path)
    for argv in (["make"], ["make", "help"]):
        r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        for target in ("train", "test", "test-fast", "bench", "clean"):
            assert f"make {target} " in r.stdout, (argv, target, r.stdout)
    assert os.listdir(tmp_path) == ["Makefile"]


def test_make_clean_removes_what_make_built_and_keeps_the_runs(tmp_path):
    """`make clean` ran `rm -rf .venv out .cache`: out/ is where every run writes its checkpoints and export by
    default, so a user cleaning the venv lost their training. It removes what make built and names out/ as kept."""
    import shutil
    shutil.copy(os.path.join(ROOT, "Makefile"), tmp_path)
    for d in (".venv/bin", ".cache/tok", "out/ckpt/step_00000010"):
        os.makedirs(tmp_path / d)
    (tmp_path / "out/ckpt/step_00000010/model.pt").write_bytes(b"weights")
    r = subprocess.run(["make", "clean"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == ["Makefile", "out"], os.listdir(tmp_path)
    assert (tmp_path / "out/ckpt/step_00000010/model.pt").read_bytes() == b"weights"
    assert "kept out/" in r.stdout and "rm -rf out" in r.stdout, r.stdout


def test_a_mixed_runs_fp32_export_carries_the_optimizers_fp32_master(tmp_path, capsys):
    """--optim.precision=mixed computes in bf16 weights, each the fp32 master copy (in the optimizer) rounded: the
    master is the trained weight. Its fp32 export wrote the bf16 weights widened (every tensor's low 16 bits zero),
    at the run's end and from `checkpoint.py export`, both: now the master (Megatron's and DeepSpeed's fp32 weights
    of a bf16 run are the optimizer's main params: zero_to_fp32.py reads them from the optimizer state)."""
    import checkpoint
    import hf
    import torch
    import train
    from safetensors.torch import load_file
    train.main([*SMALL, "--optim.max_steps=2", f"--out_dir={tmp_path}/out", f"--ckpt.dir={tmp_path}/out/ckpt",
                "--log.tensorboard=", "--device=cpu", "--log.peak_tflops=1", "--optim.precision=mixed",
                "--optim.lr=1e-2", "--optim.warmup_steps=1", "--export_dtype=fp32", cache_arg()])
    state = torch.load(f"{tmp_path}/out/ckpt/step_00000002/optim_tp00_pp00.pt", weights_only=False)["state"]
    master = {k.removesuffix(".master"): v for k, v in state.items() if k.endswith(".master")}
    m = hf.read_config(f"{tmp_path}/out/hf")
    want = hf.to_hf_state_dict(master, m)
    checkpoint.cli(["export", "--dtype=fp32", f"{tmp_path}/out/ckpt", f"{tmp_path}/cli"])
    for folder in (f"{tmp_path}/out/hf", f"{tmp_path}/cli"):
        got = load_file(f"{folder}/model.safetensors")
        assert got.keys() == want.keys()
        for k, t in want.items():
            assert t.dtype == got[k].dtype == torch.float32 and torch.equal(got[k], t), (folder, k)
    # the master is more than its bf16 rounding: the comparison above tells them apart
    assert any(not torch.equal(t, t.bfloat16().float()) for t in want.values())
