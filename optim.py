"""AdamW written out, the cosine learning-rate schedule, and ZeRO-1 (optimizer states sharded over the data-parallel
group). --optim.precision (docs/precision.md has the table): fp32; mixed (bf16 params and grads, fp32 master and
moments, grads accumulated in fp32); bf16 and bf16_sr (params and moments bf16, every write rounded to nearest or
stochastically). The update is fp32 arithmetic in every mode. Why SR (the blog: plain bf16 diverged, bf16 + SR converged
like mixed): near 1.0 bf16 moves in steps of 2^-7, far above an update of lr = 3e-4, so round to nearest drops the
update every time; SR rounds up with the probability of the distance: the weight equals the fp32 one in expectation."""
from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from configs import CHOICES, Config, ConfigError, OptimConfig
import hardware
import parallel
from parallel import Grid
import sharding

PRECISIONS = CHOICES["optim.precision"]      # fp32, mixed, bf16, bf16_sr: the table above
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
    """Learning rate of optimizer step `step` (0-based): linear warmup, o.lr held for constant_steps
    (not NxD's constant_steps: a hold at min_lr after the cosine), cosine to o.min_lr over decay_steps, then o.min_lr."""
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

def stochastic_round_(dsts: list, values: list, generator: torch.Generator | None) -> None:
    """dst.copy_(value) rounded fp32 -> bf16 with E[result] == value, for each pair in turn. bf16 is the top 16 bits of
    an fp32: a uniform integer in [0, 2^16) added to the bit pattern carries into bit 16 with probability (low 16 bits)
    / 2^16, the fraction of the way from the lower neighbour in magnitude; truncating the low bits gives the bf16
    (exactly, inside copy_). A NaN is put back whole: its payload's carry could reach the sign (0x7FFFFFFF -> -0.0, a
    diverged weight silently zero) or leave inf's bits. On CPU one draw serves all the pairs (a serial Mersenne
    Twister: one draw equals the draws in turn); CUDA's and XLA's generators advance per call, so each tensor draws."""
    cpu = values[0].device.type == "cpu"
    for pairs in [list(zip(dsts, values))] if cpu else [[pair] for pair in zip(dsts, values)]:
        bits = sr_noise(sum(v.numel() for _, v in pairs), values[0].device, generator)
        for (dst, value), b in zip(pairs, bits.split([v.numel() for _, v in pairs])):
            v = value.float().reshape(-1)
            b += v.view(torch.int32)              # in place: one temporary for all
            b &= -65536                           # 0xFFFF0000: keep sign, exponent, 7 mantissa bits
            dst.copy_(torch.where(v.isnan(), v, b.view(torch.float32)).view(dst.shape))


def sr_noise(n: int, device, generator: torch.Generator | None) -> torch.Tensor:
    """torch.randint(0, 2^16, (n,), int32). On CPU the same numbers from the same draws, faster:
    random_() reduces modulo 2^31 (a mask) where randint divides by a run-time range, and the low
    16 bits of either are the draw's (tests/test_optim.py)."""
    if torch.device(device).type != "cpu":
        return torch.randint(0, 1 << 16, (n,), dtype=torch.int32, device=device, generator=generator)
    bits = torch.empty(n, dtype=torch.int32).random_(generator=generator)
    return bits.bitwise_and_(0xFFFF)


# ----------------------------------------------------------------------------- fp32 gradient accumulation

