"""Checkpoints: asynchronous, atomic, verified, resumable after a crash at any moment and at another
parallel layout (HLAT's automatic recovery raised the cluster's use from 77.83% to 98.81%).

A folder per step of NxD's per-rank files (docs/checkpoints.md): each rank writes its part with no
collective, a file DP replicas share comes from one of them (writer_dp_rank), and at the same
layout each rank reads back only its own. Not torch.distributed.checkpoint: it reshards only
DTensors. ckptsave.py writes (atomic, in the background), ckptdir.py judges, claims and prunes the
folders, reshard.py reads at any layout; a crash leaves at worst an interrupted save, passed over.
A signal stops the run at a step boundary with a checkpoint inside the launcher's grace period
(StopSignal, stop_budget: the last section).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

if __name__ == "__main__":      # Ctrl-C while the imports below load (seconds): end quietly, not
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # with a traceback from inside torch; main() restores it

import numpy as np
import torch
import torch.distributed as dist

from configs import Config, ConfigError, ModelConfig, check_dir, path_kind
import hf
import parallel
from parallel import Grid
import pipeline
import ckptdir
import reshard
from ckptdir import CheckpointError  # noqa: F401  (callers use checkpoint.CheckpointError)
from ckptsave import SaveFailed, Writer, to_host  # noqa: F401  (for train.py)
from faults import Faults
from reshard import Loaded, writer_dp_rank  # noqa: F401  (tests ask checkpoint.writer_dp_rank)

MODEL_FIELDS_FREE = {"checkpointing", "attention", "max_seq_len"}    # may change on resume: they do not touch weights
# A new run beside an old one needs its own checkpoints and its own export, which a fresh run will not write over:
# --out_dir moves both, where --ckpt.dir alone led into the export folder's refusal.
NEW_RUN = "--out_dir (its ckpt/, hf/ and tb/ follow it unless given)"


# ----------------------------------------------------------------------------- RNG streams

def rng_state(device: torch.device | str | None = None) -> dict:
    """Every random stream this rank draws from: Python, numpy, torch CPU, and the device's own
    (CUDA, or XLA's seed). The stochastic-rounding stream is in the optimizer's state_dict."""
    s = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        s["cuda"] = torch.cuda.get_rng_state(dev)
    elif dev.type == "xla":
        import torch_xla.core.xla_model as xm
        s["xla"] = xm.get_rng_state(dev)
    return s


def seed_all(seed: int) -> None:
    """Seed every stream rng_state() captures (Python and numpy seed themselves at random otherwise)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_rng_state(s: dict, device: torch.device | str | None = None) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s:
        torch.cuda.set_rng_state(s["cuda"], device)
    if "xla" in s:
        import torch_xla.core.xla_model as xm
        xm.set_rng_state(s["xla"], device)


# ----------------------------------------------------------------------------- who writes what

def rank_files(step: int, g: Grid, layout: dict, cfg: Config, model, optim, data, extra, device) -> dict:
    """This rank's files of the checkpoint of `step`: name -> bytes or a torch-saveable object."""
    tag = reshard.tag(g.tp_rank, g.pp_rank)
    files = {}
    if g.rank == 0:
        meta = {"format": ckptdir.FORMAT, "step": step, "time": time.time(), "layout": layout, "config": cfg.to_dict(),
                "extra": extra or {}, "torch": torch.__version__}
        try:
            files["meta.json"] = json.dumps(meta, indent=1).encode()
        except TypeError as e:
            raise CheckpointError(f"save(extra=...) must be JSON-able (ints, floats, strings, lists, "
                                  f"dicts): {e}") from None
    zero1 = layout["zero1"]
    if model is not None and g.dp_rank == writer_dp_rank(0, g, zero1):
        files[f"model_{tag}.pt"] = model
    if optim is not None and (zero1 or g.dp_rank == writer_dp_rank(1, g, zero1)):
        files[reshard.optim_name(g.dp_rank, tag, zero1)] = optim
    files[f"rank{g.rank:05d}.pt"] = {"rank": g.rank, "dp_rank": g.dp_rank, "tp_rank": g.tp_rank,
                                     "pp_rank": g.pp_rank, "rng": rng_state(device), "data": data}
    return files


# ----------------------------------------------------------------------------- finding the newest valid checkpoint

def _diff(saved: dict, now: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k, "<absent>"), now.get(k, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: checkpoint {a!r}, now {b!r}")
    return out


def check_config(meta: dict, d: Path, cfg: Config, say=print):
    """Refuse a checkpoint of another model or optimizer precision; report other differences."""
    # A key the checkpoint lacks came into ModelConfig after it was written, with a default that is
    # what nanotrn did before it (tie_embeddings, rope_scaling ... came with hf.py): not another model.
    saved, now = {**dataclasses.asdict(ModelConfig()), **meta["config"]["model"]}, cfg.to_dict()["model"]
    model_diffs = _diff(saved, now, "model.")
    diffs = [x for x in model_diffs if x.split(":")[0][6:] not in MODEL_FIELDS_FREE]
    if diffs:
        raise CheckpointError(f"{d} holds another model than this run's:\n  " + "\n  ".join(diffs) +
                              "\nresume with the checkpoint's --model.* settings, or start a new run "
                              f"in another {NEW_RUN}")
    saved_precision = meta["config"].get("optim", {}).get("precision", cfg.optim.precision)
    if saved_precision != cfg.optim.precision:
        raise CheckpointError(f"{d} was trained with --optim.precision={saved_precision} and this run asks "
                              f"for {cfg.optim.precision}: its optimizer state is kept in the other "
                              f"precision; resume with --optim.precision={saved_precision}, or start a new "
                              f"run in another {NEW_RUN}")
    now = cfg.to_dict()
    if not now["data"]["tokenizer"]:     # none given: the run's own, kept in ckpt/tokenizer (train.py), the same
        now["data"]["tokenizer"] = meta["config"].get("data", {}).get("tokenizer", "")
    other = [x for x in model_diffs if x not in diffs]      # the free ones (max_seq_len ...): taken, and said
    other += [x for x in _diff(meta["config"], now) if not x.startswith(("model.", "ckpt.", "out_dir", "device", "log."))]
    if other:
        say("resuming with settings that differ from the checkpoint's: " + "; ".join(other))


def kept_tokenizer(root: Path, folder: str) -> str:
    """folder, the tokenizer a resume takes (train.py keeps it there at a run's start); refused where
    there is none (an older nanotrn's run, or step folders copied without it): one trained now, by a
    newer recipe or on another corpus, would give the model's token ids other meanings, silently."""
    if not any(os.path.isfile(os.path.join(folder, n)) for n in ("tokenizer.model", "tokenizer.json")):
        raise CheckpointError(f"{root} holds checkpoints but not the tokenizer their model was trained with "
                              f"(none in {folder}: a run of an older nanotrn, or step folders copied without "
                              f"it); one trained now may give token ids other meanings. Give it with "
                              f"--data.tokenizer=FILE (an older nanotrn trained it into its --data.cache_dir, "
                              f"as tokenizer-<vocab>-<hash>.model)")
    names = (os.path.join(folder, n) for n in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"))
    if shut := [p for p in names if os.path.isfile(p) and not os.access(p, os.R_OK)]:    # else a traceback, later
        raise CheckpointError(f"{shut[0]}, the tokenizer this run resumes with, is not readable by this user: fix its "
                              f"permissions")
    return folder


def other_tokenizer(root: Path, kept: str, given: str, resuming: bool) -> str:
    """What train.py says where the checkpoint directory's tokenizer/ holds another tokenizer than the run's."""
    if resuming:
        return (f"the run in {root} was trained with the tokenizer {kept}, and --data.tokenizer={given} "
                f"differs: leave --data.tokenizer out (a resume takes the run's own) or give {kept}")
    return (f"{kept} is not this run's tokenizer, and a run keeps its own in {Path(kept).parent} (it would be "
            f"replaced): move that folder out of the checkpoint directory, or give another --ckpt.dir")


def keep_tokenizer(tok, folder: str, model_dir: str = "") -> None:
    """Copy the run's tokenizer files into folder (the checkpoint directory's tokenizer/, which a resume and
    `checkpoint.py export` read), with the model folder's generation_config.json (hf.save_hf keeps it): model_dir's
    (--init_from: chosen with its weights, wherever the tokenizer came from), else the one beside the tokenizer."""
    os.makedirs(folder, exist_ok=True)
    name = "tokenizer.json" if isinstance(tok, hf.HFTokenizer) else "tokenizer.model"
    gen = os.path.join(model_dir or os.path.dirname(tok.path), hf.GENERATION)
    for src, dst in ((tok.path, name), (gen, hf.GENERATION)):
        dst = os.path.join(folder, dst)
        if os.path.isfile(src) and not (os.path.exists(dst) and os.path.samefile(src, dst)):   # may be this copy
            shutil.copyfile(src, dst + ".tmp")      # then renamed: the other ranks (train.tokenizer_for_run) and a
            os.replace(dst + ".tmp", dst)           # run after a kill see the whole file or none, never a part
    if not os.path.isfile(gen) and os.path.isfile(kept := os.path.join(folder, hf.GENERATION)):
        os.remove(kept)         # this model has none: an earlier model's copy, kept here, would ship in the export
    if isinstance(tok, hf.HFTokenizer):
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(tok.config, f)


def reload_from_host(model: torch.nn.Module, optimizer, device) -> None:
    """The pre-compile pass's stand-in for a resume's load (train.py; no checkpoint is read): the weights
    and the optimizer state put back from host copies, as a resume's are. With the state alone, the
    next update was a graph no real run has (the slots' views re-made on weights that updates wrote
    through): one more neuronx-cc compile of the update graph in the pass (tests/test_xla.py)."""
    params = list(model.parameters())
    for p, t in zip(params, parallel.to_device(to_host([p.detach() for p in params]), device)):
        p.data = t
    optimizer.load_state_dict(to_host(optimizer.state_dict()))


def agree(grid: Grid, value: int, op=dist.ReduceOp.MIN) -> int:
    """The smallest value any rank holds (op MIN), so that all ranks fall back, or refuse, together."""
    if grid.world == 1 or not dist.is_initialized():
        return int(value)
    # Host-side agreement: over the gloo host group on XLA (no device graph to compile for it).
    t = torch.tensor([int(value)], device=grid.host_device)
    dist.all_reduce(t, op=op, group=grid.host_group)
    return int(t.item())


def find_newest_valid(root: Path, grid: Grid, say=print, log=print) -> tuple[Path | None, list]:
    """(the newest complete, valid step folder or None, [(newer folder, verdict, problem)] skipped).
    On every rank: each checks a 1/world share of the markers and files, then all agree on the
    worst verdict, so that they fall back together. A newer format is refused by name."""
    share = (grid.rank, grid.world) if grid.world > 1 and dist.is_initialized() else (0, 1)
    skipped = []
    for _, d in ckptdir.scan(root):
        verdict, problem, files = ckptdir.check(d, share)
        if verdict == ckptdir.OK and (problem := ckptdir.verify(d, files)) is not None:
            verdict = ckptdir.DAMAGED
        if problem is not None and grid.world > 1:
            log(f"ckpt: [rank {grid.rank}] {d.name}: {problem}")
        verdict = agree(grid, verdict)
        if verdict == ckptdir.OK:
            return d, skipped
        problem = problem or "a marker or file checked by another rank is damaged or missing (see its message)"
        if verdict == ckptdir.NEWER:
            raise CheckpointError(ckptdir.newer_format(d, "newer") if "newer nanotrn" not in problem else problem)
        say(f"skipping {d.name}: {problem}")
        skipped.append((d, verdict, problem))
    return None, skipped


# ----------------------------------------------------------------------------- the checkpointer

class Checkpointer:
    """This rank's part of every checkpoint, on every rank: claim(), load_latest(), save(), close().
    compile_only: the pre-compile pass (NEURON_EXTRACT_GRAPHS_ONLY: every value is invalid) reads
    and writes nothing; a save only stages into host memory, which traces the same transfers and
    graph cuts as a real one (aws-neuron-sdk #813)."""

    def __init__(self, cfg: Config, grid: Grid | None = None, device: torch.device | str | None = None,
                 log=print, marker_timeout_s: float = 600.0, compile_only: bool = False):
        self.cfg, self.c, self.grid = cfg, cfg.ckpt, grid or Grid()
        self.root, self.device, self.marker_timeout_s = Path(cfg.ckpt.dir), device, marker_timeout_s
        self._log = log
        g = self.grid
        # ZeRO-1 shards exist only when there is more than one DP rank (optim.build_optimizer).
        self.layout = {"world": g.world, "tp": g.tp, "pp": g.pp, "dp": g.dp,
                       "zero1": bool(cfg.parallel.zero1 and g.dp > 1)}
        if g.pp > 1:     # which layers each stage holds: the same PP degree at other --parallel.pp_cuts reshards too
            self.layout["stages"] = [list(b) for b in pipeline.stage_bounds(cfg)]
        self.faults = Faults(os.environ.get("NANOTRN_FAULT", ""), g.rank, self.root, g.host_group)
        self.dir = ckptdir.CkptDir(self.root, say=self.say, warn=self.warn)
        self.writer = Writer(self.root, g.rank, g.world, self.faults, self.c.async_save, device,
                             finish=self._finish if g.rank == 0 else None, keep=self.c.keep)
        # wait(): the save in flight on disk; check(): raise at once if it failed; before_update():
        # the deferred copy of the weights and moments done (train.py's guard, before the update)
        self.wait, self.check, self.before_update = self.writer.wait, self.writer.check, self.writer.before_update
        self._newest = -1                                # newest step saved or resumed from
        # Set by train.py when a collective failed (a peer is gone): rank 0 then waits for no marker
        # that has not come, since the dead rank's never will (peers_lost says why).
        self.peers_lost = False
        self.compile_only = compile_only
        if compile_only:
            return
        if not self.c.resume and not self.c.start_fresh and (found := ckptdir.scan(self.root)):
            raise CheckpointError(
                f"--ckpt.resume=false but {self.root} already holds checkpoints "
                f"({', '.join(d.name for _, d in found[:4])}"
                f"{' ...' if len(found) > 4 else ''}), which this run would overwrite; resume (--ckpt.resume=true), "
                f"or add --ckpt.start_fresh to move them aside into {self.root}/previous_<time>/ and start over, "
                f"or start the new run in another {NEW_RUN}")

    def say(self, msg: str):
        if self.grid.rank == 0:
            self._log(f"ckpt: {msg}")

    def warn(self, msg: str):
        """What a user must not miss (a checkpoint passed over, steps lost): on stdout and stderr."""
        if self.grid.rank == 0:
            self._log(f"ckpt: WARNING: {msg}")
            print(f"ckpt: WARNING: {msg}", file=sys.stderr, flush=True)

    def has_checkpoints(self) -> bool:
        return bool(ckptdir.scan(self.root))

    @property
    def stats(self) -> dict:
        """The last save's: step, blocked_s, bytes, write_s, deferred_copy_s, starved_s."""
        return self.writer.stats

    @property
    def in_flight(self) -> bool:
        return self.writer.in_flight

    # --------------------------------------------------------------- save
    def save(self, step: int, model: dict | None, optim: dict | None = None, data=None,
             extra: dict | None = None, defer_copy: bool = False):
        """This rank's state after `step` optimizer steps: its model and optimizer state dicts, its
        data-loader state, its RNG streams; extra: JSON-able run state in meta.json (tokens seen).
        With async_save, returns once all is in host memory. defer_copy (CPU host): the weights and
        moments are copied during the next forward and backward; before_update() waits for the copy."""
        t0 = time.perf_counter()
        self.wait()
        if step <= self._newest:
            self.say(f"step {step} is already saved (newest is step {self._newest}); not saving it again")
            return
        files = rank_files(step, self.grid, self.layout, self.cfg, model, optim, data, extra, self.device)
        self.writer.stats = {"step": step}
        self._newest = step
        defer = tuple(n for n, o in files.items() if defer_copy and o is not None and (o is model or o is optim))
        self.writer.write(step, files, t0, to_disk=not self.compile_only, defer=defer)

    def _finish(self, step: int):
        """Rank 0's writer thread: once every marker is there, the manifest, `latest`, pruning. A
        marker that does not come in time leaves the step incomplete; training goes on."""
        missing = self.dir.wait_for_markers(step, self.grid.world, self.marker_timeout_s, lambda: self.peers_lost)
        if missing:
            late = ("by the time a collective failed (a rank is gone)" if self.peers_lost else
                    f"within {self.marker_timeout_s:.0f} s, and training goes on")
            self.warn(f"{ckptdir.step_dir(self.root, step).name}: no completion marker from rank(s) {missing[:16]}"
                      f"{' ...' if len(missing) > 16 else ''} ({len(missing)} of {self.grid.world}) {late}; it stays "
                      f"incomplete (no manifest: resume passes over it, pruning never deletes it)")
            return
        self.dir.complete(step, self.grid.world)
        self.dir.prune(self.c.keep)

    def close(self):
        """At exit: the save in flight on disk, then the directory free for another run."""
        try:
            self.wait()
        finally:
            self.dir.release()

    def claim(self):
        """Before any work, on every rank: rank 0 claims the directory (CkptDir.claim), all agree."""
        if self.compile_only:
            self.say(f"pre-compile pass (graph extraction: its values are not real): nothing is read from or "
                     f"written to {self.root}")
            return
        problem = self.dir.claim(self.c.resume, self.c.start_fresh) if self.grid.rank == 0 else None
        if not agree(self.grid, problem is None):
            raise CheckpointError(problem or f"rank 0 could not claim {self.root} (see its message)")

    # --------------------------------------------------------------- load
    def load_latest(self, load_optim: bool = True, names=None) -> Loaded | None:
        """The newest complete, valid checkpoint, or None to start fresh (saying why); on every rank.
        Newer folders, interrupted or damaged, are passed over and renamed aside (kept), a
        damaged one loudly, with the steps lost; only a damaged one: refused, nothing touched.
        names: this rank's model state keys (at another layout only those are built)."""
        self.wait()
        if self.compile_only:
            return None
        if not self.c.resume:
            self.say("--ckpt.resume=false: starting fresh")
            return None
        if not self.has_checkpoints():
            self.say(f"no checkpoint directory {self.root}: starting fresh" if not self.root.is_dir() else
                     f"{self.root} holds no checkpoint: starting fresh")
            return None
        d, skipped = find_newest_valid(self.root, self.grid, self.say, self._log)
        damaged = [(x, p) for x, v, p in skipped if v == ckptdir.DAMAGED]
        if d is None and damaged:
            raise CheckpointError(
                f"{self.root} holds no valid checkpoint to resume: " + "; ".join(f"{x.name}: {p}" for x, p in damaged) +
                ". Nothing was changed. To start over, run with --ckpt.resume=false --ckpt.start_fresh (the "
                "folders are moved aside into previous_<time>/, not deleted), or copy a good checkpoint back")
        loaded = None
        if d is not None:
            meta = json.loads((d / "meta.json").read_text())
            check_config(meta, d, self.cfg, self.say)
            loaded = reshard.read(d, meta, self.grid, self.layout, self.cfg.model, load_optim, names, self.say,
                                  self.device, positions=not self.c.reset_data)
        where = {}
        if skipped:
            parallel.barrier(self.grid)         # every rank is done looking at them
            if self.grid.rank == 0:
                where = self.dir.set_aside([(x, v) for x, v, _ in skipped])
                # `latest` named a folder now set aside: it names d, or is gone when none is left (or unwritable)
                if d is None or not self.dir.write_latest(d):
                    (self.root / "latest").unlink(missing_ok=True)
            parallel.barrier(self.grid)
        elif d is not None and self.grid.rank == 0:     # stale after a kill between a manifest and its `latest`,
            latest = self.root / "latest"               # or a newest folder deleted by hand: named until a save
            if not latest.is_file() or latest.read_text(errors="replace").strip() != d.name:
                self.dir.write_latest(d)
        kept = lambda x: f" (kept as {where[x].name})" if x in where else ""
        if loaded is None:
            self.warn(f"no complete checkpoint in {self.root}: " + "; ".join(
                f"{x.name} was interrupted{kept(x)}" for x, _, _ in skipped) + "; starting fresh from step 0")
            return None
        for x, p in damaged:
            lost = int(x.name[5:13]) - loaded.step
            self.warn(f"{x.name} is damaged ({p}){kept(x)}: resuming from the newest valid older checkpoint, "
                      f"{d.name}; {lost} step{'s' * (lost != 1)} ({loaded.step + 1} to {x.name[5:13].lstrip('0')}) "
                      f"will be trained again")
        fmt = loaded.meta.get("format", 1)
        if fmt >= 2 and self.grid.rank == 0:
            self.dir.lineage = ckptdir.read_manifest(d / ckptdir.MANIFEST)["lineage"]    # continue its lineage
        elif fmt < 2:
            self.say(f"{d.name} has checkpoint format {fmt} (no manifest): it is loaded as it is, and it and the "
                     f"other format-{fmt} checkpoints are kept, never pruned; delete them when you no longer need them")
        self._newest = loaded.step
        self.say(f"resuming from {loaded.path} (step {loaded.step})")
        return loaded

# ----------------------------------------------------------------------------- preemption

PEER_STOPPED = 75                   # EX_TEMPFAIL: stopped with a checkpoint because another node got the signal


class StopSignal:
    """SIGTERM (what SLURM, Kubernetes and torchrun send first), SIGUSR1 (the early warning scripts/slurm_train.sbatch
    asks for) and SIGINT end the run at the next step boundary with a checkpoint of that step, inside the launcher's
    grace period (stop_budget). Ranks agree at every boundary with one blocking MAX all-reduce over the host group, so
    all stop after the same step; one read a boundary later would stop a step late (7B: 1.5 s on 128 nodes, plan.py;
    11 s on 16, a third of a 30 s grace period). At 4096 ranks that 8-byte gloo ring is ~8,000 hops, 0.1-0.2 s of
    host time a step, hidden while the device runs ahead (gloo here: 0.3 / 1.5 / 6 ms at 2 / 4 / 8 ranks)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, grid: Grid):
        self.grid, self.got, self.heard_at, self.heard_during, self.during = grid, 0, None, 0, 0   # 0: the set-up
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(sig, self._note)
        # launch.sh's folder (docs/eks.md): train.py's ended.RANK at the run's end; its 'stop' when it passed a signal
        # on before these handlers existed (a worker ignores SIGUSR1 until then, as torchrun does: the signal was lost)
        self.launcher = os.getenv("NANOTRN_ENDED_DIR", "")
        if self.launcher and os.path.isfile(os.path.join(self.launcher, "stop")):
            self._note(signal.SIGUSR1, None)

    def _note(self, signum, frame):
        if not self.got:    # a repeat is ignored: torchrun forwards the Ctrl-C the terminal already sent
            # `during`: the step this signal counts for: the next boundary's agreement includes it
            self.got, self.heard_at, self.heard_during = signum, time.monotonic(), self.during
            what = ("while this rank ends on an error" if self.during is None else
                    "after the last step: the run is ending" if self.during < 0 else "during the set-up: stopping"
                    if not self.during else f"during step {self.during}: stopping after it with a checkpoint")
            print(f"[rank {self.grid.rank}] {signal.Signals(signum).name} {what} (SIGKILL aborts at once)",
                  file=sys.stderr, flush=True)

    def requested(self, step: int) -> str | None:
        """Call at every step boundary (after `step` steps) on every rank: the signal's name once
        any rank heard one during a step up to this one, else None."""
        self.during = step + 1              # a signal noted from here on counts for the next boundary
        agreed = agree(self.grid, self.got if self.got and self.heard_during <= step else 0, dist.ReduceOp.MAX)
        if agreed and self.heard_at is None:            # told by the others: the grace period runs from now
            self.heard_at = time.monotonic()
        return signal.Signals(agreed).name if agreed else None


def peers_lost(e: BaseException | None) -> bool:
    """A collective's failure: gloo's (naming its source; at once when a peer is gone) or nccl's DistError."""
    return isinstance(e, torch.distributed.DistError) or isinstance(e, RuntimeError) and "gloo" in str(e)


def stop_budget(ckpt: Checkpointer, stop: StopSignal, grid: Grid,
                grace_s: float) -> tuple[bool, str]:
    """Whether the final save can finish inside the grace period, on every rank (a checkpoint is all
    ranks' or none). The save in flight is waited for first: it is what remains if this one cannot
    be written. This rank's time is its previous save's in this run: staging (blocked_s) plus the
    write; without one to measure, the save is tried (killed half-written, resume skips it)."""
    ckpt.wait()
    s, left = ckpt.stats, grace_s - (time.monotonic() - stop.heard_at)
    need = None
    if s.get("write_s") and s.get("bytes"):
        # staging (in the writer thread too on a CPU host) and the write less what it waited for a
        # CPU at background priority (a stop's save runs at normal priority); + 1 s: markers, exit
        need = s["blocked_s"] + s.get("deferred_copy_s", 0) + s["write_s"] - s.get("starved_s", 0) + 1.0
    ok = bool(agree(grid, need is None or need < left))
    said = f"{max(left, 0.0):.1f} s of the {grace_s:g} s grace period are left"    # not "-0.0 s": past it
    why = (f"{said} and this rank's last save ({s.get('bytes', 0) / 1e9:.2f} GB) took {need:.1f} s"
           if need is not None else f"{said} (no earlier save in this run to time)")
    return ok, why


# ----------------------------------------------------------------------------- command line: ls, export

def cli(argv: list[str]):
    """python checkpoint.py ls CKPT_DIR
        each checkpoint in CKPT_DIR (a run's --ckpt.dir): ok, or why loading would skip it
    python checkpoint.py export [--dtype=auto|fp32|bf16] [--overwrite] CKPT_DIR HF_OUT_DIR
        the newest valid one as a Hugging Face folder (auto: bf16 past 1B parameters, else fp32)
    In one process, whatever layout wrote the checkpoint; arguments are checked first."""
    usage = ("usage: python checkpoint.py ls CKPT_DIR | export [--dtype=auto|fp32|bf16] [--overwrite] "
             "CKPT_DIR HF_OUT_DIR")
    if "-h" in argv or "--help" in argv:
        return print(f"{usage}\n\n" + cli.__doc__.replace("\n    ", "\n"))     # (the docstring's indent)
    flags = [a for a in argv if a.startswith("-")]       # -x too: named as a flag, not counted as a path
    argv = [a for a in argv if not a.startswith("-")]
    dtypes = sorted({f.split("=", 1)[1] for f in flags if f.startswith("--dtype=")})
    if len(dtypes) > 1:
        raise CheckpointError(f"--dtype given as {' and '.join(dtypes)}: give it once; {usage}")
    dtype = dtypes[0] if dtypes else "auto"
    bad = [f for f in flags if f != "--overwrite" and not f.startswith("--dtype=")]
    if argv and argv[0] not in ("ls", "export"):
        raise CheckpointError(f"unknown command {argv[0]!r}; {usage}")
    if bad or dtype not in ("auto", "fp32", "bf16"):      # the flag given and its fix, not only the usage
        flag = bad[0] if bad else f"--dtype={dtype}"
        raise CheckpointError(f"{flag}: " + ("give --dtype=auto, --dtype=fp32 or --dtype=bf16" if flag.startswith("--dtype")
                                             else "unknown flag") + f"; {usage}")
    if not argv:
        raise CheckpointError(usage)
    if argv[0] == "ls" and flags:                           # else silently ignored
        raise CheckpointError(f"{flags[0]} is export's flag: ls takes CKPT_DIR only; {usage}")
    if len(argv) != {"ls": 2, "export": 3}[argv[0]]:      # what was given, not only the usage
        want = "CKPT_DIR" if argv[0] == "ls" else "CKPT_DIR HF_OUT_DIR"
        raise CheckpointError(f"{argv[0]} takes {want}, given {' '.join(map(repr, argv[1:])) or 'nothing'}; {usage}")
    root = argv[1]
    if (kind := path_kind(root)) != "a directory":
        raise CheckpointError(f"{root!r} is {'missing' if kind == 'nothing' else kind}: give a checkpoint "
                              f"directory (the --ckpt.dir of a run)")
    if not ckptdir.scan(Path(root)) and ckptdir.scan(Path(root, "ckpt")):      # train.py --out_dir=root's default
        raise CheckpointError(f"{root} is a run's --out_dir: give its --ckpt.dir, {Path(root, 'ckpt')}")
    if argv[0] == "export":
        out = argv[2]
        try:
            check_dir("HF_OUT_DIR", out)
        except ConfigError as e:
            raise CheckpointError(str(e).replace("--HF_OUT_DIR=", "")) from None
        if Path(out).resolve().is_relative_to(Path(root).resolve()):     # --overwrite would remove its files
            raise CheckpointError(f"{out} is inside the checkpoint directory {root}: export to a folder outside it")
        there = set(os.listdir(out)) - {hf.EXPORT_TMP} if os.path.isdir(out) else set()   # (a killed export's)
        if there and "--overwrite" not in flags:
            raise CheckpointError(f"{out} is not empty: export into a new folder, or pass --overwrite to "
                                  f"replace what is there")
        if foreign := sorted(there - hf.EXPORT_FILES):     # --overwrite replaces an earlier export, not mixed in
            raise CheckpointError(f"{out} holds files that are not a nanotrn export ({', '.join(foreign[:3])}): "
                                  f"--overwrite replaces only an earlier export; move them, or export into a new folder")
    found, aside = ckptdir.scan(Path(root)), ckptdir.aside(root) if argv[0] == "ls" else []
    if not found and not aside:
        if ckptdir.STEP_DIR.match(Path(root).resolve().name):     # one checkpoint, not the directory of them
            raise CheckpointError(f"{root} is one checkpoint: give the directory that holds it, "
                                  f"{Path(root).resolve().parent}")
        raise CheckpointError(f"{root} holds no checkpoint (no step_* directory): is it a run's --ckpt.dir?")
    try:
        for _, d in found:
            verdict, problem, files = ckptdir.check(d)
            problem = problem or ckptdir.verify(d, files)
            if verdict == ckptdir.NEWER and argv[0] == "export":
                raise CheckpointError(problem)
            if argv[0] == "ls":
                print(f"{d.name}  {'ok' if problem is None else 'BAD: ' + problem}")
            elif problem is not None:       # an older model than the newest: never without a word
                print(f"skipping {d.name}: {problem}", file=sys.stderr)
            else:
                import data
                run = json.loads((d / "meta.json").read_text())["config"]
                m = ModelConfig(**run["model"])
                tok_dir = Path(root) / "tokenizer"
                tok = data.load_tokenizer(str(tok_dir)) if tok_dir.is_dir() else None
                # the tokenizer the run read its data with (its data state's fingerprint), not another run's beside it
                rank0 = reshard.load_file(d / "rank00000.pt", weights_only=False) if tok else {}
                saved = (rank0.get("data") or {}).get("tokenizer")
                if saved not in (None, getattr(tok, "fingerprint", None)):
                    raise CheckpointError(f"{tok_dir} holds another tokenizer than the one {d.name} was trained with "
                                          f"(fingerprint {tok.fingerprint}, the checkpoint's {saved}: another run's, or "
                                          f"damaged): its token ids mean other things; put the run's own tokenizer there")
                full = reshard.full_model_state(d, m, masters=True)     # mixed: the fp32 masters, as train.py's
                hf.save_hf(full, m, out, hf.export_dtype(dtype, m), tok, "--overwrite" in flags,
                           bos=run.get("data", {}).get("bos", True))      # its tokenizer adds BOS as the run did
                return print(f"exported {d} to {out}"
                             + ("" if tok else " (no tokenizer/ beside the checkpoints: none exported)"))
        for d, why in aside:
            print(f"{d.name}  set aside: {why}; kept, never resumed from")
    except FileNotFoundError as e:      # a run writing into root pruned or set it aside meanwhile
        raise CheckpointError(f"{e.filename} was removed while it was read (a run writing into {root} pruned or "
                              f"set aside that checkpoint): run the command again") from None
    if argv[0] == "export":
        raise CheckpointError(f"no complete, valid checkpoint in {root}")


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        cli(argv)
    except (CheckpointError, ConfigError) as e:                # ConfigError: hf.HFError, data.DataError
        sys.exit(f"checkpoint error: {e}" if not str(e).startswith("usage") else str(e))
    except KeyboardInterrupt:       # Ctrl-C: one word and the shell's status for it, 128 + SIGINT (as train.py)
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:         # `python checkpoint.py ... | head`: the reader left (as plan.py); no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
