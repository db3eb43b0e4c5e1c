"""nanotrn training: one file a reader follows from the command line to the last step.

    python train.py                                   # the tiny preset on CPU, on the embedded corpus
    torchrun --nproc_per_node=4 train.py --tp=2 --dp=2
    scripts/launch.sh train --preset llama2_7b --data train.arrow --tokenizer tokenizer.model   # a trn1 node
    scripts/launch.sh train --preset llama3_8b --init_from=Meta-Llama-3-8B --data train.arrow

The order of a run (run): parse and validate the whole config (bad input fails here, before any
work); pick the device; create the process groups; claim the checkpoint directory; the data's span
index, then the tokenizer; the model, built empty and filled from the newest complete checkpoint,
--init_from or the seed; the optimizer; then steps until max_steps (or SIGTERM / SIGINT), logging, evaluating, saving.
"""
from __future__ import annotations

import signal
if __name__ == "__main__":      # Ctrl-C while the imports below load (seconds, even the stdlib's on a busy host):
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # end quietly, not with a traceback; cli() replaces it

import contextlib
import dataclasses
import errno
import filecmp
import os
import sys
import threading
import time

import torch

import checkpoint
import configs
import data
import hardware
import hf
import model as llama
import monitor
import optim
import parallel
import pipeline
import reshard
from corpus import check_vocab, mixture_files
from planner.instances import INSTANCES


# ----------------------------------------------------------------------------- device

def sync(device: torch.device):
    """Cut the lazy graph here and launch it (XLA; elsewhere nothing to do): where the syncs are
    decides which graphs neuronx-cc compiles. As NxD and the HLAT scripts: after each microbatch's
    backward, after the update, after each pipeline task and each evaluation batch. Without them a
    7B step of 16 microbatches is ONE graph of 16 model copies (tests/test_xla.py counts graphs)."""
    if device.type == "xla":
        import torch_xla
        torch_xla.sync()


# ----------------------------------------------------------------------------- one step

def forward_backward(model, batches: list[dict], scale: torch.Tensor, cut) -> torch.Tensor:
    """Each microbatch's forward and backward (its summed token loss times `scale`, so the
    gradients add up over microbatches); returns the summed token loss. cut() after each backward:
    a graph for the first microbatch (it creates the gradients) and one for every later one (it
    adds to them), whatever their number (NxD and the HLAT scripts: xm.mark_step per microbatch)."""
    loss_sum = 0.0
    for b in batches:
        loss = model(b["tokens"], b["positions"], b.get("doc_ids"), b["targets"], scale)   # summed over tokens
        (loss * scale).backward()       # the model's fused loss was told the scale: it applies it in fp32
        loss_sum = loss_sum + loss.detach()
        cut()
    return loss_sum


def train_step(model, optimizer, batches: list[dict], grid: parallel.Grid, cfg: configs.Config,
               guard=None, cut=pipeline.no_cut) -> dict:
    """Forward and backward over this rank's microbatches (under PP pipeline.forward_backward, the stage's schedule),
    then reduce, clip and update. The loss is torchtitan's: the sum of token losses over the valid tokens of the WHOLE
    global batch. Each rank back-propagates local_sum * dp / global_tokens, and the gradients are summed over DP once
    per step and divided by the DP degree, never the world size (HLAT diverged when torch-xla divided by it): every
    layout and accumulation gives one process's gradient. guard(loss, grad_norm) -> bool runs between clipping and the
    update (the non-finite policy): False skips it. cut() ends the traced graph (train.sync on XLA) after the token
    count and each microbatch; the caller's sync ends the reduce/clip/update graph. Returns tensors (and the
    pipeline's statistics): no host sync on XLA."""
    local_tokens = sum((b["targets"] != -100).sum() for b in batches)
    # reduced in float32: Neuron's all-reduce adds in f32 anyway, and refuses integers in later releases (exact to 2^24)
    global_tokens = parallel.all_reduce(local_tokens.float(), grid.dp_group).clamp(min=1)
    scale = grid.dp / global_tokens
    cut()       # the token count is a graph of its own: the only one that reads every microbatch
    stats = {}
    if grid.pp > 1:
        loss_sum, stats = pipeline.forward_backward(model, batches, scale, grid, cfg, cut)
    else:
        loss_sum = forward_backward(model, batches, scale, cut)
    if getattr(optimizer, "zero1", False):
        # ZeRO-1: the optimizer's reduce-scatter replaces the DP all-reduce; the TP sums
        # (SP norm weights, replicated KV heads) still come first.
        parallel.reduce_tp_replicated_gradients(model, grid)
        grad_norm = optimizer.reduce_scatter_and_clip(cfg.optim.grad_clip)     # adds over TP and PP
    else:
        parallel.reduce_gradients(model, grid)
        grad_norm = parallel.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, grid)
    loss = parallel.all_reduce(loss_sum, grid.dp_group) / global_tokens
    skipped = optim.guarded_step(optimizer, True if guard is None else guard(loss, grad_norm))
    if grid.pp > 1:
        pipeline.sync_tied_embedding(model, grid, optimizer)        # bf16_sr (hardware; ZeRO-1): copies round apart
    optimizer.zero_grad()
    return {"loss": loss, "grad_norm": grad_norm, "tokens": global_tokens, "skipped": skipped, **stats}