def accumulate_grads_in_fp32(params) -> list:
    """NxD's use_fp32_grad_acc (HLAT 70B: USE_GRAD_ACC_HOOK=1; torch_xla's ZeroRedundancyOptimizer._make_param_hook):
    each microbatch's bf16 p.grad is added into an fp32 p.main_grad and freed; reduction, clipping and update read
    main_grad (parallel.grad_of). A bf16 running sum over the 70B preset's 64 microbatches loses the late ones' small
    contributions (tests/test_optim.py measures it). Costs 4 bytes per parameter instead of 2."""
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
    """A run of elements the optimizer updates: a parameter, or the piece of one that is shared over
    TP in one way (a replicated KV head inside qkv_proj) or lies in this rank's ZeRO-1 shard."""
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
    """AdamW (Loshchilov & Hutter, decoupled weight decay) in one of four precision modes; equals
    torch.optim.AdamW in fp32. named_params: names key the state_dict and the SR streams. "mixed"
    copies its master from the params here (load pretrained weights first). software_sr=False on
    Trainium: its hardware rounds every fp32 -> bf16 copy_ stochastically (NEURON_RT_STOCHASTIC_ROUNDING_EN=1)."""
    zero1 = False

    def __init__(self, named_params, cfg: OptimConfig, grid: Grid | None = None, seed: int = 0,
                 software_sr: bool = True, masters: dict | None = None):
        self.cfg, self.grid = cfg, grid or Grid()
        self.precision = cfg.precision
        # (name, param) pairs, or parameters alone as torch.optim takes them, named by position (a
        # tensor unpacked as a pair would give its rows for the name and the parameter)
        named = [(f"param{i}", x) if isinstance(x, torch.Tensor) else tuple(x) for i, x in enumerate(named_params)]
        named = [(n, p) for n, p in named if p.requires_grad]
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
        self.slots = self._make_slots(masters=masters)    # "mixed": name -> the fp32 values its master starts from

    # --------------------------------------------------------------- state layout
    def _sr_key(self, name: str, sharing: str, offset: int, p=None) -> str:
        # A run's random stream is a function of (seed, step, this key) only: DP replicas and the TP
        # copies of a norm weight or KV head round identically; TP shards and stages independently.
        # The last stage's copy of a tied embedding rounds as stage 0's does (ZeRO-1: pipeline.sync_tied_embedding).
        if getattr(p, "tied_copy", False):
            return f"embed.weight|{sharing}|pp0|{offset}"
        return f"{name}|{sharing}|pp{self.grid.pp_rank}|{offset}"

    def _make_slots(self, fresh: bool = True, masters: dict | None = None) -> list[_Slot]:
        """The slots, as views into the state; fresh: create the state first (zeros, the master: masters', else p)."""
        sdt = state_dtype(self.precision)
        if fresh:
            self.state = {}
        slots = []
        for n, p in self.named:
            if fresh:
                st = {"exp_avg": torch.zeros_like(p, dtype=sdt), "exp_avg_sq": torch.zeros_like(p, dtype=sdt)}
                if self.precision == "mixed":
                    st["master"] = (masters or {}).get(n, p.detach()).to(p.device, torch.float32, copy=True)
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
        """id(group) -> [1 - lr * wd, -lr / bias1, sqrt(bias2)], one device tensor: as Python floats
        they would enter the XLA graph as constants at special values (sqrt(1 - 0.95^t) rounds to 1
        from t ~ 326), a new graph each time (minutes of neuronx-cc on trn1)."""
        c, t = self.cfg, self.step_count
        bias1, bias2 = 1.0 - c.beta1 ** t, 1.0 - c.beta2 ** t      # both moments start at 0
        rows = [[1.0 - g["lr"] * g["weight_decay"], -g["lr"] / bias1, math.sqrt(bias2)] for g in self.param_groups]
        table = torch.tensor(rows, dtype=torch.float32, device=self.named[0][1].device if self.named else None)
        return {id(g): row for g, row in zip(self.param_groups, table)}

    # Elements one foreach batch may hold as fp32 temporaries (~24 bytes each in bf16 modes: 400 MB).
    FOREACH_ELEMENTS = 1 << 24

    @torch.no_grad()
    def _update_all(self, runs: list, k: dict):
        """The AdamW step of every slot: runs is [(slot, its gradient)], k the _step_scalars. fp32
        arithmetic as torch._foreach_* kernels over one param group's slots (one kernel per operation
        on CUDA), FOREACH_ELEMENTS at a time; bf16 state is upcast into temporaries and rounded back,
        fp32 state (and the mixed master) updated in place. On CPU bit-equal to slot-by-slot (test_optim)."""
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
                torch._foreach_mul_(w, kk[0])                          # 1. decoupled weight decay: 1 - lr wd
                torch._foreach_lerp_(m, g, 1.0 - c.beta1)              # 2. moments
                torch._foreach_mul_(v, c.beta2)
                torch._foreach_addcmul_(v, g, g, value=1.0 - c.beta2)
                del g
                denom = torch._foreach_sqrt(v)                         # 3. the step
                torch._foreach_div_(denom, kk[2])
                torch._foreach_add_(denom, c.eps)
                torch._foreach_addcdiv_(w, torch._foreach_mul(m, kk[1]), denom)   # as torch.optim rounds it
                del denom
                for s, mi, vi, wi in zip(slots, m, v, w):             # 4. write back
                    gen = self._generator_for(s)          # bf16_sr only: every tensor is bf16 there
                    if gen is not None:
                        stochastic_round_([s.exp_avg, s.exp_avg_sq, s.value], [mi, vi, wi], gen)
                        continue
                    for dst, value in ((s.exp_avg, mi), (s.exp_avg_sq, vi), (s.value, wi)):
                        if dst is not value:              # not updated in place: round to nearest
                            dst.copy_(value)

    @torch.no_grad()
    def step(self, apply: torch.Tensor | None = None):
        """One AdamW step on the reduced, clipped gradients (none: skipped, as torch.optim). apply: _keep."""
        keep = self._keep(apply)
        self.step_count += 1
        runs = [(s, g.view(-1)[s.lo:s.hi]) for s in self.slots if (g := parallel.grad_of(s.param)) is not None]
        self._update_all(runs, self._step_scalars())
        self._select(apply, keep)

    def _keep(self, apply: torch.Tensor | None) -> list:
        """apply, a boolean tensor (--log.on_nonfinite=skip on XLA), decides on the device whether the update lands: a
        select restores the kept weights and states where it is False, so the host never waits for the flag (on XLA the
        kept copies are the graph's inputs: no extra memory). Adam's t advances either way (fp32 no longer resolves the
        shift after t ~ 330). The slots' views, which the update writes: a select on their bases too made step 2's
        update another graph on XLA (one more compile of the largest graph, minutes of neuronx-cc)."""
        if apply is None:
            return []
        views = [t for s in self.slots for t in (s.value, s.exp_avg, s.exp_avg_sq, s.master) if t is not None]
        return [(t, t.clone()) for t in views]

    @staticmethod
    def _select(apply: torch.Tensor | None, keep: list) -> None:
        for t, before in keep:
            t.copy_(torch.where(apply, t, before))

    def zero_grad(self):
        """torch.optim's set_to_none=True, the fp32 accumulators (main_grad) too."""
        for _, p in self.named:
            p.grad = p.main_grad = None

    def set_lr(self, lr: float):
        for g in self.param_groups:
            g["lr"] = lr

    def describe(self) -> str:
        """Added to train.py's model line: what the console says of the optimizer's layout."""
        return ""

    def masters(self) -> dict:
        """id(param) -> its fp32 master (the weight its bf16 rounds; "mixed", else {}) on its device: train.py's export
        gathers it, and xla's collectives take device tensors only. Collective under ZeRO-1 (an all-gather over DP)."""
        return {id(p): self.state[n]["master"] for n, p in self.named if "master" in self.state[n]}

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (moments and master copy; not params/grads)."""
        return sum(t.numel() * t.element_size() for t in self._state_tensors().values())

    # --------------------------------------------------------------- checkpointing
    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return {f"{n}.{k}": t for n, st in self.state.items() for k, t in st.items()}

    def _layout(self) -> dict:
        return {"kind": "full"}

    def state_dict(self) -> dict:
        """Moments, master weights, step and the SR streams' state (seed and step), by reference."""
        return {"precision": self.precision, "step": self.step_count, "sr_seed": self.sr_seed,
                "lr": [g["lr"] for g in self.param_groups], "layout": self._layout(), "state": self._state_tensors()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict):
        """sd: a state_dict of this very layout, or a per-parameter one ("kind": "full", from
        reshard.py; sd["state"] may be a lazy mapping) from which any layout takes its part."""
        if sd["precision"] != self.precision:
            raise ConfigError(f"optimizer state was saved with precision {sd['precision']!r}, this run "
                              f"uses {self.precision!r}; resume with --optim.precision={sd['precision']}")
        full = sd["layout"]["kind"] == "full"
        index = lambda layout: {k: v for k, v in layout.items() if k != "params"}
        if not full and index(sd["layout"]) != index(self._layout()):
            raise ConfigError(f"optimizer state layout {sd['layout']} does not match this run's "
                             f"{self._layout()}; load ZeRO-1 shards at another layout through "
                             f"reshard.py, which reshards them")
        # Filled on the host, then each state tensor goes to the device whole (the slots are views
        # into the new ones): copied into views of device tensors, the loaded state reached the next
        # step's graph as slices, one more compile (minutes of neuronx-cc) per resume (issue 26).
        now = self._state_tensors()
        host = {k: torch.zeros(t.shape, dtype=t.dtype) for k, t in now.items()}
        # per-parameter state: this layout's part of each (_wanted; ZeRO-1: its shard); its own: whole
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
        """"<param>.<moment>" -> (flat destination in `tensors`, start and end of its part in the
        parameter's flat elements, the parameter's numel)."""
        return {k: (t.view(-1), 0, t.numel(), t.numel()) for k, t in tensors.items()}

    def _set_state_tensors(self, tensors: dict) -> None:
        for key, t in tensors.items():
            n, k = key.rsplit(".", 1)
            self.state[n][k] = t


