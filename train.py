"""nanotrn training: one file a reader follows from the command line to the last step.

    python train.py                                   # the tiny preset on CPU, on the embedded corpus
    torchrun --nproc_per_node=4 train.py --tp=2 --dp=2
    torchrun --nproc_per_node=32 train.py --preset llama2_7b --data train.arrow --tokenizer tokenizer.model

The order of a run: parse and validate the whole config (bad input fails here, before any work);
pick the device; create the process groups; tokenizer and data; model and optimizer; resume from
the newest complete checkpoint; then steps until max_steps, logging, evaluating and saving.
"""
from __future__ import annotations

import math
import os
import sys
import time

import torch

import configs
import data
import model as llama
import optim
import parallel


# ----------------------------------------------------------------------------- device
# The one place that knows device differences. Model, optimizer and parallel code never ask.

def pick_device(name: str) -> torch.device:
    """xla when torch_xla is importable and an XLA device exists (or asked for), else cuda, else cpu."""
    if name in ("auto", "xla"):
        try:
            import torch_xla
            if name == "xla" or os.environ.get("PJRT_DEVICE"):
                return torch_xla.device()
        except ImportError:
            if name == "xla":
                raise configs.ConfigError("--device=xla needs torch_xla (the Neuron venv has it)") from None
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if name == "cuda":
        raise configs.ConfigError("--device=cuda but no CUDA device is visible")
    return torch.device("cpu")


def sync(device: torch.device):
    """End of a step. On XLA this cuts the lazy graph and launches it; elsewhere nothing to do."""
    if device.type == "xla":
        import torch_xla
        torch_xla.sync()


# ----------------------------------------------------------------------------- one step

def train_step(model, optimizer, batches: list[dict], grid: parallel.Grid, cfg: configs.Config) -> dict:
    """Forward and backward over this rank's microbatches, reduce gradients, clip, update.

    Loss normalization follows torchtitan: the step's loss is the sum of token losses over the
    number of valid tokens in the WHOLE global batch. Each rank back-propagates
    local_sum * dp / global_tokens; reduce_gradients sums over DP and divides by the DP degree
    (never the world size: HLAT diverged when the all-reduce divided by world size). Every layout
    and every gradient accumulation therefore yields the same gradient. Gradients are reduced once,
    after the last microbatch: nothing is communicated on the others.
    Returns tensors only; nothing here forces a host sync (XLA)."""
    local_tokens = sum((b["targets"] != -100).sum() for b in batches)
    global_tokens = parallel.all_reduce(local_tokens.clone(), grid.dp_group).clamp(min=1)
    scale = grid.dp / global_tokens
    loss_sum = 0.0
    for b in batches:
        logits = model(b["tokens"], b["positions"], b["doc_ids"])
        loss = parallel.loss_sum(logits, b["targets"], grid)
        (loss * scale).backward()
        loss_sum = loss_sum + loss.detach()
    if getattr(optimizer, "zero1", False):
        grad_norm = optimizer.reduce_scatter_and_clip(cfg.optim.grad_clip)
    else:
        parallel.reduce_gradients(model, grid)
        grad_norm = parallel.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip, grid)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = parallel.all_reduce(loss_sum, grid.dp_group) / global_tokens
    return {"loss": loss, "grad_norm": grad_norm, "tokens": global_tokens}


@torch.no_grad()
def evaluate(model, loader, n_windows: int, grid: parallel.Grid) -> torch.Tensor:
    """Mean token loss over a fixed number of held-out windows (the same ones every time)."""
    model.eval()
    total, count = 0.0, 0
    for _ in range(n_windows):
        b = next(loader)
        total = total + parallel.loss_sum(model(b["tokens"], b["positions"], b["doc_ids"]), b["targets"], grid)
        count = count + (b["targets"] != -100).sum()
    model.train()
    total = parallel.all_reduce(total, grid.dp_group)
    return total / parallel.all_reduce(count, grid.dp_group).clamp(min=1)


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


# ----------------------------------------------------------------------------- the run

