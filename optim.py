"""AdamW written out, four precision modes (with software stochastic rounding), the cosine
learning-rate schedule, and ZeRO-1 (optimizer states sharded over the data-parallel group).

Precision modes (`--optim.precision`), bytes of optimizer state per parameter in brackets:

    fp32     params, grads, moments fp32                                   [8]
    mixed    bf16 params and grads for compute; the optimizer keeps an fp32 master copy and
             fp32 moments, and copies the master back into the bf16 params (round to nearest)  [12];
             the gradients accumulate over microbatches and are reduced in fp32 (see below)
    bf16     params, grads and moments bf16, every write rounded to nearest [4]
    bf16_sr  as bf16, but every write of an updated value rounds stochastically [4]

Why stochastic rounding (SR) matters (the blog: plain BF16 diverged, BF16 + SR converged like mixed
precision with more throughput and less memory): bf16 keeps 8 significant bits, so a weight of 1.0
can only move in steps of 2^-7. An Adam update of lr=3e-4 is far below half of that step, so round
to nearest throws it away every time and the weight never moves. SR rounds up with probability
(distance to the lower neighbour / gap), so the expected value of the rounded weight is exactly the
fp32 value: small updates accumulate on average, with noise instead of bias.

In every mode the update itself is computed in fp32; the modes differ only in what is stored and how
it is rounded when written back.

The call sequence train.py uses:

    model.to(param_dtype(cfg.optim.precision))
    opt = build_optimizer(model, cfg, grid)
    opt.set_lr(lr_at(step, cfg.optim))
    # without ZeRO-1: DP all-reduce and clipping in parallel.py, then opt.step(); opt.zero_grad()
    # with ZeRO-1:    parallel.reduce_tp_replicated_gradients(model, grid)   # SP norms, KV copies
    #                 norm = opt.reduce_scatter_and_clip(cfg.optim.grad_clip); opt.step(); opt.zero_grad()
"""
from __future__ import annotations

import bisect
import hashlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from configs import Config, ConfigError, OptimConfig
import parallel
from parallel import Grid
import sharding

PRECISIONS = ("fp32", "mixed", "bf16", "bf16_sr")
BUCKET_BYTES = 130 * 2**20      # ZeRO-1's collective bucket cap (NxD's; --parallel.zero1_bucket_mb)


def param_dtype(precision: str) -> torch.dtype:
    """The dtype of the model's parameters (what forward and backward compute in)."""
    _check_precision(precision)
    return torch.float32 if precision == "fp32" else torch.bfloat16


def state_dtype(precision: str) -> torch.dtype:
    """The dtype of the Adam moments (and of the master copy in mixed precision)."""
    _check_precision(precision)
    return torch.float32 if precision in ("fp32", "mixed") else torch.bfloat16


def _check_precision(precision: str):
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")


# ----------------------------------------------------------------------------- schedule