# ----------------------------------------------------------------------------- ZeRO-1

class Zero1AdamW(AdamW):
    """ZeRO stage 1 (HLAT 70B, NxD's NeuronZero1Optimizer): each DP rank keeps the optimizer state of
    1/DP of the parameters. The local params lie end to end in one flat space of N elements; rank r
    owns [r*S, (r+1)*S), S = ceil(N / DP). reduce_scatter_and_clip replaces the DP all-reduce (grads
    x 1/DP, not 1/world: HLAT's divergence; after the TP sums), then clips on the global norm; step
    updates the shard and all-gathers the params (an all-reduce's bytes; state memory / DP). A param
    without a gradient counts as zero here (still decayed), where AdamW skips it.
    Buckets: both collectives move at most bucket_bytes at a time, never a flat copy of every
    gradient (1.1 GB at 70B; NxD caps them at 130 MB, trainer/trainer.py: "Bucket cap >140MB causes NaN
    at step 3"). With the flat space as a [DP, S] grid, bucket j is the column band [j*b, (j+1)*b) of
    every row, so its reduce-scatter gives rank r its own row's columns: checkpoints keep one layout.
    Per rank the bytes are the local model's whatever DP; the slices grow with DP. At 4096 ranks
    (7B, TP 8, DP 512): 13 buckets of ~530 runs, ~7k slices traced once (fp32 gradients: 25, ~13k)."""
    zero1 = True

    def __init__(self, named_params, cfg: OptimConfig, grid: Grid, seed: int = 0, software_sr: bool = True,
                 bucket_bytes: int = BUCKET_BYTES, masters: dict | None = None):
        self._grad_shard = None
        super().__init__(named_params, cfg, grid, seed, software_sr, masters)
        self.buckets = self._plan_buckets(bucket_bytes)

    def _make_slots(self, fresh: bool = True, masters: dict | None = None) -> list[_Slot]:
        dp, r = self.grid.dp, self.grid.dp_rank
        for n, p in self.named:
            if not p.is_contiguous():
                raise ValueError(f"ZeRO-1 needs contiguous parameters; {n} is not")
        sizes = [p.numel() for _, p in self.named]
        self.offsets, self.numel = [0, *itertools.accumulate(sizes)][:-1], sum(sizes)
        self.shard = -(-self.numel // dp)                # S = ceil(N / DP)
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
            source = masters[n].to(p.device).view(-1) if masters and n in masters else p.data.view(-1)
            for a, b, sharing, weight in sharding.tp_pieces(p, self.grid.tp_rank):
                a, b = max(start + a, lo), min(start + b, hi)      # the part of the run on this shard
                if a >= b:
                    continue                                       # it lies on other ranks' shards
                value = p.data.view(-1)[a - start:b - start]
                master = self.flat.get("master")
                if master is not None:
                    master = master[a - lo:b - lo]
                    if fresh:
                        master.copy_(source[a - start:b - start])
                slots.append(_Slot(n, p, value, self.flat["exp_avg"][a - lo:b - lo],
                                   self.flat["exp_avg_sq"][a - lo:b - lo], master, self._group_of[id(p)],
                                   self._sr_key(n, sharing, a - start, p), weight, a - lo, b - lo))
        return slots

    def _plan_buckets(self, bucket_bytes: int) -> list[tuple[int, int, list[tuple[int, int, int]]]]:
        """The column bands of the [DP, S] grid (see the class): [(c0, c1, runs)], runs in the order
        the bucket holds them, row by row: (param index, start, end) in that param's flat elements,
        or (-1, 0, n): n padding zeros past the last parameter. bucket_bytes 0: one bucket."""
        dp, S = self.grid.dp, self.shard
        # the larger of the two dtypes: the reduce-scatter's gradients, the all-gather's params
        itemsize = self.bucket_itemsize = 4 if self.fp32_grads else self.named[0][1].element_size()
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

    def describe(self) -> str:
        # the buckets a --parallel.zero1_bucket_mb gives, as each collective moves them (bytes over the DP group)
        sizes = [(c1 - c0) * self.grid.dp * self.bucket_itemsize for c0, c1, _ in self.buckets]
        most = max(sizes)
        most = f"{most / 2**20:.3g} MB" if most >= 2**20 else f"{most / 2**10:.3g} KB" if most >= 2**10 else f"{most} bytes"
        return (f"; ZeRO-1: {self.shard:,} elements of optimizer state a rank, {len(sizes):,} collective "
                f"bucket{'s' * (len(sizes) > 1)} of at most {most}")

    def _state_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.flat)

    def masters(self) -> dict:
        if "master" not in self.flat:
            return {}
        full = torch.empty(self.shard * self.grid.dp, dtype=torch.float32, device=self.flat["master"].device)
        dist.all_gather_into_tensor(full, self.flat["master"], group=self.grid.dp_group)
        full = full.cpu()   # cut on the host (XLA: a graph a slice shape), each back by a transfer; train.py: <= 1B
        return {id(p): full[a:a + p.numel()].view(p.shape).to(p.device) for (_, p), a in zip(self.named, self.offsets)}

    def _layout(self) -> dict:
        # The flat index (names and shapes in order): reshard.py cuts the shards back into parameters.
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
        """The DP all-reduce's replacement: the grads x 1/DP summed into this rank's shard, bucket by
        bucket, then clipped on the global norm. Returns the norm before clipping."""
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
        norm = parallel.global_norm([(shard[s.lo:s.hi], s.norm_weight) for s in self.slots], g, device, over_dp=True)
        if max_norm > 0:
            parallel.scale_to_norm_([shard], norm, max_norm)
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
        # the full model again.
        mine = torch.zeros(self.shard, dtype=self.named[0][1].dtype, device=self.flat["exp_avg"].device)
        for s in self.slots:
            mine[s.lo:s.hi] = s.value
        for c0, c1, runs in self.buckets:
            self._gather_bucket(mine[c0:c1], runs)

    def _gather_bucket(self, piece: torch.Tensor, runs: list) -> None:
        """One bucket's all-gather, its runs copied into their params at once: one bucket in flight
        (kept until the end, the buckets held the whole local model: 1.1 GB at 70B in fp32)."""
        out = torch.empty(piece.numel() * self.grid.dp, dtype=piece.dtype, device=piece.device)
        dist.all_gather_into_tensor(out, piece, group=self.grid.dp_group)
        for (i, a, b), run in zip(runs, out.split([b - a for _, a, b in runs])):
            if i >= 0:
                self.named[i][1].data.view(-1)[a:b].copy_(run)