def main(argv: list[str]) -> None:
    cfg = configs.from_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    configs.validate(cfg, world)                       # every layout error, before any work
    device = pick_device(cfg.device)
    grid = parallel.init_distributed(cfg)
    accum = configs.grad_accum_steps(cfg, grid.dp)
    log = print if grid.is_main else (lambda *a, **k: None)
    log(f"nanotrn: preset {cfg.preset or '-'}, device {device}, world {grid.world} = "
        f"tp {grid.tp} x pp {grid.pp} x dp {grid.dp}, {accum} microbatches of {cfg.data.micro_batch}")

    # Data: the tokenizer is trained on the corpus at first use and cached (rank 0 first).
    torch.manual_seed(cfg.seed)
    if grid.is_main:
        tok = data.build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
    parallel.barrier(grid)
    if not grid.is_main:
        tok = data.build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
    train_loader = data.PackedLoader(cfg.data, tok, grid.dp_rank, grid.dp, split="train")
    val_loader = data.PackedLoader(cfg.data, tok, grid.dp_rank, grid.dp, split="val") if cfg.log.eval_interval else None

    # Model and optimizer. Initialization depends only on the seed, never on the layout.
    model = parallel.build_model(cfg, grid, device)
    model.to(optim.param_dtype(cfg.optim.precision))
    optimizer = optim.build_optimizer(model, cfg, grid)
    n_params = llama.num_params(cfg.model)
    flops_tok = llama.flops_per_token(cfg.model, cfg.data.seq_len)
    log(f"model: {n_params / 1e6:.2f}M parameters, {flops_tok / 1e6:.1f} MFLOP per token, "
        f"precision {cfg.optim.precision}, checkpointing {cfg.model.checkpointing}")

    step, tokens_seen = 0, 0
    t_last, tokens_last = time.perf_counter(), 0
    while step < cfg.optim.max_steps:
        lr = optim.lr_at(step, cfg.optim)
        optimizer.set_lr(lr)
        t_data = time.perf_counter()
        batches = [to_device(next(train_loader), device) for _ in range(accum)]
        data_wait = time.perf_counter() - t_data
        out = train_step(model, optimizer, batches, grid, cfg)
        sync(device)
        step += 1
        tokens_seen += cfg.data.global_batch * cfg.data.seq_len
        if step % cfg.log.interval == 0 or step == cfg.optim.max_steps:
            loss, gnorm = out["loss"].item(), out["grad_norm"].item()   # host read only at log steps
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                raise SystemExit(f"step {step}: non-finite loss {loss} / grad norm {gnorm}; stopping")
            dt = time.perf_counter() - t_last
            tok_s = (tokens_seen - tokens_last) / dt
            mfu = tok_s * flops_tok / (grid.world * 1e12)   # placeholder peak: replaced by monitor
            log(f"step {step:6d} | loss {loss:.4f} | lr {lr:.2e} | grad norm {gnorm:.3f} | "
                f"{tok_s:,.0f} tok/s | data wait {data_wait * 1e3:.0f} ms")
            t_last, tokens_last = time.perf_counter(), tokens_seen
        if val_loader is not None and cfg.log.eval_interval and step % cfg.log.eval_interval == 0:
            vl = evaluate(model, val_loader, cfg.log.eval_windows, grid).item()
            log(f"step {step:6d} | val loss {vl:.4f} | val ppl {math.exp(min(vl, 20)):.2f}")

    # The end: the full model on rank 0, exported in Hugging Face format, and a short sample.
    full = parallel.gather_full_state_dict(model, grid)
    if grid.is_main:
        final = llama.Llama(cfg.model)
        final.load_state_dict({k: v.float() for k, v in full.items()})
        out_dir = os.path.join(cfg.out_dir, "hf")
        llama.save_hf(final, out_dir)
        log(f"saved the final model to {out_dir} (Hugging Face format)")
        prompt = torch.tensor([tok.encode("def ")], dtype=torch.long)
        sample = final.generate(prompt, cfg.log.sample_tokens)[0].tolist()
        log("sample:\n" + tok.decode(sample))
    train_loader.close()
    if val_loader is not None:
        val_loader.close()
    parallel.destroy(grid)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except configs.ConfigError as e:
        sys.exit(f"config error: {e}")