def lr_at(step: int, o: OptimConfig) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup to o.lr over warmup_steps,
    hold o.lr for constant_steps (the blog's "constant step"), cosine from o.lr to o.min_lr over
    decay_steps, then o.min_lr for the rest of training."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps      # step 0 already trains (lr/warmup, not 0)
    step -= o.warmup_steps + o.constant_steps
    if step < 0:
        return o.lr
    if step >= o.decay_steps:
        return o.min_lr
    progress = step / o.decay_steps                      # 0 -> 1 over the decay phase
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (o.lr - o.min_lr)


# ----------------------------------------------------------------------------- stochastic rounding

def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16, rounding to the upper or lower bf16 neighbour at random, with probability
    proportional to closeness, so that E[result] == x.

    bf16 is the top 16 bits of an fp32. Adding a uniform random integer in [0, 2^16) to the fp32 bit
    pattern carries into bit 16 with probability (low 16 bits) / 2^16, i.e. exactly the fraction of
    the way x lies from its lower neighbour (lower in magnitude: floats are sign-magnitude, so this
    is symmetric for negative numbers). Truncating the low 16 bits then gives the bf16 value.
    """
    x = x.float()
    bits = sr_noise(x.numel(), x.device, generator).view(x.shape)
    bits += x.view(torch.int32)                    # in place: one temporary for the whole rounding
    bits &= -65536                                 # 0xFFFF0000: keep sign, exponent, 7 mantissa bits
    # NaN stays NaN: a quiet NaN has the top mantissa bit set, which the truncation keeps.
    return bits.view(torch.float32).to(torch.bfloat16)   # exact: the low 16 bits are already zero


def sr_noise(n: int, device, generator: torch.Generator | None) -> torch.Tensor:
    """n uniform integers in [0, 2^16), int32: torch.randint(0, 2^16, (n,)). On CPU the same numbers
    from the same draws another way (tests/test_optim.py): randint's kernel reduces each 32-bit
    draw modulo the range, a division by a value known only at run time; random_() reduces modulo
    2^31, a constant the compiler turns into a mask, and the low 16 bits of either are the draw's.
    The draws stay serial (one Mersenne Twister per generator): the floor of software SR on CPU."""
    if torch.device(device).type != "cpu":
        return torch.randint(0, 1 << 16, (n,), dtype=torch.int32, device=device, generator=generator)
    bits = torch.empty(n, dtype=torch.int32).random_(generator=generator)
    return bits.bitwise_and_(0xFFFF)


def stochastic_round_(dsts: list, values: list, generator: torch.Generator) -> None:
    """dst.copy_(stochastic_round(value, generator)) for each pair in turn, bit for bit, with one
    draw for all of them (the draws are consumed in the same order) and no bf16 temporary: the
    rounded fp32 pattern, its low 16 bits zero, converts to bf16 exactly inside copy_. One draw
    equals the tensors' draws in turn only for CPU's serial Mersenne Twister; CUDA's and XLA's
    generators advance per call, so there each tensor keeps its own draw, as stochastic_round's."""
    if values[0].device.type != "cpu":
        for dst, value in zip(dsts, values):
            dst.copy_(stochastic_round(value, generator))
        return
    bits = sr_noise(sum(v.numel() for v in values), values[0].device, generator)
    for dst, value, b in zip(dsts, values, bits.split([v.numel() for v in values])):
        b += value.reshape(-1).view(torch.int32)
        b &= -65536
        dst.copy_(b.view(torch.float32).view(dst.shape))


def _write(dst: torch.Tensor, value: torch.Tensor, generator: torch.Generator | None):
    """Store an fp32 result into dst: nothing to do when it was updated in place, stochastic
    rounding when a generator is given and dst is bf16, otherwise round to nearest (copy_)."""
    if dst is value:
        return
    if generator is not None and dst.dtype == torch.bfloat16:
        dst.copy_(stochastic_round(value, generator))
    else:
        dst.copy_(value)


# ----------------------------------------------------------------------------- fp32 gradient accumulation

def accumulate_grads_in_fp32(params) -> list:
    """NxD's `use_fp32_grad_acc` (its default with ZeRO-1; HLAT 70B set USE_GRAD_ACC_HOOK=1):
    after autograd has added a microbatch's bf16 gradient into p.grad, add it into an fp32 buffer
    p.main_grad and free p.grad (torch_xla's ZeroRedundancyOptimizer._make_param_hook, which NxD
    turns on with use_grad_acc_hook=True and higher_cc_precision=True: trainer/trainer.py). The
    DP reduction, clipping and update then read main_grad (parallel.grad_of), in fp32.
    Why: a bf16 running sum keeps 8 significant bits, so over the 64 microbatches of the 70B preset
    each addition rounds the sum again and the late microbatches' small contributions are partly
    lost (tests/test_optim.py measures it). Costs 4 bytes per parameter instead of 2."""
    def hook(p):
        if p.grad is None:       # another optimizer's hook on this parameter already took it
            return
        g = p.grad.float()
        if getattr(p, "main_grad", None) is None:
            p.main_grad = g                  # the first microbatch: a new fp32 tensor already
        else:
            p.main_grad.add_(g)
        p.grad = None
    return [p.register_post_accumulate_grad_hook(hook) for p in params]


# ----------------------------------------------------------------------------- AdamW

@dataclass
class _Slot:
    """One run of elements the optimizer updates: a parameter, or a piece of one. Pieces exist
    where elements differ in how they are shared over TP (a replicated KV head inside qkv_proj)
    and, under ZeRO-1, where the rank's shard starts or ends inside a parameter."""
    name: str
    param: torch.nn.Parameter
    value: torch.Tensor               # a flat view into the param's data: updated in place
    exp_avg: torch.Tensor             # flat views into the moment buffers
    exp_avg_sq: torch.Tensor
    master: torch.Tensor | None       # flat view into the fp32 master copy ("mixed"), else None
    group: dict                       # the param group: lr and weight_decay
    sr_key: str                       # names this run's stochastic-rounding stream
    norm_weight: float                # how much its squared grad counts in the global norm
    lo: int                           # where its gradient lies: in p.grad.view(-1), or (ZeRO-1)
    hi: int                           #   in this rank's flat gradient shard


class AdamW:
    """AdamW (Loshchilov & Hutter) with decoupled weight decay, step by step (see `_update`), in one
    of four precision modes. Matches torch.optim.AdamW in fp32.

    named_params: model.named_parameters() (names key the state_dict and the SR streams).
      "mixed" copies its fp32 master from these params here: load pretrained weights before
      building the optimizer (a resume restores the master from the optimizer state instead).
    software_sr: round bf16_sr writes stochastically in software. Pass False on Trainium: there
      bf16_sr means bf16 params with the hardware's stochastic rounding, switched on for every
      fp32 -> bf16 conversion by NEURON_RT_STOCHASTIC_ROUNDING_EN=1 in the launch environment, and
      the plain copy_ below is what the hardware rounds (torch-xla has no seeded randint path worth
      paying for in the graph). build_optimizer turns it off for XLA params.
    """
    zero1 = False

    def __init__(self, named_params, cfg: OptimConfig, grid: Grid | None = None, seed: int = 0,
                 software_sr: bool = True):
        _check_precision(cfg.precision)
        self.cfg, self.grid = cfg, grid or Grid()
        self.precision = cfg.precision
        named = [(n, p) for n, p in named_params if p.requires_grad]
        want = param_dtype(cfg.precision)
        for n, p in named:
            if p.dtype != want:
                raise ValueError(f"precision {cfg.precision!r} trains {want} parameters but {n} is "
                                 f"{p.dtype}; call model.to(optim.param_dtype({cfg.precision!r})) "
                                 f"before building the optimizer")
        # Weight decay on all parameters is the blog's setting; decay_norms=False exempts the 1-D
        # parameters (the RMSNorm weights: decaying them pulls the norm gain towards 0).
        decayed = [(n, p) for n, p in named if cfg.decay_norms or p.ndim >= 2]
        exempt = [(n, p) for n, p in named if not (cfg.decay_norms or p.ndim >= 2)]
        self.param_groups = [{"params": [p for _, p in g], "lr": cfg.lr, "weight_decay": wd}
                             for g, wd in ((decayed, cfg.weight_decay), (exempt, 0.0)) if g]
        self._group_of = {id(p): grp for grp in self.param_groups for p in grp["params"]}
        self.named = named
        self.step_count = 0               # optimizer steps taken (Adam's t, before this step)
        self.sr_seed = seed
        self.use_sr = cfg.precision == "bf16_sr" and software_sr
        self._gen = None                  # created on first use, on the params' device
        self.fp32_grads = cfg.precision == "mixed" and cfg.fp32_grad_acc
        self._grad_hooks = accumulate_grads_in_fp32(p for _, p in named) if self.fp32_grads else []
        self.slots = self._make_slots()

    # --------------------------------------------------------------- state layout
    def _sr_key(self, name: str, sharing: str, offset: int, p=None) -> str:
        # Each run gets its own random stream, a function of (seed, step, this key) only, so DP
        # replicas round identically and stay identical, as do the TP copies of a norm weight or
        # of a KV head; TP shards and pipeline stages draw independent noise. The stream state is
        # therefore (seed, step), and the state_dict saves both.
        # The last stage's copy of a tied embedding rounds as the embedding on stage 0 does.
        if getattr(p, "tied_copy", False):
            return f"embed.weight|{sharing}|pp0|{offset}"
        return f"{name}|{sharing}|pp{self.grid.pp_rank}|{offset}"

    def _make_slots(self, fresh: bool = True) -> list[_Slot]:
        """The slots, as views into the state; fresh: create the state first (zeros, the master)."""
        sdt = state_dtype(self.precision)
        if fresh:
            self.state = {}
        slots = []
        for n, p in self.named:
            if fresh:
                st = {"exp_avg": torch.zeros_like(p, dtype=sdt), "exp_avg_sq": torch.zeros_like(p, dtype=sdt)}
                if self.precision == "mixed":
                    st["master"] = p.detach().float().clone()
                self.state[n] = st
            st = self.state[n]
            flat = {k: t.view(-1) for k, t in st.items()}
            for a, b, sharing, weight in sharding.tp_pieces(p, self.grid.tp_rank):
                master = flat["master"][a:b] if "master" in flat else None
                slots.append(_Slot(n, p, p.data.view(-1)[a:b], flat["exp_avg"][a:b], flat["exp_avg_sq"][a:b],
                                   master, self._group_of[id(p)], self._sr_key(n, sharing, a, p), weight, a, b))
        return slots

    def _generator_for(self, s: _Slot) -> torch.Generator | None:
        if not self.use_sr:
            return None
        if self._gen is None:
            self._gen = torch.Generator(device=s.value.device)
        digest = hashlib.blake2b(f"{self.sr_seed}|{self.step_count}|{s.sr_key}".encode(), digest_size=8).digest()
        return self._gen.manual_seed(int.from_bytes(digest, "little") >> 1)

    # --------------------------------------------------------------- the update
    def _step_scalars(self) -> dict[int, torch.Tensor]:
        """This step's scalars of each param group, [1 - lr * wd, -lr / bias1, sqrt(bias2)], sent to
        the device in one tensor: id(group) -> its row. As Python floats they would enter the XLA
        graph as constants whenever they hit a special value (sqrt(1 - 0.95^t) rounds to 1.0 in fp32
        from t ~ 326), and each such step would compile a new graph (minutes of neuronx-cc on trn1)."""
        c, t = self.cfg, self.step_count
        bias1, bias2 = 1.0 - c.beta1 ** t, 1.0 - c.beta2 ** t      # both moments start at 0
        rows = [[1.0 - g["lr"] * g["weight_decay"], -g["lr"] / bias1, math.sqrt(bias2)] for g in self.param_groups]
        table = torch.tensor(rows, dtype=torch.float32, device=self.named[0][1].device if self.named else None)
        return {id(g): row for g, row in zip(self.param_groups, table)}

    @torch.no_grad()
    def _update(self, s: _Slot, grad: torch.Tensor, k: torch.Tensor):
        """One slot's AdamW step; k: its group's row of _step_scalars. The reference, read step by
        step: training runs the same arithmetic over many slots at once (_update_all)."""
        c = self.cfg
        # Everything below is fp32 arithmetic. `.float()` returns the tensor itself when it is
        # already fp32, so fp32 state (and the mixed master) is updated in place; bf16 state is
        # upcast into temporaries that `_write` rounds back at the end.
        g = grad.float()
        m, v = s.exp_avg.float(), s.exp_avg_sq.float()
        w = s.master if s.master is not None else s.value.float()
        # 1. decoupled weight decay: shrink the weight directly, outside the adaptive scaling
        #    (AdamW's fix of Adam + L2, whose decay the 1/sqrt(v) factor would rescale per weight).
        w.mul_(k[0])                                  # 1 - lr * wd
        # 2. moments: running means of the gradient and of its square.
        m.lerp_(g, 1.0 - c.beta1)
        v.mul_(c.beta2).addcmul_(g, g, value=1.0 - c.beta2)
        # 3. bias correction, then the step lr * m_hat / (sqrt(v_hat) + eps), rounded as torch.optim's
        #    w.addcdiv_(m, denom, value=-lr / bias1), which computes (value * m) / denom.
        denom = (v.sqrt() / k[2]).add_(c.eps)
        w.addcdiv_(m * k[1], denom)
        # 4. write back: moments and weight, each rounded as the precision mode says.
        gen = self._generator_for(s)
        _write(s.exp_avg, m, gen)
        _write(s.exp_avg_sq, v, gen)
        _write(s.value, w, gen)

    # Elements of fp32 temporaries one foreach batch may hold: its upcast gradients, moments, weights
    # and two more (about 24 bytes per element in bf16 modes, 400 MB at 2^24), as the slot-by-slot
    # reference held them for one parameter at a time.
    FOREACH_ELEMENTS = 1 << 24

    @torch.no_grad()
    def _update_all(self, runs: list, k: dict):
        """`_update` for many slots at once: runs is [(slot, its gradient)], k the _step_scalars.
        The same fp32 arithmetic, as torch._foreach_* kernels over lists of the slots of one param
        group (one kernel per operation on CUDA, instead of one per operation and parameter), in
        batches of at most FOREACH_ELEMENTS; then each slot's write-back, stochastic rounding with
        its own stream, as in _update. On CPU the foreach ops run the per-tensor kernels: the result
        is bit-equal to _update's (tests/test_optim.py), on every precision."""
        c = self.cfg
        batches, size = {}, {}
        for s, grad in runs:
            key = id(s.group)
            if key not in batches or size[key] + s.value.numel() > self.FOREACH_ELEMENTS:
                batches.setdefault(key, []).append([])
                size[key] = 0
            batches[key][-1].append((s, grad))
            size[key] += s.value.numel()
        for key, group_batches in batches.items():
            kk = k[key]
            for batch in group_batches:
                slots = [s for s, _ in batch]
                g = [grad.float() for _, grad in batch]
                m = [s.exp_avg.float() for s in slots]
                v = [s.exp_avg_sq.float() for s in slots]
                w = [s.master if s.master is not None else s.value.float() for s in slots]
                torch._foreach_mul_(w, kk[0])                          # 1. decoupled weight decay
                torch._foreach_lerp_(m, g, 1.0 - c.beta1)              # 2. moments
                torch._foreach_mul_(v, c.beta2)
                torch._foreach_addcmul_(v, g, g, value=1.0 - c.beta2)
                del g
                denom = torch._foreach_sqrt(v)                         # 3. the step
                torch._foreach_div_(denom, kk[2])
                torch._foreach_add_(denom, c.eps)
                torch._foreach_addcdiv_(w, torch._foreach_mul(m, kk[1]), denom)
                del denom
                for s, mi, vi, wi in zip(slots, m, v, w):             # 4. write back
                    gen = self._generator_for(s)
                    if gen is not None and s.value.dtype == torch.bfloat16 and s.exp_avg.dtype == torch.bfloat16:
                        stochastic_round_([s.exp_avg, s.exp_avg_sq, s.value], [mi, vi, wi], gen)
                        continue
                    _write(s.exp_avg, mi, gen)
                    _write(s.exp_avg_sq, vi, gen)
                    _write(s.value, wi, gen)

    @torch.no_grad()
    def step(self, apply: torch.Tensor | None = None):
        """One AdamW step on the (already DP-reduced and clipped) gradients; params without a
        gradient are skipped, as torch.optim does. apply: see _keep."""
        keep = self._keep(apply)
        self.step_count += 1
        runs = []
        for s in self.slots:
            grad = parallel.grad_of(s.param)
            if grad is not None:
                runs.append((s, grad.view(-1)[s.lo:s.hi]))
        self._update_all(runs, self._step_scalars())
        self._select(apply, keep)

    def _keep(self, apply: torch.Tensor | None) -> list:
        """apply, a boolean tensor on the device (--log.on_nonfinite=skip on XLA: is the step's loss
        and gradient norm finite?), decides on the device whether the update lands: the weights
        and states before it are kept and a select puts them back where apply is False, so the host
        never waits for the flag (it reads it with the logged metrics). On XLA the kept copies are
        the graph's input buffers: no extra memory. The step count (Adam's t) advances either way:
        a skipped step shifts the bias correction by one step, which fp32 no longer resolves after
        t ~ 330 (1 - 0.95^t rounds to 1)."""
        if apply is None:
            return []
        return [(t, t.clone()) for t in [p.data for _, p in self.named] + list(self._state_tensors().values())]

    @staticmethod
    def _select(apply: torch.Tensor | None, keep: list) -> None:
        for t, before in keep:
            t.copy_(torch.where(apply, t, before))

    def zero_grad(self, set_to_none: bool = True):
        for _, p in self.named:
            if set_to_none:
                p.grad = None
                p.main_grad = None
            else:
                for g in (p.grad, getattr(p, "main_grad", None)):
                    if g is not None:
                        g.zero_()

    def set_lr(self, lr: float):
        for g in self.param_groups:
            g["lr"] = lr

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (moments and master copy; not params/grads)."""
        return sum(t.numel() * t.element_size() for t in self._state_tensors().values())

    # --------------------------------------------------------------- checkpointing
    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"{n}.{k}": t for n, st in self.state.items() for k, t in st.items()}

    def _layout(self) -> dict:
        return {"kind": "full"}

    def state_dict(self) -> dict:
        """Moments, master weights, step and the SR stream state (seed; the stream of each tensor
        is a function of seed and step). Tensors are returned by reference, as torch.optim does."""
        return {"precision": self.precision, "step": self.step_count, "sr_seed": self.sr_seed,
                "lr": [g["lr"] for g in self.param_groups], "layout": self._layout(),
                "state": self._state_tensors()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        """sd: a state_dict of this very layout, or a per-parameter one ("kind": "full": every
        "<param name>.<moment>" this rank holds, shaped like its parameter here) from which any
        layout takes its part; reshard.py rebuilds one from any saved layout, reading a tensor
        only when it is asked for (sd["state"] may be a lazy mapping)."""
        if sd["precision"] != self.precision:
            raise ConfigError(f"optimizer state was saved with precision {sd['precision']!r}, this run "
                              f"uses {self.precision!r}; resume with --optim.precision={sd['precision']}")
        full = sd["layout"]["kind"] == "full"
        index = lambda layout: {k: v for k, v in layout.items() if k != "params"}
        if not full and index(sd["layout"]) != index(self._layout()):
            raise ConfigError(f"optimizer state layout {sd['layout']} does not match this run's "
                             f"{self._layout()}; load ZeRO-1 shards at another layout through "
                             f"reshard.py, which reshards them")
        # Filled on the host, then each state tensor goes to the device whole, replacing the old one
        # (and the slots are views into the new ones). Copied into views of the device tensors, the
        # loaded state reached the next step's graph as slices of them: a graph of its own, one
        # more compile (minutes of neuronx-cc) after every resume (issue 26).
        now = self._state_tensors()
        host = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in now.items()}
        wanted = self._wanted(host) if full else AdamW._wanted(self, host)
        missing = [k for k in wanted if k not in sd["state"]]
        if missing:
            raise ConfigError(f"optimizer state does not match the model: missing {missing[:3]}")
        for k, (dst, a, b, n) in wanted.items():
            src = sd["state"][k]
            if src.numel() != n:
                raise ConfigError(f"optimizer state {k} has shape {tuple(src.shape)}, expected {n} elements")
            dst.copy_(src.reshape(-1)[a:b])
        device = next(iter(now.values())).device if now else torch.device("cpu")
        self._set_state_tensors(dict(zip(host, parallel.to_device(list(host.values()), device))))
        self.slots = self._make_slots(fresh=False)
        self.step_count, self.sr_seed = sd["step"], sd["sr_seed"]
        for g, lr in zip(self.param_groups, sd["lr"]):
            g["lr"] = lr

    def _wanted(self, tensors: dict) -> dict:
        """What a per-parameter state fills in `tensors` (shaped as _state_tensors()): "<param>.<moment>"
        -> (flat destination, start and end of its part in the parameter's flat elements, the
        parameter's numel)."""
        return {k: (t.view(-1), 0, t.numel(), t.numel()) for k, t in tensors.items()}

    def _set_state_tensors(self, tensors: dict) -> None:
        for key, t in tensors.items():
            n, k = key.rsplit(".", 1)
            self.state[n][k] = t


# ----------------------------------------------------------------------------- ZeRO-1

class Zero1AdamW(AdamW):
    """ZeRO stage 1 (HLAT 70B, NxD's NeuronZero1Optimizer): each DP rank keeps the optimizer state
    (moments, and the fp32 master in "mixed") of only 1/DP of the parameters.

    All local params are laid end to end in one flat index space of N elements, padded to a
    multiple of DP; DP rank r owns [r*S, (r+1)*S) with S = ceil(N / DP). Per step:
      1. reduce_scatter_and_clip: grads scaled by 1/DP (divide by the DP degree, not the world size:
         HLAT diverged with xm's 1/world scaling), reduce-scattered over the DP group so each rank
         receives the summed grads of its shard only; global norm over TP, PP and DP; clip.
      2. step: AdamW on the shard, then all-gather the updated params over the DP group.
    It replaces the DP all-reduce: the same bytes move (reduce-scatter + all-gather == all-reduce),
    but optimizer memory drops by DP. The TP sums of parallel.reduce_tp_replicated_gradients must
    still run before step 1. A param without a gradient counts as a zero gradient here (it is
    still decayed), where the unsharded AdamW skips it.

    Buckets (issue 26). Both collectives run in buckets of at most bucket_bytes (the reduce-scatter's
    input, the all-gather's output), never over one flat copy of every gradient (1.1 GB in fp32
    for the 70B preset's local model, 2 GB for llama3_8b): NxD caps ZeRO-1's buckets at 130 MB
    (neuronx_distributed/trainer/trainer.py, initialize_optimizer_from_class: "Bucket cap >140MB
    causes NaN at step 3 (known issue)"; ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB, passed to
    torch_xla's ZeroRedundancyOptimizer as bucket_cap_mb_reduce_scatter and, divided by DP for its
    input, bucket_cap_mb_all_gather; that one coalesces whole parameters per bucket, each sharded
    on its own). Here the shard layout stays the one above (so checkpoints and reshard.py do not
    change): view the flat space as a [DP, S] grid, rank r's shard is row r, and bucket j is the
    column band [j*b, (j+1)*b) of every row, b = bucket_bytes / (DP * element size). A
    reduce-scatter of that band gives rank r exactly columns j*b.. of its own row; the all-gather
    of each rank's band rebuilds it. The transient memory is one bucket, not the whole model.
    Cost: a band is DP runs of b elements, cut where parameters end, so a bucket is gathered from
    about DP + (parameters in it) slices: per rank the bytes moved stay those of its local model
    whatever DP, the slices grow with DP. At 4096 ranks (llama2_7b, TP 8, DP 512, fp32 gradients):
    about 27 buckets of 130 MB, 512 runs of ~250 KB each, ~14k slices traced once per graph.
    """
    zero1 = True

    def __init__(self, named_params, cfg: OptimConfig, grid: Grid, seed: int = 0, software_sr: bool = True,
                 bucket_bytes: int = BUCKET_BYTES):
        self._grad_shard = None
        super().__init__(named_params, cfg, grid, seed, software_sr)
        self.buckets = self._plan_buckets(bucket_bytes)

    def _make_slots(self, fresh: bool = True) -> list[_Slot]:
        dp, r = self.grid.dp, self.grid.dp_rank
        for n, p in self.named:
            if not p.is_contiguous():
                raise ValueError(f"ZeRO-1 needs contiguous parameters; {n} is not")
        self.offsets, off = [], 0
        for _, p in self.named:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.shard = -(-off // dp)                       # S = ceil(N / DP)
        lo, hi = r * self.shard, (r + 1) * self.shard
        device = self.named[0][1].device
        sdt = state_dtype(self.precision)
        if fresh:
            self.flat = {"exp_avg": torch.zeros(self.shard, dtype=sdt, device=device),
                         "exp_avg_sq": torch.zeros(self.shard, dtype=sdt, device=device)}
            if self.precision == "mixed":
                self.flat["master"] = torch.zeros(self.shard, dtype=torch.float32, device=device)
        slots = []
        for (n, p), start in zip(self.named, self.offsets):
            for a, b, sharing, weight in sharding.tp_pieces(p, self.grid.tp_rank):
                a, b = max(start + a, lo), min(start + b, hi)      # the part of the run on this shard
                if a >= b:
                    continue                                       # it lies on other ranks' shards
                value = p.data.view(-1)[a - start:b - start]
                master = self.flat.get("master")
                if master is not None:
                    master = master[a - lo:b - lo]
                    if fresh:
                        master.copy_(value)
                slots.append(_Slot(n, p, value, self.flat["exp_avg"][a - lo:b - lo],
                                   self.flat["exp_avg_sq"][a - lo:b - lo], master, self._group_of[id(p)],
                                   self._sr_key(n, sharing, a - start, p), weight, a - lo, b - lo))
        return slots

    def _plan_buckets(self, bucket_bytes: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """The column bands of the [DP, S] grid (see the class): [(c0, c1, runs)], runs in the order
        the bucket holds them, row by row: (param index, start, end) in that param's flat elements,
        or (-1, 0, n): n padding zeros past the last parameter. bucket_bytes 0: one bucket."""
        dp, S = self.grid.dp, self.shard
        itemsize = 4 if self.fp32_grads else self.named[0][1].element_size()   # the larger of the two
        cols = S if bucket_bytes <= 0 else max(1, min(S, bucket_bytes // (dp * itemsize)))
        ends = [start + p.numel() for (_, p), start in zip(self.named, self.offsets)]
        plan = []
        for c0 in range(0, S, cols):
            c1, runs = min(c0 + cols, S), []
            for r in range(dp):
                lo, hi = r * S + c0, r * S + c1
                i = bisect.bisect_right(ends, lo)                 # the first param ending after lo
                while lo < hi:
                    if i >= len(ends):
                        runs.append((-1, 0, hi - lo))
                        break
                    end = min(hi, ends[i])
                    runs.append((i, lo - self.offsets[i], end - self.offsets[i]))
                    lo, i = end, i + 1
            plan.append((c0, c1, runs))
        return plan

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.flat)

    def _layout(self) -> dict:
        # The flat index (names and shapes in order) lets reshard.py cut the shards back into
        # per-parameter tensors, so that they resume at any layout.
        return {"kind": "zero1", "dp": self.grid.dp, "dp_rank": self.grid.dp_rank, "numel": self.numel,
                "params": [[n, list(p.shape)] for n, p in self.named]}

    def _set_state_tensors(self, tensors: dict) -> None:
        self.flat = dict(tensors)

    def _wanted(self, tensors: dict) -> dict:
        lo, out = self.grid.dp_rank * self.shard, {}
        for (n, p), start in zip(self.named, self.offsets):
            a, b = max(start, lo), min(start + p.numel(), lo + self.shard)
            if a < b:                        # the part of this parameter that lies on this shard
                out.update({f"{n}.{k}": (t[a - lo:b - lo], a - start, b - start, p.numel()) for k, t in tensors.items()})
        return out

    @torch.no_grad()
    def reduce_scatter_and_clip(self, max_norm: float) -> torch.Tensor:
        """Replace the DP all-reduce: sum the grads over the DP group into this rank's shard
        (scaled 1/DP), bucket by bucket, then clip on the true global norm. Returns the norm
        before clipping."""
        g = self.grid
        # fp32 gradient accumulation reduce-scatters in fp32 too (NxD: higher_cc_precision)
        dtype = torch.float32 if self.fp32_grads else self.named[0][1].dtype
        device = self.flat["exp_avg"].device
        grads = [parallel.grad_of(p) for _, p in self.named]
        pieces = []
        for c0, c1, runs in self.buckets:
            bucket = torch.cat([grads[i].view(-1)[a:b].to(dtype) if i >= 0 and grads[i] is not None
                                else torch.zeros(b - a, dtype=dtype, device=device)   # padding, or no grad
                                for i, a, b in runs])
            bucket.mul_(1.0 / g.dp)
            pieces.append(torch.empty(c1 - c0, dtype=dtype, device=device))
            dist.reduce_scatter_tensor(pieces[-1], bucket, group=g.dp_group)
        shard = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        norm = parallel.global_norm([(shard[s.lo:s.hi], s.norm_weight) for s in self.slots], g, over_dp=True)
        if max_norm > 0:
            shard.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(dtype))
        self._grad_shard = shard
        return norm

    @torch.no_grad()
    def step(self, apply: torch.Tensor | None = None):
        if self._grad_shard is None:
            raise RuntimeError("ZeRO-1: call opt.reduce_scatter_and_clip(max_norm) before opt.step(); "
                               "it reduces the gradients into this rank's shard (it replaces the DP all-reduce)")
        keep = self._keep(apply)
        self.step_count += 1
        self._update_all([(s, self._grad_shard[s.lo:s.hi]) for s in self.slots], self._step_scalars())
        self._grad_shard = None
        self._select(apply, keep)        # before the all-gather: a skipped update gathers the old shard
        # Every rank updated only its shard: all-gather the params, bucket by bucket, so each holds
        # the full model again; each param is then written once, from its runs in flat order.
        dtype = self.named[0][1].dtype
        mine = torch.zeros(self.shard, dtype=dtype, device=self.flat["exp_avg"].device)
        for s in self.slots:
            mine[s.lo:s.hi] = s.value
        runs_of = [[] for _ in self.named]
        for c0, c1, runs in self.buckets:
            out = torch.empty((c1 - c0) * self.grid.dp, dtype=dtype, device=mine.device)
            dist.all_gather_into_tensor(out, mine[c0:c1], group=self.grid.dp_group)
            for (i, a, b), piece in zip(runs, out.split([b - a for _, a, b in runs])):
                if i >= 0:
                    runs_of[i].append((a, piece))
        for (n, p), runs in zip(self.named, runs_of):
            runs.sort(key=lambda run: run[0])
            p.data.view(-1).copy_(torch.cat([t for _, t in runs]) if len(runs) > 1 else runs[0][1])


# ----------------------------------------------------------------------------- the guarded update

def guarded_step(optimizer: AdamW, verdict) -> bool | torch.Tensor:
    """optimizer.step() under the non-finite policy's verdict (monitor.Monitor.check_finite): True
    or False decided on the host, or a boolean tensor decided on the device (XLA, skip: no host
    read), which the update applies by a select. Returns whether the step was skipped, of the same
    kind (the monitor reads a tensor with the step's other metrics)."""
    if torch.is_tensor(verdict):
        optimizer.step(apply=verdict)
        return ~verdict
    if verdict:
        optimizer.step()
    return not verdict


# ----------------------------------------------------------------------------- construction

def build_optimizer(model: torch.nn.Module, cfg: Config, grid: Grid | None = None,
                    software_sr: bool | None = None) -> AdamW:
    """AdamW over the model's parameters, sharded with ZeRO-1 when cfg.parallel.zero1 and DP > 1.
    software_sr defaults to on, except for params on an XLA device (Trainium rounds in hardware)."""
    grid = grid or Grid()
    named = list(model.named_parameters())
    if software_sr is None:
        software_sr = all(p.device.type != "xla" for _, p in named)
    if cfg.parallel.zero1 and grid.dp > 1:
        return Zero1AdamW(named, cfg.optim, grid, seed=cfg.seed, software_sr=software_sr,
                          bucket_bytes=int(cfg.parallel.zero1_bucket_mb * 2**20))
    return AdamW(named, cfg.optim, grid, seed=cfg.seed, software_sr=software_sr)
