"""The checkpoint directory's rules (ckptdir.py, issue 25): nothing a user has is lost or replaced.
Each case asserts what is still on disk afterwards, byte for byte: a damaged newest checkpoint
(resume from the older one, loudly), the only checkpoint damaged (refused, nothing touched),
--ckpt.start_fresh (moved aside, not deleted), a foreign `latest` or step folder (refused), set-aside
folders kept after the next good save, pruning only this lineage's complete checkpoints, a marker
that never comes (no crash, incomplete, passed over), and the checkpoint format (1 loads, newer is
refused by name)."""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import zlib
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402
import ckptdir  # noqa: E402
import configs  # noqa: E402
import parallel  # noqa: E402
from checkpoint import Checkpointer, CheckpointError  # noqa: E402
from conftest import as_plain_user  # noqa: E402


def cfg_for(root: Path, *args) -> configs.Config:
    return configs.from_args([f"--ckpt.dir={root}", "--ckpt.async_save=false", *args])


def save(cfg, *steps):
    ck = Checkpointer(cfg)
    for s in steps:
        ck.save(s, {"w": torch.full((4,), float(s))}, {"m": torch.full((2,), -float(s))}, data={"pos": s})
    ck.close()


def tree(root: Path) -> dict:
    """Every file under root (but run.lock): relative path -> sha1 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != "run.lock"}


def start(cfg) -> Checkpointer:
    """What train.py does before the first step: claim the directory, then resume."""
    ck = Checkpointer(cfg)
    ck.claim()
    return ck


def damage(d: Path, how: str):
    if how == "truncated model":
        f = d / "model_tp00_pp00.pt"
        f.write_bytes(f.read_bytes()[:100])
    elif how == "flipped optimizer byte":
        f = d / "optim_tp00_pp00.pt"
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        f.write_bytes(raw)
    else:                                           # a garbage done-marker
        (d / "rank00000.done").write_text("{garbage")


# ----------------------------------------------------------------------------- item 1

@pytest.mark.parametrize("how", ["truncated model", "flipped optimizer byte", "garbage marker"])
def test_damaged_newest_resumes_the_older_one_loudly_and_keeps_it(tmp_path, capsys, how):
    cfg = cfg_for(tmp_path)
    save(cfg, 4, 7)
    damage(tmp_path / "step_00000007", how)
    before = tree(tmp_path / "step_00000007")
    capsys.readouterr()
    ck = start(cfg)
    loaded = ck.load_latest()
    out, err = capsys.readouterr()
    assert loaded.step == 4 and torch.equal(loaded.model["w"], torch.full((4,), 4.0))
    # which, why, and the steps lost, on stderr too
    assert "WARNING: step_00000007 is damaged" in err and "resuming from the newest valid older checkpoint, step_00000004" in err
    assert "3 steps (5 to 7) will be trained again" in err, err
    kept = list(tmp_path.glob("step_00000007.bad*"))
    assert len(kept) == 1 and tree(kept[0]) == before           # set aside, byte for byte
    assert (tmp_path / "latest").read_text() == "step_00000004"     # not the folder set aside
    ck.save(7, {"w": torch.zeros(4)}, {"m": torch.zeros(2)})    # a new step 7 goes into a new folder
    ck.close()
    assert tree(kept[0]) == before and (tmp_path / "step_00000007" / ckptdir.MANIFEST).exists()


@pytest.mark.parametrize("how", ["truncated model", "flipped optimizer byte", "garbage marker"])
def test_only_checkpoint_damaged_is_refused_and_nothing_changes(tmp_path, how):
    cfg = cfg_for(tmp_path)
    save(cfg, 9)
    damage(tmp_path / "step_00000009", how)
    before = tree(tmp_path)
    with pytest.raises(CheckpointError) as e:
        start(cfg).load_latest()
    msg = str(e.value)
    assert "holds no valid checkpoint" in msg and "step_00000009" in msg and "Nothing was changed" in msg
    assert "--ckpt.resume=false --ckpt.start_fresh" in msg
    assert tree(tmp_path) == before and sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000009"]


def test_start_fresh_moves_the_old_folders_aside(tmp_path, capsys):
    cfg = cfg_for(tmp_path)
    save(cfg, 2, 4)
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.model").write_bytes(b"old")
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(step_00000004, step_00000002\).*start_fresh"):
        Checkpointer(cfg_for(tmp_path, "--ckpt.resume=false"))
    with pytest.raises(configs.ConfigError, match="start_fresh.*--ckpt.resume=false"):
        configs.validate(cfg_for(tmp_path, "--ckpt.start_fresh"))
    fresh = cfg_for(tmp_path, "--ckpt.resume=false", "--ckpt.start_fresh")
    configs.validate(fresh)
    ck = start(fresh)
    assert ck.load_latest() is None
    assert "moved 4 entries" in capsys.readouterr().err
    (aside,) = tmp_path.glob("previous_*")
    assert tree(aside) == before                                # everything, byte for byte
    ck.save(1, {"w": torch.ones(4)})
    ck.close()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000001"] and tree(aside) == before


def test_foreign_step_folder_and_latest_are_refused_with_their_path(tmp_path):
    cfg = cfg_for(tmp_path)
    save(cfg, 3)
    mine = tmp_path / "step_00000009"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's own files")
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=f"{mine} is named like a checkpoint but not nanotrn's"):
        start(cfg)
    assert tree(tmp_path) == before
    mine.rename(tmp_path / "elsewhere")
    (tmp_path / "latest").write_text("my own notes, not a pointer")
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'latest'} is not nanotrn's `latest` pointer"):
        start(cfg)
    assert tree(tmp_path) == before
    # a file whose first 64 bytes read as a pointer but which goes on (nanotrn's holds the name alone)
    (tmp_path / "latest").write_text("step_00000003" + " " * 60 + "and a user's notes after it")
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'latest'} is not nanotrn's `latest` pointer"):
        start(cfg)
    assert tree(tmp_path) == before
    (tmp_path / "latest").write_text("step_00000003")          # nanotrn's own: fine
    start(cfg).close()
    # a checkpoint moved to another disk and linked back: refused as a link, not said to hold no checkpoint files
    (tmp_path / "step_00000003").rename(tmp_path / "elsewhere" / "step_00000003")
    (tmp_path / "step_00000003").symlink_to(tmp_path / "elsewhere" / "step_00000003")
    with pytest.raises(CheckpointError, match=r"step_00000003 is a link \(to .*elsewhere/step_00000003\).*put the folder itself back"):
        start(cfg)


@pytest.mark.parametrize("name", ["step_00000003", "step_00000003.bad123"])
def test_a_ckpt_dir_that_is_one_checkpoint_is_refused_naming_the_directory_that_holds_it(tmp_path, name):
    """--ckpt.dir=out/ckpt/step_00000003 (meaning "resume from this one") found no step folder in
    it: the run started afresh from step 0 ("holds no checkpoint: starting fresh") and wrote its
    run.lock, latest, tokenizer/ and step folders into that checkpoint's folder. Refused now, before
    anything is written, naming the folder that holds it (checkpoint.py ls/export said so already)."""
    cfg = cfg_for(tmp_path)
    save(cfg, 3)
    if name != "step_00000003":
        (tmp_path / "step_00000003").rename(tmp_path / name)
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=f"--ckpt.dir {tmp_path / name} is one checkpoint, not a "
                                              f"checkpoint directory: give the directory that holds it, {tmp_path}"):
        start(cfg_for(tmp_path / name))
    assert tree(tmp_path) == before and not (tmp_path / name / "run.lock").exists()
    start(cfg_for(tmp_path / "new" / "step_00000001")).close()     # named so, but no checkpoint's: a run's own


def test_a_ckpt_dir_that_is_a_runs_out_dir_is_refused_naming_its_ckpt_folder(tmp_path):
    """--ckpt.dir=o (a run's --out_dir, its checkpoints in o/ckpt), meaning "resume that run": found no step
    folder in o and trained from step 0 beside o's ckpt/, hf/ and tb/. Refused before anything is written,
    naming o/ckpt, as checkpoint.py ls/export do (2698197); --ckpt.resume=false still starts a new run there."""
    save(cfg_for(tmp_path / "ckpt"), 3)
    before = tree(tmp_path)
    with pytest.raises(CheckpointError, match=f"--ckpt.dir {tmp_path} is a run's --out_dir: give its --ckpt.dir, "
                                              f"{tmp_path / 'ckpt'}, to resume it"):
        start(cfg_for(tmp_path))
    assert tree(tmp_path) == before and not (tmp_path / "run.lock").exists()
    start(cfg_for(tmp_path, "--ckpt.resume=false")).close()


def test_a_file_system_without_flock_is_named_not_taken_for_another_run(tmp_path, monkeypatch):
    """flock fails with ENOSYS / EOPNOTSUPP / ENOLCK where the file system does not carry it (FSx for
    Lustre mounted without -o flock, NFS without its lock manager): that was told as "in use by
    another run (<the last run's line, still in run.lock>)", a holder that had ended, so a user
    looked for a run that did not exist. A real holder (another open of run.lock) is still named."""
    cfg = cfg_for(tmp_path)
    save(cfg, 1)
    start(cfg).close()                  # run.lock keeps the ended run's line
    held = start(cfg)
    with pytest.raises(CheckpointError, match="is in use by another run"):
        start(cfg)
    held.close()
    before = tree(tmp_path)
    for code in (ckptdir.errno.ENOSYS, ckptdir.errno.EOPNOTSUPP, ckptdir.errno.ENOLCK):
        def no_flock(fd, op, code=code):
            raise OSError(code, ckptdir.os.strerror(code))
        monkeypatch.setattr(ckptdir.fcntl, "flock", no_flock)
        with pytest.raises(CheckpointError) as e:
            start(cfg)
        assert "in use by another run" not in str(e.value), str(e.value)
        assert f"cannot lock {tmp_path / 'run.lock'}" in str(e.value) and "-o flock" in str(e.value), str(e.value)
        assert tree(tmp_path) == before


def test_interrupted_saves_are_set_aside_and_kept_after_the_next_good_save(tmp_path, capsys):
    """An interrupted save (no manifest, or no marker from rank 0) is not a checkpoint a user had:
    the run passes over it (starting fresh if nothing else is there), keeps it aside, and the next
    good save deletes no set-aside folder."""
    cfg = cfg_for(tmp_path)
    save(cfg, 5)
    (tmp_path / "step_00000005" / ckptdir.MANIFEST).unlink()   # rank 0 died before it saw every marker
    before = tree(tmp_path / "step_00000005")
    ck = start(cfg)
    assert ck.load_latest() is None
    assert "step_00000005 was interrupted (kept as step_00000005.incomplete" in capsys.readouterr().err
    assert not (tmp_path / "latest").exists()                   # it named step_00000005, now set aside
    ck.save(2, {"w": torch.ones(4)})
    ck.save(3, {"w": torch.ones(4)})
    ck.close()
    (aside,) = tmp_path.glob("step_00000005.incomplete*")
    assert tree(aside) == before


@pytest.mark.parametrize("how", ["killed before latest", "newest deleted by hand", "latest missing"])
def test_a_resume_points_a_stale_latest_at_the_checkpoint_it_resumes(tmp_path, how):
    """`latest` names the checkpoint a run resumes from. A kill between a step's manifest and its `latest`
    left `latest` naming the step before, and a newest folder deleted by hand left it naming nothing; a
    resume (or a rerun of a finished run) kept it so until the next save, forever after the last one."""
    cfg = cfg_for(tmp_path)
    save(cfg, 1, 2)
    if how == "killed before latest":
        (tmp_path / "latest").write_text("step_00000001")
    elif how == "newest deleted by hand":
        save(cfg, 3)
        shutil.rmtree(tmp_path / "step_00000003")
    else:
        (tmp_path / "latest").unlink()
    ck = start(cfg)
    assert ck.load_latest().step == 2
    ck.close()
    assert (tmp_path / "latest").read_text() == "step_00000002"


def test_a_resume_on_the_full_disk_that_interrupted_a_save_goes_on_without_latest(tmp_path, capsys, monkeypatch):
    """A save cut short by a full disk ("disk full", exit 1), then the same command (what torchrun
    --max-restarts does by itself) on the still full disk: setting the interrupted folder aside,
    rank 0 rewrote `latest` between two barriers and died there with a traceback (OSError: No space
    left on device; seen on a full tmpfs), the other ranks waiting in the barrier. `latest` is a
    convenience (resume scans the folders): it is said, and the run resumes; its save names the disk."""
    cfg = cfg_for(tmp_path)
    save(cfg, 1, 2)
    (tmp_path / "step_00000002" / ckptdir.MANIFEST).unlink()   # the save of step 2 found the disk full
    real = ckptdir.atomic_write

    def full(path, data):
        if path.name == "latest":
            path.with_name(".latest.tmp").write_bytes(b"")     # (what open() leaves before its write fails)
            raise OSError(ckptdir.errno.ENOSPC, "No space left on device")
        real(path, data)
    monkeypatch.setattr(ckptdir, "atomic_write", full)
    ck = start(cfg)
    assert ck.load_latest().step == 1
    ck.close()
    assert "step_00000001 is complete but `latest` could not be updated (No space left on device)" in capsys.readouterr().out
    # not left naming the folder set aside (871454d's rule: it names the one resumed from, or is gone)
    assert not (tmp_path / "latest").exists() and not (tmp_path / ".latest.tmp").exists()
    (aside,) = tmp_path.glob("step_00000002.incomplete*")
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000001", aside.name]
    monkeypatch.undo()
    assert Checkpointer(cfg).load_latest().step == 1        # found without `latest`


def test_prune_deletes_only_this_lineages_complete_checkpoints(tmp_path):
    """keep=2: another run's complete checkpoint (another lineage, copied in), a format-1 one and
    this run's damaged and incomplete ones stay; of this lineage's, the newest 2 stay."""
    other = tmp_path / "other"
    save(cfg_for(other), 1)
    root = tmp_path / "run"
    root.mkdir()
    (other / "step_00000001").rename(root / "step_00000001")    # another run's, complete
    save(cfg_for(root), 2)
    to_format_1(root / "step_00000002")
    before = {n: tree(root / n) for n in ("step_00000001", "step_00000002")}
    cfg = cfg_for(root, "--ckpt.keep=2")
    ck = start(cfg)
    assert ck.load_latest().step == 2                          # format 1: a new lineage begins here
    for s in (3, 4, 5, 6):
        ck.save(s, {"w": torch.ones(4)})
    ck.close()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001", "step_00000002", "step_00000005",
                                                          "step_00000006"]
    assert {n: tree(root / n) for n in before} == before
    # Resumed, the lineage continues: its own older checkpoints are pruned, still no other.
    ck = start(cfg)
    assert ck.load_latest().step == 6
    ck.save(7, {"w": torch.ones(4)})
    ck.close()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000001", "step_00000002", "step_00000006",
                                                          "step_00000007"]


def test_an_empty_step_folder_of_a_save_killed_at_once_is_passed_over_not_refused(tmp_path, capsys):
    """A save killed right after it made its step folder leaves it empty: the restart resumes the older
    checkpoint and sets the empty one aside (interrupted), where a foreign folder would be refused."""
    cfg = cfg_for(tmp_path)
    save(cfg, 2)
    (tmp_path / "step_00000004").mkdir()
    ck = start(cfg)
    assert ck.load_latest().step == 2
    ck.close()
    assert [d.name for _, d in ckptdir.scan(tmp_path)] == ["step_00000002"]
    assert "skipping step_00000004: no completion marker from rank 0" in capsys.readouterr().out


def test_a_step_saved_again_leaves_its_complete_checkpoint_untouched(tmp_path, capsys):
    """A second save of the step just saved (the run's end, or a signal's save, right after an interval save)
    is said and skipped: a complete checkpoint is never rewritten in place, file by file under its manifest."""
    ck = Checkpointer(cfg_for(tmp_path))
    ck.save(2, {"w": torch.ones(4)})
    before = tree(tmp_path)
    ck.save(2, {"w": torch.zeros(4)})
    ck.close()
    assert tree(tmp_path) == before
    assert "step 2 is already saved (newest is step 2); not saving it again" in capsys.readouterr().out


def test_keep_0_keeps_every_checkpoint(tmp_path):
    """--ckpt.keep=0 means keep them all (configs.CheckpointConfig): no save prunes anything."""
    root = tmp_path / "run"
    ck = Checkpointer(cfg_for(root, "--ckpt.keep=0"))
    for s in (1, 2, 3):
        ck.save(s, {"w": torch.ones(4)})
    ck.close()
    assert [d.name for _, d in ckptdir.scan(root)] == ["step_00000003", "step_00000002", "step_00000001"]


def test_prune_keeps_a_checkpoint_holding_a_users_file(tmp_path, capsys):
    """A file nanotrn did not write, put inside one of this lineage's step folders (a user's notes):
    pruning passes that folder over, saying so, and deletes the others beyond --ckpt.keep."""
    root = tmp_path / "run"
    ck = Checkpointer(cfg_for(root, "--ckpt.keep=1"))
    ck.save(1, {"w": torch.ones(4)})
    ck.save(2, {"w": torch.ones(4)})
    (root / "step_00000002" / "NOTES.txt").write_text("eval at step 2: keep")
    before = tree(root / "step_00000002")
    ck.save(3, {"w": torch.ones(4)})
    ck.save(4, {"w": torch.ones(4)})
    ck.close()
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000002", "step_00000004"]
    assert tree(root / "step_00000002") == before
    assert "not pruning step_00000002: it holds files nanotrn did not write (NOTES.txt)" in capsys.readouterr().out


def test_a_prune_cut_short_leaves_no_step_folder_and_the_next_prune_finishes_it(tmp_path, monkeypatch):
    """A kill halfway through deleting a pruned checkpoint (here rmtree stops after one file) left
    step_N without its manifest and with some of its files: `ls` said BAD, and its space was never freed,
    since prune deletes only folders with this lineage's manifest. Now the folder becomes step_N.pruning
    before the delete, which no resume or `ls` takes for a checkpoint, and the next prune finishes it."""
    import shutil
    root = tmp_path / "run"
    ck = Checkpointer(cfg_for(root, "--ckpt.keep=1"))
    ck.save(1, {"w": torch.ones(4)}, {"m": torch.ones(2)})
    real = shutil.rmtree

    def cut_short(path, *a, **k):
        if "step_00000001" not in str(path):
            return real(path, *a, **k)
        next(Path(path).glob("*.pt")).unlink()
        raise SystemExit("killed mid-delete")
    monkeypatch.setattr(shutil, "rmtree", cut_short)
    with pytest.raises(SystemExit):
        ck.save(2, {"w": torch.ones(4)}, {"m": torch.ones(2)})     # complete, then prunes step 1
    monkeypatch.undo()
    assert [d.name for _, d in ckptdir.scan(root)] == ["step_00000002"]
    ck = start(cfg_for(root, "--ckpt.keep=1"))
    assert ck.load_latest().step == 2
    (root / "step_final_eval.pruning").mkdir()          # a user's folder, named alike: not prune's to finish
    (root / "step_final_eval.pruning" / "notes.txt").write_text("keep")
    ck.save(3, {"w": torch.ones(4)}, {"m": torch.ones(2)})
    ck.close()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000003",
                                                                                   "step_final_eval.pruning"]
    assert (root / "step_final_eval.pruning" / "notes.txt").read_text() == "keep"


# ----------------------------------------------------------------------------- item 3

def test_a_rank_that_never_writes_its_marker_leaves_the_step_incomplete_and_training_goes_on(tmp_path, capsys):
    """World 2, rank 1 never writes (a dead or hung rank, or a very slow disk): rank 0's writer
    waits marker_timeout_s, names rank 1, writes no manifest and no `latest`, raises nothing; the
    run saves the next step; resume passes over the incomplete one; every file stays on disk."""
    cfg = cfg_for(tmp_path)
    cfg.ckpt.async_save = True
    g0 = parallel.Grid(world=2, rank=0, dp=2, dp_rank=0)
    g1 = parallel.Grid(world=2, rank=1, dp=2, dp_rank=1)
    state = lambda s: ({"w": torch.full((4,), float(s))}, {"m": torch.zeros(2)})   # noqa: E731
    ck1 = Checkpointer(cfg, g1)
    ck1.save(1, *state(1))
    ck1.close()
    ck0 = Checkpointer(cfg, g0, marker_timeout_s=0.5)
    ck0.save(1, *state(1))
    ck0.wait()                                                 # step 1 complete: both markers
    ck0.save(2, *state(2))                                     # rank 1 never saves step 2
    ck0.wait()                                                 # no exception: training goes on
    ck0.check()
    out = capsys.readouterr()
    assert "step_00000002: no completion marker from rank(s) [1] (1 of 2) within 0 s" in out.err
    d2 = tmp_path / "step_00000002"
    assert not (d2 / ckptdir.MANIFEST).exists() and (tmp_path / "latest").read_text() == "step_00000001"
    assert ckptdir.check(d2)[0] == ckptdir.INTERRUPTED
    files2 = tree(d2)
    assert "rank00000.done" in files2 and "model_tp00_pp00.pt" in files2
    ck0.close()
    # Resume (rank 0's view, no process group: it checks every marker) passes over step 2.
    loaded = Checkpointer(cfg, parallel.Grid(world=2, rank=0, dp=2)).load_latest()
    assert loaded.step == 1
    (aside,) = tmp_path.glob("step_00000002.incomplete*")
    assert tree(aside) == files2


def test_marker_wait_polls_only_the_missing_ones_with_backoff(tmp_path, monkeypatch):
    d = tmp_path / "step_00000001"
    d.mkdir(parents=True)
    for r in range(0, 64):
        if r != 17:
            (d / ckptdir.marker_name(r)).write_text("{}")
    looked, exists = [], Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: looked.append(p.name) or exists(p))
    clock, sleeps = [0.0], []                  # a clock that moves only when the wait sleeps
    monkeypatch.setattr(ckptdir.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(ckptdir.time, "sleep", lambda s: (sleeps.append(s), clock.__setitem__(0, clock[0] + s)))
    missing = ckptdir.CkptDir(tmp_path).wait_for_markers(1, 64, timeout_s=60)
    assert missing == [17]
    assert looked[:64] == [ckptdir.marker_name(r) for r in range(64)]            # every marker once
    assert set(looked[64:]) == {ckptdir.marker_name(17)}                         # then only the missing one
    # 20 ms growing by 1.5x to 2 s: about 40 looks in a minute, not 3000
    assert sleeps[:3] == pytest.approx([0.02, 0.03, 0.045]) and max(sleeps) == 2.0 and len(sleeps) < 45


def test_prune_reads_one_manifest_per_checkpoint_and_no_marker(tmp_path, monkeypatch):
    cfg = cfg_for(tmp_path, "--ckpt.keep=1")
    ck = Checkpointer(cfg)
    ck.save(1, {"w": torch.ones(4)})
    read = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: read.append(p.name) or real(p, *a, **k))
    ck.dir.prune(1)
    ck.save(2, {"w": torch.ones(4)})       # writes, waits for the markers, prunes step 1
    ck.close()
    assert read and set(read) == {ckptdir.MANIFEST}
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002"]


# ----------------------------------------------------------------------------- item 6: the format

def to_format_1(d: Path, drop=()):
    """Rewrite a checkpoint as nanotrn wrote it before issue 25 (checkpoint format 1): no manifest,
    no "format" in meta.json or the markers (the markers' record of meta.json follows). drop: the
    model config keys that nanotrn did not have yet."""
    (d / ckptdir.MANIFEST).unlink()
    meta = json.loads((d / "meta.json").read_text())
    del meta["format"]
    for key in drop:
        del meta["config"]["model"][key]
    raw = json.dumps(meta, indent=1).encode()
    (d / "meta.json").write_bytes(raw)
    for p in d.glob("rank*.done"):
        m = json.loads(p.read_text())
        del m["format"]
        if "meta.json" in m["files"]:
            m["files"]["meta.json"] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}
        p.write_text(json.dumps(m, indent=1))


def test_format_1_checkpoint_loads_and_a_newer_one_is_refused_by_name(tmp_path, capsys):
    cfg = cfg_for(tmp_path)
    save(cfg, 3)
    d = tmp_path / "step_00000003"
    to_format_1(d)
    assert ckptdir.check(d)[0] == ckptdir.OK
    loaded = start(cfg).load_latest()
    assert loaded.step == 3 and torch.equal(loaded.model["w"], torch.full((4,), 3.0)) and loaded.data == {"pos": 3}
    assert "has checkpoint format 1 (no manifest): it is loaded as it is" in capsys.readouterr().out
    # A format-1 save interrupted (rank 0's marker missing) is passed over as before.
    save(cfg_for(tmp_path / "b"), 1, 2)
    for s in (1, 2):
        to_format_1(tmp_path / "b" / f"step_0000000{s}")
    (tmp_path / "b" / "step_00000002" / "rank00000.done").unlink()
    assert Checkpointer(cfg_for(tmp_path / "b")).load_latest().step == 1

    save(cfg_for(tmp_path / "c"), 4)
    for p in (tmp_path / "c" / "step_00000004").glob("rank*.done"):
        p.write_text(p.read_text().replace('"format": 2', '"format": 3'))
    before = tree(tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"step_00000004 was written by a newer nanotrn \(checkpoint format 3"):
        Checkpointer(cfg_for(tmp_path / "c")).load_latest()
    assert tree(tmp_path / "c") == before
    checkpoint.cli(["ls", str(tmp_path / "c")])
    assert "step_00000004  BAD: " in capsys.readouterr().out


def test_a_checkpoint_of_an_older_nanotrn_without_later_model_keys_resumes(tmp_path, capsys):
    """nanotrn before hf.py (de5143a, 2026-11-22) wrote no tie_embeddings, head_dim_override or
    rope_* keys: they came later, with defaults that are what it did. Its checkpoint was refused as
    "another model" ("model.tie_embeddings: checkpoint '<absent>', now False", and six more), a fix
    no flag can follow (measured: 2 steps trained at de5143a, resumed on main). A later key that
    this run sets otherwise is still another model, named with the value the checkpoint had."""
    later = ("tie_embeddings", "head_dim_override", "rope_scaling", "rope_factor", "rope_low_freq_factor",
             "rope_high_freq_factor", "rope_original_max_len")
    save(cfg_for(tmp_path), 3)
    to_format_1(tmp_path / "step_00000003", drop=later)
    loaded = start(cfg_for(tmp_path)).load_latest()
    assert loaded.step == 3 and torch.equal(loaded.model["w"], torch.full((4,), 3.0))
    with pytest.raises(CheckpointError, match="model.rope_scaling: checkpoint 'none', now 'llama3'"):
        Checkpointer(cfg_for(tmp_path, "--model.rope_scaling=llama3")).load_latest()


def test_a_resume_may_raise_max_seq_len_to_train_longer_sequences(tmp_path, capsys):
    """--model.max_seq_len only bounds positions (RoPE is computed from them; no weight depends on it),
    so a run continued at a longer --seq_len may raise it. It was refused as "another model" whose
    advice (the checkpoint's --model.* settings) met --seq_len's own refusal ("raise max_seq_len"): a loop.
    A key that shapes a weight is still another model."""
    save(cfg_for(tmp_path), 3)
    loaded = start(cfg_for(tmp_path, "--model.max_seq_len=512", "--seq_len=512")).load_latest()
    assert loaded.step == 3 and torch.equal(loaded.model["w"], torch.full((4,), 3.0))
    # said with the other differences (it was taken silently: only non-model keys were reported)
    assert "settings that differ from the checkpoint's: model.max_seq_len: checkpoint 256, now 512" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="model.ffn_dim: checkpoint 704, now 768"):
        Checkpointer(cfg_for(tmp_path, "--model.ffn_dim=768")).load_latest()


@pytest.mark.slow       # one process (~4 s: torch's import)
def test_a_ckpt_dir_this_user_cannot_list_is_one_line_before_any_work(tmp_path):
    """A --ckpt.dir of mode 0300 (writable, not listable: another user's drop box) as a non-root user was a
    PermissionError traceback: in train.py (check_tokenizer, or hf.check_export_dir with --data.tokenizer given)
    and in checkpoint.py ls/export. Root lists it anyway, so this runs with root's bypass dropped."""
    import subprocess
    ck = tmp_path / "ck"
    ck.mkdir(mode=0o300)
    ck.chmod(0o300)
    (tmp_path / "x.model").write_text("a tokenizer given: hf.check_export_dir listed --ckpt.dir first")
    run = ["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64",
           f"--ckpt.dir={ck}", f"--out_dir={tmp_path}/out", f"--data.cache_dir={tmp_path}/cache", "--log.tensorboard="]
    # and inside a readable one: the kept tokenizer unreadable (a traceback after the corpus index), a step folder
    # unlistable (it said "not nanotrn's (no checkpoint files inside)"), `latest` unreadable (it said "not nanotrn's
    # `latest` pointer (it should hold a name like step_00000200)": move it out)
    for name, what in (("ck_tok", "step_00000001"), ("ck_step", "step_00000002"), ("ck_latest", "step_00000003")):
        (tmp_path / name / what).mkdir(parents=True)
        (tmp_path / name / "tokenizer").mkdir()
        (tmp_path / name / "tokenizer" / "tokenizer.model").write_text("kept")
    (tmp_path / "ck_tok" / "tokenizer" / "tokenizer.model").chmod(0o200)
    (tmp_path / "ck_step" / "step_00000002").chmod(0o300)
    (tmp_path / "ck_latest" / "latest").write_text("step_00000003")
    (tmp_path / "ck_latest" / "latest").chmod(0o200)
    calls = [("checkpoint.main", ["ls", str(ck)]), ("checkpoint.main", ["export", str(ck), str(tmp_path / "hf")]),
             ("train.cli", run), ("train.cli", [*run, f"--data.tokenizer={tmp_path}/x.model"]),
             *[("train.cli", [*run, f"--ckpt.dir={tmp_path}/{name}"]) for name in ("ck_tok", "ck_step", "ck_latest")]]
    script = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\nimport checkpoint, train\nfor entry, argv in {calls!r}:\n"
              f"    try:\n        eval(entry)(argv)\n    except SystemExit as e:\n        print('exit', e.code, file=sys.stderr)\n")
    r = subprocess.run([*as_plain_user(), sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("exit ")]
    assert len(said) == 7 and all(f"{ck} cannot be listed by this user" in line for line in said[:4]), r.stderr
    assert all("make it readable" in line for line in said[:4]), r.stderr
    assert f"{tmp_path}/ck_tok/tokenizer/tokenizer.model, the tokenizer this run resumes with, is not readable" in said[4]
    assert f"{tmp_path}/ck_step/step_00000002 cannot be listed by this user, so it cannot be checked" in said[5], said
    assert f"{tmp_path}/ck_latest/latest cannot be read by this user, so it cannot be checked" in said[6], said
    assert "fix its permissions" in said[6] and "not nanotrn's" not in said[6], said
    assert not any((tmp_path / d).exists() for d in ("out", "cache", "hf")), "work started"


def test_atomic_write_syncs_the_data_before_the_rename_and_the_folder_after_it(tmp_path, monkeypatch):
    """`latest` and each manifest hold their old bytes or their new ones after a power loss, never a part: the
    temporary's data reaches the disk (fsync) before the rename makes it the file, and the folder is synced after
    the rename (which is what makes the rename itself durable). The real calls, in the order they were made."""
    calls, fsync, replace = [], ckptdir.os.fsync, ckptdir.os.replace

    def spy_fsync(fd):
        calls.append(("fsync", ckptdir.os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def spy_replace(a, b):
        calls.append(("replace", str(b)))
        return replace(a, b)
    monkeypatch.setattr(ckptdir.os, "fsync", spy_fsync)
    monkeypatch.setattr(ckptdir.os, "replace", spy_replace)
    ckptdir.atomic_write(tmp_path / "latest", b"step_00000002")
    assert calls == [("fsync", str(tmp_path / ".latest.tmp")), ("replace", str(tmp_path / "latest")),
                     ("fsync", str(tmp_path))]
    assert (tmp_path / "latest").read_bytes() == b"step_00000002" and not (tmp_path / ".latest.tmp").exists()


def test_verifying_many_small_files_allocates_what_they_hold_not_16_mb_each(tmp_path):
    """`checkpoint.py ls` and export verify every file of a checkpoint: 4096 rank files at 4096 ranks (~17 KB each).
    crc_of read each through a fresh 16 MB buffer, zeroed per file: 2.7 ms a file, 11 s a checkpoint of 4096 rank
    files before a byte was checked (scale-scripts/fake_ckpt.py). The buffer is now the file's size, at most 16 MB."""
    import tracemalloc
    files = {}
    for r in range(8):
        body = f"rank {r} state".encode() * 100
        (tmp_path / f"rank{r:05d}.pt").write_bytes(body)
        files[f"rank{r:05d}.pt"] = {"bytes": len(body), "crc32": zlib.crc32(body)}
    tracemalloc.start()
    try:
        assert ckptdir.verify(tmp_path, files) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    (tmp_path / "rank00003.pt").write_bytes(b"x" * 1400)                  # a damaged one is still found
    assert ckptdir.verify(tmp_path, files).startswith("rank00003.pt: crc32 ")


def test_the_marker_wait_gives_up_at_its_first_look_once_told_to(tmp_path, monkeypatch):
    """Rank 0's writer stops waiting for the missing markers at its first look once give_up() is true (the peers are
    lost: checkpoint.py's peers_lost), not after the whole --ckpt marker timeout."""
    d = ckptdir.CkptDir(tmp_path)
    ckptdir.step_dir(tmp_path, 3).mkdir()
    (ckptdir.step_dir(tmp_path, 3) / ckptdir.marker_name(0)).write_text("{}")

    def sleep(s):
        raise AssertionError(f"waited {s} s after give_up() was true")
    monkeypatch.setattr(ckptdir.time, "sleep", sleep)
    assert d.wait_for_markers(3, 2, timeout_s=600, give_up=lambda: True) == [1]


def test_start_fresh_in_a_directory_without_checkpoints_moves_nothing(tmp_path, capsys):
    """--ckpt.start_fresh with no step folder there (a first run, or one that never saved): nothing to move aside,
    so no previous_* folder and no line saying so; a tokenizer/ left by a run that saved nothing stays in place."""
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.model").write_bytes(b"kept")
    before = tree(tmp_path)
    start(cfg_for(tmp_path, "--ckpt.resume=false", "--ckpt.start_fresh")).close()
    assert tree(tmp_path) == before and not list(tmp_path.glob("previous_*"))
    assert "start_fresh" not in capsys.readouterr().err


def test_a_file_grown_past_its_marker_or_a_manifest_of_another_world_is_damage_named_so(tmp_path):
    """ckptdir.check compares each file's size with its marker's both ways (a file with bytes appended, a copy or a
    write gone wrong, is named by its size before any crc32 is read), and the manifest's world with the markers' (a
    manifest of a save at another world beside these markers: two saves mixed in one folder)."""
    save(cfg_for(tmp_path), 3)
    d = tmp_path / "step_00000003"
    f, body = d / "model_tp00_pp00.pt", (d / "model_tp00_pp00.pt").read_bytes()
    f.write_bytes(body + b"\0")
    assert ckptdir.check(d)[:2] == (ckptdir.DAMAGED, f"model_tp00_pp00.pt is {len(body) + 1} bytes, its marker says "
                                                     f"{len(body)} (truncated or damaged)")
    f.write_bytes(body)
    assert ckptdir.check(d)[0] == ckptdir.OK
    man = json.loads((d / ckptdir.MANIFEST).read_text())
    (d / ckptdir.MANIFEST).write_text(json.dumps({**man, "world": 2}))
    assert ckptdir.check(d)[:2] == (ckptdir.DAMAGED, "its manifest belongs to another save")