@torch.no_grad()
def evaluate(model, loader, n_batches: int, grid: parallel.Grid, device: torch.device, cut=pipeline.no_cut):
    """Mean token loss over a fixed number of held-out batches: the same ones every time.
    cut() after each batch: one forward graph, whatever n_batches."""
    if grid.pp > 1:
        return pipeline.evaluate(model, loader, n_batches, grid, device, cut)
    model.eval()
    loader.reset()
    total, count = 0.0, 0
    for _ in range(n_batches):
        b = next(loader)
        b = dict(zip(b, parallel.to_device(list(b.values()), device)))     # XLA: one batched transfer
        total = total + model(b["tokens"], b["positions"], b.get("doc_ids"), b["targets"])
        count = count + (b["targets"] != -100).sum(dtype=torch.float32)      # float: Neuron's all-reduce (train_step)
        cut()
    model.train()
    total = parallel.all_reduce(total, grid.dp_group)
    return total / parallel.all_reduce(count, grid.dp_group).clamp(min=1)


DATA_WARNINGS = ("bad_records", "utf8_replacements")


def run_total(counts: list, grid: parallel.Grid) -> list[int]:
    """Counts of every rank's data loader (saved and resumed with its position) summed over the run, divided by tp * pp
    (one DP replica's ranks read the same data): one all-reduce of a few numbers at log steps, over gloo's ring:
    2 (world - 1) hops, some 0.1-0.2 s of host time at 4096 ranks as checkpoint.StopSignal's (here 0.38 / 1.7 /
    5.5 ms at 2 / 4 / 8 ranks)."""
    t = torch.tensor([float(c) for c in counts], dtype=torch.float64, device=grid.host_device)
    if grid.world > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, group=grid.host_group)
        t /= grid.tp * grid.pp
    return t.round().long().tolist()


def data_warnings(stats: dict, grid: parallel.Grid) -> dict[str, int]:
    """The run's count of each data problem (at log steps)."""
    return dict(zip(DATA_WARNINGS, run_total([stats.get(k, 0) for k in DATA_WARNINGS], grid)))


# ----------------------------------------------------------------------------- before any work

def check_memory(cfg: configs.Config, device: torch.device) -> None:
    """This rank's share of the weights (fp32 on the host; on a CPU run with their gradients and AdamW moments),
    one full weight, and on a CPU run a microbatch's document mask (two [B, T, T] bools, model.document_mask): a
    10^9 vocabulary or a 131072-token sequence fails here, not in an allocation minutes later."""
    m, p, d, cpu = cfg.model, cfg.parallel, cfg.data, device.type == "cpu"
    act = 2 * d.micro_batch * d.seq_len**2 if cpu and d.document_mask else 0
    largest, what = max((m.vocab_size * m.dim, f"the embedding (--model.vocab_size={m.vocab_size} x --model.dim={m.dim})"),
                        (m.ffn_dim * m.dim, f"an MLP weight (--model.ffn_dim={m.ffn_dim} x --model.dim={m.dim})"),
                        (m.n_heads * m.head_dim * m.dim, f"an attention weight (--model.n_heads={m.n_heads} x head dim "
                                                         f"{m.head_dim} x --model.dim={m.dim})"))
    need = llama.num_params(m) / (p.tp * p.pp) * (16 if cpu else 4) + 4 * largest
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if need + act > have:
        batch = f", a [B, T, T] mask (--data.micro_batch={d.micro_batch}, --data.seq_len={d.seq_len}) {act / 2**30:,.1f} GiB more"
        raise configs.ConfigError(
            f"the run does not fit in memory: {llama.num_params(m) / 1e9:.3g}B parameters need {need / 2**30:,.0f} GiB per "
            f"process (its largest weight, {what}, alone {4 * largest / 2**30:,.1f} GiB){batch if act else ''}, but this "
            f"host has {have / 2**30:,.0f} GiB per process; " + ("shrink the model or raise --tp/--pp" if need > have
                                                                 else "lower --data.micro_batch or --data.seq_len"))