# ----------------------------------------------------------------------------- the guarded update

def guarded_step(optimizer: AdamW, verdict) -> bool | torch.Tensor:
    """optimizer.step() under the non-finite verdict (monitor.Monitor.check_finite): a bool from the host,
    or a boolean tensor on the device (XLA: no host read) applied by a select. Returns skipped, the same kind."""
    if torch.is_tensor(verdict):
        optimizer.step(apply=verdict)
        return ~verdict
    if verdict:
        optimizer.step()
    else:
        optimizer.step_count += 1   # Adam's t advances either way, as on the device (AdamW._keep)
    return not verdict


# ----------------------------------------------------------------------------- construction

def check_rounding(precision: str, device: torch.device) -> None:
    """How the device rounds to bf16, checked before any work. torch-xla's deprecated XLA_USE_BF16 /
    XLA_DOWNCAST_BF16 (NxD's examples still export them) keep every fp32 tensor in bf16 on the device: the
    fp32 weights, master, moments and update of every mode (tracebacks followed: the HLO verifier's, the
    dtype check's). bf16_sr on XLA leaves the rounding to the device (build_optimizer: no software SR
    there); where it would round to nearest, the run would be plain bf16 (the mode the blog saw fall
    behind) under bf16_sr's name. The Neuron runtime rounds stochastically only with
    NEURON_RT_STOCHASTIC_ROUNDING_EN=1 (its default only under those two: Neuron's torch-xla migration
    guide); XLA:CPU never does."""
    env = os.environ
    if device.type != "xla":
        return
    for var in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16"):
        if env.get(var, "0").strip().lower() not in ("0", "false", ""):
            raise ConfigError(f"{var}={env[var]} (deprecated) makes torch-xla keep every fp32 tensor in bf16, "
                              f"the fp32 state of --optim.precision={precision} included: unset it; "
                              f"--optim.precision chooses the dtypes (bf16_sr: bf16 with stochastic rounding)")
    hardware_sr = hardware.trainium(device) and env.get("NEURON_RT_STOCHASTIC_ROUNDING_EN") == "1"
    if precision == "bf16" and hardware_sr:         # bf16_sr under bf16's name (the precision study's other arm)
        raise ConfigError("--optim.precision=bf16 rounds to nearest, but NEURON_RT_STOCHASTIC_ROUNDING_EN=1 makes the "
                          "Neuron runtime round stochastically: use --optim.precision=bf16_sr, or unset it")
    if precision != "bf16_sr":
        return
    if not hardware.trainium(device):
        raise ConfigError(f"--optim.precision=bf16_sr on PJRT_DEVICE={hardware.xla_platform()}: only Trainium "
                          f"rounds stochastically on XLA (in hardware); use --optim.precision=bf16, or --device=cpu "
                          f"or cuda, where optim.py rounds in software")
    if not hardware_sr:
        raise ConfigError("--optim.precision=bf16_sr: the Neuron runtime rounds to nearest unless "
                          "NEURON_RT_STOCHASTIC_ROUNDING_EN=1 (scripts/env.sh exports it for bf16_sr, and "
                          "scripts/launch.sh sources env.sh): launch with launch.sh, or export it; "
                          "or train with --optim.precision=bf16")


def build_optimizer(model: torch.nn.Module, cfg: Config, grid: Grid | None = None,
                    software_sr: bool | None = None, masters: dict | None = None) -> AdamW:
    """AdamW over the model's parameters, sharded with ZeRO-1 when cfg.parallel.zero1 and DP > 1. software_sr defaults
    to on but for params on XLA (Trainium rounds in hardware). masters: "mixed"'s fp32 start (hf.load_sharded's)."""
    grid = grid or Grid()
    named = list(model.named_parameters())
    if software_sr is None:
        software_sr = all(p.device.type != "xla" for _, p in named)
    if cfg.parallel.zero1 and grid.dp > 1:
        mb = cfg.parallel.zero1_bucket_mb        # a cap below a byte is the smallest, not 0's one bucket
        return Zero1AdamW(named, cfg.optim, grid, seed=cfg.seed, software_sr=software_sr,
                          bucket_bytes=max(1, int(mb * 2**20)) if mb > 0 else 0, masters=masters)
    return AdamW(named, cfg.optim, grid, seed=cfg.seed, software_sr=software_sr, masters=masters)