def check_tokenizer(cfg: configs.Config) -> None:
    """The tokenizer tokenizer_for_run will take, checked before the corpus is indexed: --data.tokenizer loads and fits
    the vocabulary (under --init_from, the folder's: a folder of weights only is refused here, not after indexing)."""
    folder, tok = cfg.init_from, cfg.data.tokenizer
    if checkpoint.ckptdir.scan(cfg.ckpt.dir) and not tok and cfg.ckpt.resume:    # (listed first: unlistable, one line)
        checkpoint.kept_tokenizer(cfg.ckpt.dir, os.path.join(cfg.ckpt.dir, "tokenizer"))
    elif not tok:                       # one will be trained (a tokenizer/ alone too), of a vocabulary that fits
        check_vocab(cfg.model.vocab_size, cache_dir=cfg.data.cache_dir)
    if not tok:
        return
    gen = os.path.join(tok if os.path.isdir(tok) else os.path.dirname(tok), hf.GENERATION)
    if os.path.isfile(gen):             # the export keeps it (hf.save_hf): a broken one refused now, not after the run
        hf.json_object(gen, "re-download it, or remove it (the export then writes defaults)")
    if not folder:
        return data.build_tokenizer(cfg.data, cfg.model.vocab_size)      # loads it: no corpus read, nothing trained
    n, v = data.load_tokenizer(tok).vocab_size, cfg.model.vocab_size
    # The folder's own tokenizer may have fewer pieces than a multiple of 128 pads to (DeepSeek-Coder: 32,022 of 32,256);
    # one from elsewhere that far from the rows is another model's.
    if not n <= v or (tok != folder and v > -(-n // 128) * 128):
        raise hf.HFError(f"the tokenizer {tok} has {n} pieces but {folder}/config.json's vocab_size is {v}: they "
                         f"do not belong together; " + ("use the model's own tokenizer (leave --data.tokenizer "
                         "empty)" if tok != folder else "give its tokenizer with --data.tokenizer"))
    data.build_tokenizer(cfg.data, v, pretrained=True)      # then its BOS/EOS pieces (a sentencepiece model's export too)


def tokenizer_for_run(cfg: configs.Config, corpus: data.Corpus, ckpt: checkpoint.Checkpointer,
                      grid: parallel.Grid, log) -> data.Tokenizer:
    """--data.tokenizer; else on a resume the run's own, kept beside its checkpoints (one trained again,
    on a new corpus or by a newer recipe, would give token ids other meanings: a resume given another
    is refused); else trained on the corpus (cached). Kept there by rank 0: `checkpoint.py export` ships it."""
    d, own = cfg.data, os.path.join(cfg.ckpt.dir, "tokenizer")
    resuming = cfg.ckpt.resume and ckpt.has_checkpoints()
    if not d.tokenizer and resuming:        # none kept there: refused (kept_tokenizer says why)
        log(f"tokenizer: the run's own, kept in {checkpoint.kept_tokenizer(ckpt.root, own)}")
        d = dataclasses.replace(d, tokenizer=own)
    tok = data.build_tokenizer(d, vocab_size=cfg.model.vocab_size, corpus=corpus, pretrained=bool(cfg.init_from))
    name = "tokenizer.json" if isinstance(tok, hf.HFTokenizer) else "tokenizer.model"
    kept = [k for k in (os.path.join(own, n) for n in ("tokenizer.model", "tokenizer.json")) if os.path.isfile(k)]
    same = any(os.path.basename(k) == name and filecmp.cmp(k, tok.path, shallow=False) for k in kept)
    if kept and not same:           # fresh: a user's own tokenizer/ there, which keeping this run's would replace
        raise checkpoint.CheckpointError(checkpoint.other_tokenizer(ckpt.root, kept[0], tok.path, resuming))
    problem = None
    # kept again under --init_from though the same: that folder's generation_config.json, not an earlier run's
    if grid.is_main and (not same or cfg.init_from) and not ckpt.compile_only:
        try:
            checkpoint.keep_tokenizer(tok, own, cfg.init_from)
        except OSError as e:        # a full disk: one line, on every rank together (one 4-byte all-reduce)
            problem = (f"could not keep the tokenizer in {own} ({'disk full' if e.errno == errno.ENOSPC else e}): "
                       + ("free space, or " if e.errno == errno.ENOSPC else "") +
                       "point --ckpt.dir at a writable disk with room for the checkpoints")
    if not checkpoint.agree(grid, problem is None):
        raise checkpoint.CheckpointError(problem or f"rank 0 could not keep the tokenizer in {own} (see its message)")
    return tok


# ----------------------------------------------------------------------------- the run

def run(argv: list[str]) -> None:
    # All checked before any work: keys, model shape, layout (xla's rules), paths, tokenizer, memory, export folder.
    if configs.wants_help(argv):         # every key, its value and its comment, from configs.py
        return print(configs.help_text("\n\n".join(__doc__.split("\n\n")[:2]), argv))
    cfg = configs.from_args(argv)
    world, rank = parallel.launch_env()  # torchrun's WORLD_SIZE and RANK, checked: read here only
    hf.apply_init_from(cfg, argv, (rank, world))    # --init_from: the model (and tokenizer) of a Hugging Face folder
    device = hardware.pick_device(cfg.device, world)
    configs.validate(cfg, world, parallel.backend_for(device.type))
    optim.check_rounding(cfg.optim.precision, device)   # bf16_sr: the device must round stochastically
    hardware.check_auto_cast(cfg.optim.precision, device)   # neuronx-cc keeps the fp32 the precision chose
    configs.check_paths(cfg)
    listing = (*mixture_files(cfg.data.data, cfg.data.split, left := []), left)   # --data readable, with files: Corpus's
    check_tokenizer(cfg)                               # after check_paths: a FIFO is refused, not read
    out_dir = hf.check_export_dir(cfg, (rank, world))  # the final export; never over someone's files
    check_memory(cfg, device)
    for w in configs.warnings(cfg) if rank == 0 else []:
        print(f"warning: {w}", file=sys.stderr)

    with monitor.quiet_gloo():                         # not gloo's lines for each group on each rank
        grid = parallel.init_distributed(cfg, device)
    log = print if grid.is_main else (lambda *a, **k: None)
    # A hang ends the run with this rank's stacks (monitor.Watchdog): start-up, a resume, the first
    # compiles may take up to --log.hang_startup_s; a step, --log.hang_factor median steps.
    dog = monitor.Watchdog(grid.rank, cfg.log.hang_factor, cfg.log.hang_min_s, cfg.log.hang_startup_s)
    ckpt = mon = train_loader = val_loader = None
    stop = checkpoint.StopSignal(grid)
    try:
        # The checkpoint directory: a directory, writable, and this run's alone (a lock), before any
        # work. neuron_parallel_compile's pre-compile pass (scripts/launch.sh compile) runs this same
        # command with NEURON_EXTRACT_GRAPHS_ONLY set: every value is invalid, so it reads and writes
        # no checkpoint (and no export), yet traces the save and load graphs a real run compiles.
        compile_only = bool(os.environ.get("NEURON_EXTRACT_GRAPHS_ONLY"))
        ckpt = checkpoint.Checkpointer(cfg, grid, device, log=print, compile_only=compile_only)
        ckpt.claim()
        accum = configs.grad_accum_steps(cfg, grid.dp)
        log(f"nanotrn: preset {cfg.preset or '-'}, device {device}, world {grid.world} = "
            f"tp {grid.tp} x pp {grid.pp} x dp {grid.dp}, {accum} microbatches of {cfg.data.micro_batch}")
        checkpoint.seed_all(cfg.seed)

        # Data. The span index first (one file per corpus, built once, memory-mapped): the size check needs only
        # bytes, so a corpus too small for one global batch is refused before a tokenizer is trained (at first use,
        # cached; one process trains, the others wait). Every TP/PP rank of a DP replica reads the same batches.
        d = cfg.data
        corpus = data.Corpus(d.data, d.text_field, d.doc_per_line, d.split, d.cache_dir, listing=listing)
        index = data.SpanIndex(corpus, d.seq_len, d.cache_dir, d.val_fraction)
        trains = not d.tokenizer and not (cfg.ckpt.resume and ckpt.has_checkpoints())    # tokenizer_for_run's choice
        data.check_size(d, index, grid.dp, cfg.log.eval_windows if cfg.log.eval_interval else 0,
                        cfg.model.vocab_size if trains else 0)
        tok = tokenizer_for_run(cfg, corpus, ckpt, grid, log)   # given, the run's own, or trained
        train_loader = data.PackedLoader(d, tok, grid.dp_rank, grid.dp, split="train", corpus=corpus, index=index)
        # Evaluation is a property of the model: the same held-out windows at every layout (data.py).
        val_loader = data.EvalWindows(d, tok, cfg.log.eval_windows, grid.dp_rank, grid.dp, corpus=corpus,
                                      index=index) if cfg.log.eval_interval else None

        # The model: this rank's shard, built empty, then filled from ONE source, the first that
        # applies: this run's newest complete checkpoint (a resume, at any layout), --init_from (a
        # Hugging Face folder: this rank's rows only), else the seed (the same full weights at every
        # layout). Filled before the optimizer is built: "mixed" copies its fp32 master from them.
        layout = pipeline if grid.pp > 1 else parallel   # PP: this rank builds and exports one stage
        dtype = optim.param_dtype(cfg.optim.precision)
        model = layout.build_model(cfg, grid, device, dtype=dtype)
        loaded = ckpt.load_latest(names=set(model.state_dict()))
        masters = {} if cfg.optim.precision == "mixed" else None     # the file's values, not their bf16 rounding
        if loaded is not None:
            model.load_state_dict(loaded.model)
        elif cfg.init_from:
            hf.load_sharded(model, cfg.init_from, cfg.model, grid.tp, grid.tp_rank, masters)
        else:
            parallel.init_weights(model, cfg, grid)
        model = parallel.move_model(model, device)      # XLA: filled on the host, then moved (build_model)
        if device.type == "xla":         # torch-xla's checkpoint adds the barrier XLA needs
            llama.use_xla_checkpointing(model)
        optimizer = optim.build_optimizer(model, cfg, grid, masters=masters)
        del masters
        flops_tok = llama.flops_per_token(cfg.model, d.seq_len)
        log(f"model: {llama.num_params(cfg.model) / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOP per "
            f"token, precision {cfg.optim.precision}, checkpointing {cfg.model.checkpointing}{optimizer.describe()}")

        # The rest of a resume: optimizer, data position (by global window index: at another DP
        # degree each rank takes the streams it now owns, data.py), RNG streams.
        step, saved = 0, None            # saved: the newest checkpoint of this run's lineage
        if loaded is not None:
            if loaded.optim is not None:
                optimizer.load_state_dict(loaded.optim)
            if cfg.ckpt.reset_data:      # a new corpus: the stream starts afresh, with the model's own tokenizer
                log("--ckpt.reset_data: the model and optimizer continue, the data stream starts afresh")
            else:
                try:
                    train_loader.load_state_dict(loaded.data)
                except data.StaleDataState as e:     # a checkpoint of an older data format: keep the model
                    log(f"{e}; the model and optimizer continue, the data stream restarts from its beginning")
            if loaded.rng is not None:
                checkpoint.set_rng_state(loaded.rng, device)
            step, saved = loaded.step, loaded.step
            sync(device)        # the loaded state as a graph of its own, not folded into the first step's
        batches = data.DeviceLoader(train_loader, device)   # torch-xla's parallel loader on XLA

        peak, peak_how = hardware.device_peak_flops(device, dtype, cfg.log.peak_tflops,
                                                    INSTANCES[cfg.parallel.instance],
                                                    shapes=hardware.matmul_shapes(cfg, grid.tp))
        log(f"MFU peak: {peak / 1e12:.4g} TFLOP/s per device ({peak_how})")
        mon = monitor.Monitor(cfg, flops_per_token=flops_tok, peak_flops=peak * grid.world, is_main=grid.is_main,
                              device=device, start_step=step, resume=loaded.extra if loaded else None)
        tokens_per_step = d.global_batch * d.seq_len
        said = []                            # the kinds of data warnings already said (data_warnings)
        for line in corpus.start_warnings():    # empty files skipped, files of a folder left out
            log(line)
        cut = lambda: sync(device)           # noqa: E731  the graph cuts inside a step (see sync)
        if device.type == "xla":
            log("the first steps trace and compile their graphs (minutes with neuronx-cc; cached for later runs)")
        stopping, reloaded = stop.requested(step), False   # a signal heard in the set-up: no step, nothing new to save
        if done := loaded is not None and step >= cfg.optim.max_steps:     # this command's run finished before
            # done: and exported, as rank 0 sees it (every rank then skips the export's gather, a collective, together)
            done = bool(checkpoint.agree(grid, not grid.is_main or os.path.isfile(f"{out_dir}/config.json")))
            log(f"the run is already complete (step {step}, --optim.max_steps={cfg.optim.max_steps}): nothing to "
                f"train" + (f"; its final model is in {out_dir}" if done else ""))

        def guard(loss, grad_norm):      # between clipping and the update (train_step)
            ckpt.before_update()         # the last save's copy of the weights and moments is complete
            return mon.check_finite(step + 1, loss, grad_norm)
        while step < cfg.optim.max_steps and not stopping:
            # The schedule follows the step, skipped ones (--log.on_nonfinite=skip) too, as Adam's t does (AdamW._keep).
            # The field is split: Megatron (training.py: opt_param_scheduler.step only if update_successful) and
            # DeepSpeed hold it over an fp16 loss-scale overflow; OLMo-core's SkipStepOptimizer skips on the device
            # while the trainer's step, which sets the LR, goes on; torchtitan has no skip. Ours is decided on the
            # device on XLA (no host read), and a rare non-finite step has consumed its batch all the same.
            lr = optim.lr_at(step, cfg.optim)
            optimizer.set_lr(lr)
            t_data = time.perf_counter()
            micro = [next(batches) for _ in range(accum)]
            data_wait = time.perf_counter() - t_data
            with ckpt.faults.step(step, model):         # a test's crash, hang or NaN (faults.py)
                out = train_step(model, optimizer, micro, grid, cfg, guard=guard, cut=cut)
            sync(device)                                # the reduce/clip/update graph
            step += 1
            dog.step_done()
            log_now = step % cfg.log.interval == 0 or step == cfg.optim.max_steps    # (a shorter run: one point)
            # The blog's parameter norm, and its spread over the DP replicas (which must stay identical:
            # bf16_sr without ZeRO-1 updates each replica on its own), at log steps and the last only.
            pnorm = parallel.param_norm(model, grid) if log_now else None
            mon.step(step, loss=out["loss"], grad_norm=out["grad_norm"], lr=lr, tokens=tokens_per_step,
                     data_wait=data_wait, skipped=out["skipped"], param_norm=pnorm,
                     param_spread=parallel.replica_spread(pnorm, grid) if log_now and grid.dp > 1 else None)
            if log_now:     # each kind of data problem said once, by rank 0, between step lines (stdout)
                for kind, n in data_warnings(batches.stats(), grid).items():
                    if n and kind not in said:     # (every rank notes it: the totals below are a collective)
                        said.append(kind)
                        log(corpus.warning(kind, n))
            if grid.pp > 1 and log_now:
                log(f"step {step:6d} | pipeline bubble {out['bubble']:.3f} (ideal) | idle {out['idle']:.3f} "
                    f"(measured, rank 0) | peak live microbatches {out['max_live']}")
            # At the interval and after the last step (as Megatron): a run shorter than it reports one too
            eval_now = step == cfg.optim.max_steps or bool(cfg.log.eval_interval) and step % cfg.log.eval_interval == 0
            if val_loader is not None and eval_now:     # (--log.eval_interval=0: no val_loader, evaluation off)
                with dog.phase(f"the evaluation at step {step}"), mon.off_the_clock():
                    mon.eval(step, evaluate(model, val_loader, len(val_loader), grid, device, cut=cut))
            if len(corpus.groups) > 1 and eval_now:     # a weighted --data mixture's realized shares (trained on)
                log(f"step {step:6d} | {corpus.mixture_line(run_total(batches.stats()['windows_by_source'], grid))}")
            stopping = stop.requested(step)             # every rank agrees: stop after this step?
            periodic = (cfg.ckpt.interval and step % cfg.ckpt.interval == 0) or step == cfg.optim.max_steps
            if periodic or stopping:
                with dog.phase(f"the checkpoint save of step {step}"), mon.off_the_clock():
                    # (off_the_clock's flush raises on a poisoned state: it is never saved)
                    fits, why = (True, "") if periodic else checkpoint.stop_budget(ckpt, stop, grid, cfg.ckpt.grace_s)
                    if fits:
                        # On a CPU host the weights and moments are copied while the next step's
                        # forward and backward run (guard waits before its update): bench.py ckpt.
                        ckpt.save(step, model.state_dict(), optimizer.state_dict(), data=batches.state_dict(),
                                  extra=mon.state_dict(), defer_copy=True)
                        saved = mon.saved = step
                    else:
                        log(f"{stopping}: the checkpoint of step {step} cannot be written before the launcher's "
                            f"SIGKILL: {why}. Not starting it: the newest complete checkpoint stays "
                            + (f"step {saved} ({step - saved} steps lost)" if saved is not None else
                               "none (the run starts afresh)") +
                            ". Raise the grace period (--ckpt.grace_s and the launcher's: docs/checkpoints.md) "
                            "or save more often")
                    if compile_only and not reloaded:
                        # A resume's load graph without a checkpoint: the weights and optimizer state loaded
                        # back from host copies, as load_latest's are. Measured on XLA:CPU (tests/test_xla.py):
                        # after this pass a resume compiles nothing; without it, its load graph. At DP > 1 also
                        # its broadcasts of what one rank per DP group reads (tests/test_xla_rules.py).
                        # (NxD's examples skip the load here and leave that graph to the real run.)
                        reshard.rehearse(model.state_dict(), optimizer.state_dict(), grid, ckpt.layout["zero1"], device)
                        checkpoint.reload_from_host(model, optimizer, device)
                        sync(device)
                        reloaded = True
            ckpt.check()                                # a failed save (full disk) stops the run now
        stop.during = -1                     # no step to come: a signal now (the export, the sample) is told so
        mon.flush()
        if said:                             # the run's totals of what was said along the way
            totals = data_warnings(batches.stats(), grid)
            log("data: this run (each counted once) " + ", ".join(f"{k.replace('_', ' ')} {totals[k]:,}" for k in said))
    finally:
        stop.during = None if sys.exc_info()[1] else stop.during     # a signal from here on is told so (torchrun's)
        try:
            if ckpt is not None:
                ckpt.peers_lost = checkpoint.peers_lost(sys.exc_info()[1])  # rank 0: not 600 s for a dead rank's marker
                with dog.phase("the last save"):
                    ckpt.close()                        # waits for the save in flight
        finally:        # even when that save failed: the watchdog's backstop timer exits the process
            dog.close()
        for x in (mon, train_loader, val_loader):
            if x is not None:
                x.close()

    # The full model gathered on every rank suits small models; a 7B run (32 ranks per host)
    # exports from its checkpoint in one process instead.
    exports = llama.num_params(cfg.model) <= 1e9
    if compile_only:
        if exports:                 # the export's gathers: compiled now, not as the run ends
            gather_for_export(layout, model, optimizer, grid, device)
        log(f"pre-compile pass: {step} steps traced, nothing saved or exported")
    elif step < cfg.optim.max_steps:                    # stopped by a signal: no export, exit cleanly
        log(f"{stopping}: stopped after step {step}, " + (f"saved in {cfg.ckpt.dir}" if saved == step else
            f"not saved (the newest checkpoint is {f'step {saved}' if saved is not None else 'none'})")
            + "; run the same command to continue")
        if not stop.got:
            # The signal reached other nodes, not this one (Kubernetes drains one pod): exit 0 would end this node's
            # torchrun and tell the Job this pod's part is done; this status makes torchrun restart the workers, which
            # wait in the rendezvous for the stopped node's replacement and resume from this checkpoint (docs/eks.md).
            print(f"[rank {grid.rank}] {stopping} reached another node: exit {checkpoint.PEER_STOPPED}, so that "
                  f"torchrun restarts this node's workers for the next rendezvous", file=sys.stderr)
            parallel.destroy(grid)
            sys.exit(checkpoint.PEER_STOPPED)
    elif not exports:
        log(f"export the final model with: python checkpoint.py export {cfg.ckpt.dir} {out_dir}")
    elif not done:           # the end: the full model exported in Hugging Face format, and a short sample
        full = gather_for_export(layout, model, optimizer, grid, device)
        if grid.is_main:
            final = llama.Llama(cfg.model)      # fp32 on the host: a convert on XLA compiles a graph per shape
            final.load_state_dict({k: v.cpu().float() for k, v in full.items()})
            hf.save_hf(final.state_dict(), cfg.model, out_dir, hf.export_dtype(cfg.export_dtype, cfg.model),
                       tokenizer=tok, overwrite=True, bos=cfg.data.bos,    # checked at the start
                       gen_dir=os.path.join(cfg.ckpt.dir, "tokenizer"))     # the model folder's, kept there
            log(f"saved the final model to {out_dir} (Hugging Face format)")
            if cfg.log.sample_tokens:       # prompted and ended as transformers' generate on the export
                prompt = torch.tensor([hf.prompt_ids(tok, "def ", cfg.data.bos)], dtype=torch.long)
                sample = final.generate(prompt, cfg.log.sample_tokens, eos_id=hf.special_ids(tok)["eos"])
                log("sample:\n" + tok.decode([i for i in sample[0].tolist() if i < tok.vocab_size and i != tok.bos_id]))
            log(f"next: {out_dir} loads in transformers (docs/huggingface.md); checkpoints: python checkpoint.py ls "
                f"{cfg.ckpt.dir}" + (f"; curves: tensorboard --logdir {cfg.log.tensorboard}" * bool(cfg.log.tensorboard)))
    if step >= cfg.optim.max_steps and not compile_only and os.path.isdir(stop.launcher):  # then a signal is no stop
        open(os.path.join(stop.launcher, f"ended.{grid.rank}"), "w").close()
    parallel.destroy(grid)


def gather_for_export(layout, model, optimizer, grid: parallel.Grid, device: torch.device) -> dict:
    """The full model on every rank, for rank 0's export; mixed: the fp32 masters, of which the bf16 weights are the
    rounding (as checkpoint.py export's). The gathers are collectives, lazy on XLA: every rank launches them here,
    together. Left to rank 0's host read alone, they would wait for peers that never join (they exit): a hang."""
    full = layout.gather_full_state_dict(model, grid, masters=optimizer.masters())
    if grid.tp * grid.pp > 1:               # (at TP=1, PP=1 no collective: copies, read on the host)
        sync(device)
    return full


def main(argv: list[str], keep_signals: bool = False) -> None:
    """run(argv), then the signal handlers put back (not the command line's, keep_signals: see __main__)."""
    before = {sig: signal.getsignal(sig) for sig in checkpoint.StopSignal.SIGNALS}
    try:
        run(argv)
    finally:
        if threading.current_thread() is threading.main_thread() and not keep_signals:     # as StopSignal installs
            for sig, handler in before.items():
                if handler is not None:         # None: one set outside Python, which cannot be put back
                    signal.signal(sig, handler)


def cli(argv: list[str], keep_signals: bool = False) -> None:
    """The command line: main(), with every error a user can cause one line on stderr."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        main(argv, keep_signals)
    except (configs.ConfigError, checkpoint.CheckpointError, data.DataError, monitor.NonFiniteError) as e:
        # Before the process group each rank of a node checked the same input: its first rank says it, the others
        # 30 s later unless torchrun has stopped them (it prints every rank's stderr); after it rank 0, once (say_once).
        if isinstance(e, checkpoint.SaveFailed):        # this rank's own write (a full disk): no other rank says it
            sys.exit(f"error: {e}")
        if torch.distributed.is_initialized():
            sys.exit(monitor.say_once(f"error: {e}"))
        if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("LOCAL_RANK", "0") != "0":
            time.sleep(30)
        sys.exit(f"error: {e}")
    except RuntimeError as e:
        if not checkpoint.peers_lost(e):                # any other: a bug of ours, with its traceback
            raise
        why = (str(e).split("] ", 1)[-1].splitlines() or [""])[0]      # nccl's DistError adds a "Last error:" block
        sys.exit(f"error: [rank {os.environ.get('RANK', 0)}] a collective failed: another rank is gone or hung "
                 f"({why}); the restart (torchrun --max-restarts; under SLURM slurm_train.sbatch's MAX_RESTARTS) "
                 f"resumes from the newest complete checkpoint")
    except KeyboardInterrupt:                           # Ctrl-C: no traceback
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:         # `python train.py ... | head`: the reader left (as plan.py); no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def exit_now(code) -> None:
    """End the process without the interpreter's finalization, which can abort a rank at random: gloo's C++ threads
    may still drop a finished collective's last tensor reference, taking the GIL; a thread doing so while the
    interpreter finalizes gets pthread_exit, and its unwinding through a noexcept frame is std::terminate, SIGABRT
    (issue 25: one resume in eight; pytorch #190489, #179291). Our threads are joined and files closed by now."""
    if isinstance(code, str):                          # sys.exit("error: ...")
        print(code, file=sys.stderr)
        code = 1
    with contextlib.suppress(BrokenPipeError):         # `| head`: the reader left; the rest goes nowhere
        sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":
    try:
        # keep_signals: torchrun SIGTERMs all ranks once one died; SIG_DFL put back killed one before its error line
        cli(sys.argv[1:], keep_signals=True)
        status = 0
    except SystemExit as e:
        status = e.code
    except BaseException:                              # a bug of ours: its traceback, as Python prints it
        sys.excepthook(*sys.exc_info())
        status = 1
    exit_now(status)
