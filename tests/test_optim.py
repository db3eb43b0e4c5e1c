"""optim.py: AdamW against torch.optim.AdamW, stochastic rounding, the schedule, ZeRO-1 over gloo."""
import copy
import math
import os
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import configs  # noqa: E402
import model as llama  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
from conftest import seeded_model  # noqa: E402
import sharding  # noqa: E402
from parallel import Grid  # noqa: E402
from conftest import loss_sum  # noqa: E402
from conftest import count_collectives  # noqa: E402
from gloo_spawn import spawn  # noqa: E402

BF16_ULP_AT_1 = 2.0 ** -7          # bf16 keeps 8 significant bits: the gap between 1 and the next value


def stochastic_round(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """x rounded stochastically to a new bf16 tensor: optim.stochastic_round_ on one tensor."""
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    optim.stochastic_round_([out], [x], generator)
    return out


def tiny_config(precision="fp32", **optim_kw) -> configs.Config:
    cfg = configs.tiny()
    cfg.model = configs.ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    ffn_dim=64, max_seq_len=16)
    cfg.optim.precision = precision
    for k, v in optim_kw.items():
        setattr(cfg.optim, k, v)
    return cfg


def tiny_model(cfg) -> llama.Llama:
    """The unsharded reference: same full weights as parallel.init_weights gives any layout."""
    return llama.Llama(cfg.model).init_weights(cfg.seed).to(optim.param_dtype(cfg.optim.precision))


def batch(seed: int, n: int = 2, T: int = 16):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (n, T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def backward(model, tokens, targets, scale=None):
    loss = loss_sum(model(tokens), targets)
    (loss / (scale or targets.numel())).backward()


def reference_step(ref, ref_opt, tokens, targets, clip: float, active: bool = True, apply: bool = True) -> torch.Tensor:
    """One unsharded step on the full batch, torch's clipping formula (on the fp32 buffers that mixed
    precision accumulates into); returns the norm, which is above clip iff active. apply=False: the
    update skipped as the host decides it (optim.guarded_step with False)."""
    backward(ref, tokens, targets)
    grads = [g for g in map(parallel.grad_of, ref.parameters()) if g is not None]
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    for g in grads if clip > 0 else ():       # 0: no clipping
        g.mul_(torch.clamp(clip / (ref_norm + 1e-6), max=1.0))
    optim.guarded_step(ref_opt, apply)
    ref_opt.zero_grad()
    assert (ref_norm > clip) == active
    return ref_norm


# ----------------------------------------------------------------------------- AdamW

@pytest.mark.parametrize("decay_norms", [True, False])
def test_adamw_fp32_matches_torch(decay_norms):
    """fp32: our AdamW == torch.optim.AdamW step for step (same grads fed to both), lr changing
    every step along the schedule."""
    cfg = tiny_config(decay_norms=decay_norms, warmup_steps=2, decay_steps=4, lr=3e-3, min_lr=3e-4)
    ours, ref = tiny_model(cfg), tiny_model(cfg)
    opt = optim.build_optimizer(ours, cfg)
    o = cfg.optim
    decay = [p for p in ref.parameters() if decay_norms or p.ndim >= 2]
    exempt = [p for p in ref.parameters() if not (decay_norms or p.ndim >= 2)]
    assert exempt or decay_norms
    groups = [{"params": decay, "weight_decay": o.weight_decay}] + ([{"params": exempt, "weight_decay": 0.0}] if exempt else [])
    ref_opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    for step in range(6):
        lr = optim.lr_at(step, o)
        opt.set_lr(lr)
        for g in ref_opt.param_groups:
            g["lr"] = lr
        backward(ours, *batch(step))
        for p, q in zip(ours.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
            assert (p - q).abs().max().item() < 1e-6, (step, n)
    # the step really changed the weights (the comparison is not between two untouched models)
    assert (ours.lm_head.weight - tiny_model(cfg).lm_head.weight).abs().max() > 1e-3


def test_adamw_takes_parameters_alone_as_torch_optim_does():
    """AdamW(model.parameters(), ...) as torch.optim.AdamW is called: the parameters, named by
    position, train as with their names. Before, each was unpacked as a (name, param) pair: a 2-row
    weight became its row 1 (no gradient: never updated), any other shape a ValueError."""
    cfg = tiny_config(lr=1e-2, warmup_steps=0).optim
    w, b = torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(5))
    ref = [torch.nn.Parameter(t.detach().clone()) for t in (w, b)]
    opt = optim.AdamW(iter([w, b]), cfg)
    ref_opt = torch.optim.AdamW(ref, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False)
    for step in range(3):
        for p, q in zip((w, b), ref):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip((w, b), ref):
        assert (p - q).abs().max().item() < 1e-6


@pytest.mark.parametrize("precision,bytes_per_param,pdtype,sdtype", [
    ("fp32", 8, torch.float32, torch.float32), ("mixed", 12, torch.bfloat16, torch.float32),
    ("bf16", 4, torch.bfloat16, torch.bfloat16), ("bf16_sr", 4, torch.bfloat16, torch.bfloat16)])
def test_precision_modes_dtypes_and_state_bytes(precision, bytes_per_param, pdtype, sdtype):
    cfg = tiny_config(precision)
    model = tiny_model(cfg)
    opt = optim.build_optimizer(model, cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == llama.num_params(cfg.model)
    assert opt.state_bytes() == bytes_per_param * n
    assert all(p.dtype == pdtype for p in model.parameters())
    assert all(s.exp_avg.dtype == sdtype and s.exp_avg_sq.dtype == sdtype for s in opt.slots)
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, *batch(0))
    opt.step()
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    # fp32 moves every weight; in the bf16-param modes a first step of lr=1e-3 on a norm weight of
    # 1.0 is below half a bf16 ulp and may round back to 1.0 (the point of the whole study)
    assert all(changed) if precision == "fp32" else sum(changed) > len(changed) // 2
    if precision == "mixed":
        # the bf16 params are the fp32 master rounded to nearest, and the master moved by less
        # than one bf16 ulp in places (it keeps what the bf16 params cannot)
        for s in opt.slots:
            assert s.master.dtype == torch.float32
            assert torch.equal(s.value, s.master.to(torch.bfloat16))
        assert any(not torch.equal(s.master, s.value.float()) for s in opt.slots)


@pytest.mark.parametrize("precision", ["fp32", "mixed", "bf16", "bf16_sr"])
def test_foreach_update_is_bit_equal_to_the_slot_by_slot_reference(precision, monkeypatch):
    """AdamW.step runs _update_all (foreach kernels, batches of slots, stochastic rounding of a
    slot's three tensors from one draw); the reference is AdamW written out one slot at a time, each
    tensor rounded by stochastic_round in turn: 4 steps, weights and both moments bit-equal.
    Batches of at most 3000 elements, so that each group is cut into several."""
    cfg = tiny_config(precision, decay_norms=False, lr=1e-2)
    models = [tiny_model(cfg), tiny_model(cfg)]
    opts = [optim.build_optimizer(m, cfg) for m in models]

    def slot_by_slot(self, runs, k):
        c = self.cfg
        for s, grad in runs:
            kk = k[id(s.group)]                    # [1 - lr * wd, -lr / bias1, sqrt(bias2)]
            g = grad.float()
            m, v = s.exp_avg.float(), s.exp_avg_sq.float()     # fp32 state: the tensor itself
            w = s.master if s.master is not None else s.value.float()
            w.mul_(kk[0])                                      # decoupled weight decay
            m.lerp_(g, 1.0 - c.beta1)
            v.mul_(c.beta2).addcmul_(g, g, value=1.0 - c.beta2)
            w.addcdiv_(m * kk[1], (v.sqrt() / kk[2]).add_(c.eps))
            gen = self._generator_for(s)
            for dst, value in ((s.exp_avg, m), (s.exp_avg_sq, v), (s.value, w)):
                if dst is not value:
                    dst.copy_(value if gen is None else stochastic_round(value, gen))
    monkeypatch.setattr(opts[0], "_update_all", slot_by_slot.__get__(opts[0]))
    monkeypatch.setattr(opts[1], "FOREACH_ELEMENTS", 3000)
    for step in range(4):
        tokens, targets = batch(step)
        for m, opt in zip(models, opts):
            backward(m, tokens, targets)
            opt.step()
            opt.zero_grad()
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), n
    sa, sb = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("precision", ["fp32", "mixed", "bf16_sr"])
def test_a_skip_decided_on_the_host_or_on_the_device_trains_alike(precision):
    """--log.on_nonfinite=skip decides on the host on CPU and CUDA (optim.guarded_step with a bool)
    and on the device on XLA (a boolean tensor, applied by a select). The run must go on alike after
    a skipped step: only the device path advanced Adam's t, so XLA:CPU and eager CPU trained apart
    after a NaN (tiny run, NANOTRN_FAULT=nan:5, skip: loss 8.0621 vs 8.0573 at step 10). mixed: the select
    must restore the fp32 master too, else the skipped update lands there and the next step rounds it in."""
    cfg = tiny_config(precision, lr=1e-2)
    models = [tiny_model(cfg), tiny_model(cfg)]
    opts = [optim.build_optimizer(m, cfg) for m in models]
    for step in range(4):
        tokens, targets = batch(step)
        for m, opt, verdict in zip(models, opts, (step != 1, torch.tensor(step != 1))):
            backward(m, tokens, targets)
            assert bool(optim.guarded_step(opt, verdict)) == (step == 1)        # step 1 skipped
            opt.zero_grad()
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), n
    sa, sb = opts[0].state_dict(), opts[1].state_dict()
    assert sa["step"] == sb["step"] and all(torch.equal(sa["state"][k], sb["state"][k]) for k in sa["state"])


def test_wrong_param_dtype_and_precision_are_rejected():
    cfg = tiny_config("mixed")
    with pytest.raises(ValueError, match="param_dtype"):
        optim.build_optimizer(llama.Llama(cfg.model), cfg)      # fp32 params for a bf16 mode
    cfg.optim.precision = "fp16"
    with pytest.raises(ValueError, match="bf16_sr"):
        optim.param_dtype(cfg.optim.precision)


def test_bf16_sr_on_trainium_needs_the_runtimes_stochastic_rounding(monkeypatch):
    """On XLA the optimizer leaves bf16_sr's rounding to the device (software_sr off). The Neuron runtime
    rounds to nearest unless NEURON_RT_STOCHASTIC_ROUNDING_EN=1 (on by default only with the deprecated
    XLA_USE_BF16 / XLA_DOWNCAST_BF16: Neuron's torch-xla migration guide): a direct torchrun without
    scripts/env.sh trained plain bf16 under the name bf16_sr. Those two keep every fp32 tensor in bf16 on
    the device (tracebacks followed): refused in every mode. Each before any work, with the fix."""
    xla = torch.device("xla")
    for k in ("NEURON_RT_STOCHASTIC_ROUNDING_EN", "XLA_USE_BF16", "XLA_DOWNCAST_BF16"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    with pytest.raises(configs.ConfigError, match="NEURON_RT_STOCHASTIC_ROUNDING_EN=1 .*scripts/env.sh"):
        optim.check_rounding("bf16_sr", xla)
    for precision in ("fp32", "mixed", "bf16"):          # nothing to round stochastically
        optim.check_rounding(precision, xla)
    optim.check_rounding("bf16_sr", torch.device("cpu"))   # software rounding (optim.stochastic_round_)
    monkeypatch.setenv("NEURON_RT_STOCHASTIC_ROUNDING_EN", "0")      # what scripts/env.sh exports for the others
    with pytest.raises(configs.ConfigError, match="NEURON_RT_STOCHASTIC_ROUNDING_EN=1"):
        optim.check_rounding("bf16_sr", xla)
    monkeypatch.setenv("NEURON_RT_STOCHASTIC_ROUNDING_EN", "1")      # what scripts/env.sh exports for bf16_sr
    optim.check_rounding("bf16_sr", xla)
    with pytest.raises(configs.ConfigError, match="--optim.precision=bf16 rounds to nearest"):
        optim.check_rounding("bf16", xla)        # would be bf16_sr under bf16's name: the study's other arm
    for precision in ("fp32", "mixed"):          # HLAT's 70B ran mixed with it (its scripts export it)
        optim.check_rounding(precision, xla)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")                # XLA:CPU has no stochastic rounding at all
    with pytest.raises(configs.ConfigError, match="PJRT_DEVICE=CPU"):
        optim.check_rounding("bf16_sr", xla)
    for var in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16"):     # every fp32 tensor bf16 on the device: refused on XLA
        monkeypatch.setenv(var, "1")
        for precision in optim.PRECISIONS:
            with pytest.raises(configs.ConfigError, match=f"{var}=1"):
                optim.check_rounding(precision, xla)
        optim.check_rounding("fp32", torch.device("cpu"))   # torch-xla's variable: nothing to CPU or CUDA
        monkeypatch.setenv(var, "0")
        optim.check_rounding("fp32", xla)


def test_state_dict_roundtrip_and_mismatch_errors():
    cfg = tiny_config("mixed")
    model = tiny_model(cfg)
    opt = optim.build_optimizer(model, cfg)
    backward(model, *batch(0))
    opt.set_lr(1.25e-4)             # the schedule's lr, restored as torch.optim restores its param groups
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt2 = optim.build_optimizer(copy.deepcopy(model), cfg)
    opt2.load_state_dict(sd)
    assert opt2.step_count == 1 and [g["lr"] for g in opt2.param_groups] == [1.25e-4] * len(opt.param_groups)
    for a, b in zip(opt.slots, opt2.slots):
        assert torch.equal(a.master, b.master) and torch.equal(a.exp_avg_sq, b.exp_avg_sq)
    other = tiny_config("bf16_sr")
    with pytest.raises(ValueError, match="precision"):
        optim.build_optimizer(tiny_model(other), other).load_state_dict(sd)
    # a tensor of another size is refused by name, not cut to this parameter's first elements
    n = sd["state"]["norm.weight.exp_avg"].numel()
    longer = {**sd, "state": {**sd["state"], "norm.weight.exp_avg": torch.zeros(n + 1)}}
    with pytest.raises(ValueError, match=rf"norm.weight.exp_avg has shape \({n + 1},\), expected {n} elements"):
        optim.build_optimizer(copy.deepcopy(model), cfg).load_state_dict(longer)
    # A per-parameter state resumes as ZeRO-1 shards: each DP rank takes its range of the flat index.
    flat = {k: torch.cat([sd["state"][f"{n}.{k}"].reshape(-1) for n, _ in model.named_parameters()])
            for k in ("exp_avg", "exp_avg_sq", "master")}
    zeros = [optim.Zero1AdamW(list(model.named_parameters()), cfg.optim, Grid(dp=2, dp_rank=r)) for r in (0, 1)]
    for r, zero in enumerate(zeros):
        zero.load_state_dict(sd)
        lo, hi = r * zero.shard, min((r + 1) * zero.shard, zero.numel)
        assert all(torch.equal(zero.flat[k][:hi - lo], flat[k][lo:hi]) for k in flat) and zero.step_count == 1
    with pytest.raises(ValueError, match="does not match this run's"):     # a shard of another DP rank
        zeros[0].load_state_dict(zeros[1].state_dict())


# ----------------------------------------------------------------------------- stochastic rounding

def _bf16_neighbours(x: torch.Tensor):
    """The two bf16 values around each fp32 x (equal when x is a bf16 value), found with
    nextafter rather than bit tricks."""
    near = x.to(torch.bfloat16)
    toward = torch.where(near.float() < x, torch.full_like(near, math.inf), torch.full_like(near, -math.inf))
    other = torch.where(near.float() == x, near, torch.nextafter(near, toward))
    return torch.minimum(near, other).float(), torch.maximum(near, other).float()


def test_sr_result_is_always_a_bf16_neighbour():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.logspace(-30, 30, 20000)    # both signs, wide range
    x[:8] = torch.tensor([0.0, -0.0, 1.0, -2.0, 3.0, 1e-40, -1e-40, 3e38])   # exact, subnormal, huge
    lo, hi = _bf16_neighbours(x)
    r = stochastic_round(x, torch.Generator().manual_seed(1))
    assert r.dtype == torch.bfloat16
    assert torch.all((r.float() == lo) | (r.float() == hi))
    exact = lo == hi
    assert torch.equal(r.float()[exact], x[exact])
    assert (r.float() == lo)[~exact].any() and (r.float() == hi)[~exact].any()   # both directions occur
    special = stochastic_round(torch.tensor([math.nan, -math.nan, math.inf, -math.inf]), g).float()
    assert special[:2].isnan().all() and special[2] == math.inf and special[3] == -math.inf



def test_sr_keeps_every_nan_payload_nan_and_rounds_the_largest_floats_to_max_or_inf():
    """A NaN's low bits plus the noise can carry into the sign (0x7FFFFFFF came out -0.0, 0xFFFFFFFF +0.0: a
    diverged weight silently zero) or truncate to inf's bits (0x7F800001). Every NaN stays NaN, as x.to(bf16) keeps
    it; inf stays inf; above bf16's largest finite value the result is that value or inf (round to nearest: inf)."""
    nans = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0xFFFF8000, 0x7F800001, 0xFF800001, 0x7FC00000, 0xFFC00000]
    bits = torch.tensor(nans, dtype=torch.int64).repeat_interleave(2048)
    x = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    assert x.isnan().all() and x.to(torch.bfloat16).isnan().all()
    assert stochastic_round(x, torch.Generator().manual_seed(0)).isnan().all()
    bf16_max = torch.finfo(torch.bfloat16).max
    big = torch.tensor([math.inf, -math.inf, 3.39e38, -3.39e38, torch.finfo(torch.float32).max]).repeat(512)
    r = stochastic_round(big, torch.Generator().manual_seed(0)).float()
    assert torch.equal(r[big.isinf()], big[big.isinf()])
    assert ((r.abs() == bf16_max) | r.isinf())[big.isfinite()].all()
    assert torch.equal(r.sign(), big.sign())

def test_sr_draws_are_randint_draws():
    """optim.sr_noise (random_() masked to 16 bits, CPU) gives torch.randint(0, 2^16)'s numbers from
    the same generator state, so stochastic rounding rounds as it did with randint; and
    stochastic_round_ (one draw for several tensors, no bf16 temporary) rounds each tensor as
    stochastic_round called on them in turn. Seeds as _generator_for makes them (up to 2^63)."""
    def randint_round(x, g):            # stochastic_round as it was written with randint
        bits = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, generator=g)
        bits += x.view(torch.int32)
        bits &= -65536
        return bits.view(torch.float32).to(torch.bfloat16)
    for seed in (0, 1, 2**31 + 5, 2**63 - 25):
        for n in (1, 17, 624, 100_003):
            a = optim.sr_noise(n, "cpu", torch.Generator().manual_seed(seed))
            b = torch.randint(0, 1 << 16, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
            assert a.dtype == torch.int32 and torch.equal(a, b), (seed, n)
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(n, generator=g) * 10 ** torch.randint(-20, 20, (n,), generator=g) for n in (5000, 7, 3000)]
        g1 = torch.Generator().manual_seed(seed)
        ref = [randint_round(x, g1) for x in xs]
        got = [torch.empty(x.shape, dtype=torch.bfloat16) for x in xs]
        optim.stochastic_round_(got, xs, torch.Generator().manual_seed(seed))
        assert all(torch.equal(r, t) for r, t in zip(ref, got))
        g2 = torch.Generator().manual_seed(seed)
        assert all(torch.equal(r, stochastic_round(x, g2)) for r, x in zip(ref, xs))


def test_sr_is_unbiased_within_statistical_bound():
    """Mean of N roundings of x: each rounding is lo or hi with p = (x - lo) / (hi - lo), so the mean
    has std (hi - lo) * sqrt(p (1 - p) / N) <= gap / (2 sqrt N). Bound used: 5 of those stds.
    Round to nearest, for contrast, is off by up to half a gap with no averaging out."""
    N = 4000
    g = torch.Generator().manual_seed(0)
    x = (1.0 + torch.rand(64, generator=g)) * torch.tensor([1.0, -3e-3, 7e4, -0.5]).repeat(16)
    lo, hi = _bf16_neighbours(x)
    rounds = torch.stack([stochastic_round(x, g).float() for _ in range(N)])
    err = (rounds.double().mean(0) - x.double()).abs()
    bound = 5 * (hi - lo).double() / (2 * math.sqrt(N))
    assert torch.all(err <= bound), (err / bound).max()
    rne_err = (x.to(torch.bfloat16).float().double() - x.double()).abs()
    assert rne_err.max() > 10 * bound.max()      # the test would catch a round-to-nearest in disguise


def test_update_below_half_ulp_moves_only_with_sr():
    """w = 1.0 in bf16, add delta = 1e-3 (< half ulp = 3.9e-3) K times. Round to nearest never
    moves; SR lands on 1 + K delta in expectation: each add is unbiased, so after K adds the error has
    std <= ulp/2 * sqrt(K) per weight, averaged over M independent weights."""
    K, M, delta = 200, 4096, 1e-3
    g = torch.Generator().manual_seed(0)
    rne = torch.ones(M, dtype=torch.bfloat16)
    sr = torch.ones(M, dtype=torch.bfloat16)
    for _ in range(K):
        rne = (rne.float() + delta).to(torch.bfloat16)
        sr = stochastic_round(sr.float() + delta, g)
    assert torch.all(rne == 1.0)
    bound = 5 * (BF16_ULP_AT_1 / 2) * math.sqrt(K) / math.sqrt(M)
    assert abs(sr.float().mean().item() - (1 + K * delta)) < bound


def test_adamw_bf16_stalls_where_bf16_sr_follows_fp32():
    """The blog's finding in miniature, through the optimizer: a constant gradient makes every Adam
    step exactly lr (m_hat / sqrt(v_hat) = 1). With lr far below half a bf16 ulp, bf16 params never
    move, bf16_sr params move by lr per step on average, like fp32."""
    lr, K, M = 2e-4, 100, 4096
    finals = {}
    for precision in ("fp32", "bf16", "bf16_sr"):
        cfg = tiny_config(precision, lr=lr, weight_decay=0.0, eps=1e-12)
        w = torch.nn.Parameter(torch.ones(M, dtype=optim.param_dtype(precision)))
        opt = optim.AdamW([("w", w)], cfg.optim, seed=3)
        for _ in range(K):
            w.grad = torch.ones_like(w)
            opt.step()
        finals[precision] = w.detach().float()
    assert torch.allclose(finals["fp32"], torch.full((M,), 1 - K * lr), atol=1e-5)
    assert torch.all(finals["bf16"] == 1.0)
    # SR noise on m and v makes the step not exactly lr; 10% of the expected move is still 6 sigma
    assert abs(finals["bf16_sr"].mean().item() - (1 - K * lr)) < 0.1 * K * lr
    # each weight too, not only their mean: a step's draws are new (the same draws every step left 95% of the
    # weights at 1.0 for ever and moved the others far: the mean right, std 0.087 where SR gives 0.009)
    assert (finals["bf16_sr"] == 1.0).float().mean() < 0.05 and finals["bf16_sr"].std() < 0.02


def test_sr_stream_is_seeded_and_resumes_exactly():
    """Same seed -> bitwise the same run (DP replicas stay identical); a resumed run continues with
    the same random stream as the uninterrupted one; another seed gives another run."""
    def run(seed, steps, resume_from=None):
        cfg = tiny_config("bf16_sr")
        cfg.seed = seed
        model = tiny_model(cfg)
        opt = optim.build_optimizer(model, cfg)
        start = 0
        if resume_from is not None:
            model.load_state_dict(resume_from[0])
            opt.load_state_dict(resume_from[1])
            start = opt.step_count
        for step in range(start, steps):
            backward(model, *batch(step))
            opt.step()
            opt.zero_grad()
        return model, opt

    full, _ = run(7, 4)
    m2, o2 = run(7, 2)
    saved = (copy.deepcopy(m2.state_dict()), copy.deepcopy(o2.state_dict()))
    assert saved[1]["sr_seed"] == 7 and saved[1]["step"] == 2
    resumed, _ = run(7, 4, resume_from=saved)
    other, _ = run(8, 4)
    # the stream is the state's: resumed by an optimizer built with another seed, it goes on as saved
    resumed_other_seed, _ = run(8, 4, resume_from=saved)
    for (n, a), b, c, d in zip(full.named_parameters(), resumed.parameters(), other.parameters(),
                               resumed_other_seed.parameters()):
        assert torch.equal(a, b) and torch.equal(a, d), n
    assert any(not torch.equal(a, c) for a, c in zip(full.parameters(), other.parameters()))


def test_sr_streams_and_norm_weights_follow_tp_sharing():
    """Norm weights (replicated over TP) and replicated KV heads must round identically on the TP
    ranks holding copies; TP shards draw independent noise. Norm weights count each element once."""
    cfg = tiny_config("bf16_sr")
    shard = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))
    shard.tensor_model_parallel = True
    qkv = torch.nn.Parameter(torch.ones(6, 4, dtype=torch.bfloat16))     # 2 q rows... then a KV head
    qkv.tensor_model_parallel, qkv.kv_replicas, qkv.q_rows = True, 2, 2
    norm = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    slots = [optim.AdamW([("w", shard), ("qkv", qkv), ("n", norm)], cfg.optim, Grid(tp=4, tp_rank=r)).slots
             for r in range(4)]
    keys = [[s.sr_key for s in ss] for ss in slots]
    assert len({k[0] for k in keys}) == 4                  # shards: one stream per TP rank
    assert len({k[1] for k in keys}) == 4                  # q rows of qkv: per TP rank
    assert keys[0][2] == keys[1][2] != keys[2][2] == keys[3][2]   # KV head: shared by its 2 copies
    assert len({k[3] for k in keys}) == 1                  # norm weight: one stream on all TP ranks
    assert [(s.lo, s.hi) for s in slots[0]] == [(0, 16), (0, 8), (8, 24), (0, 4)]
    weights = [[s.norm_weight for s in ss] for ss in slots]
    assert [sum(w[3] for w in weights)] == [1.0] and weights[1][2] == 0.5



def test_sr_rounds_a_tied_embeddings_last_stage_copy_as_its_first_stage():
    """With tied embeddings under PP, stage 0's embed.weight and the last stage's lm_head.weight copy
    take the same summed gradient (pipeline.reduce_tied_embedding); bf16_sr must round them alike, or the
    copies drift apart. Each step on each stage: the same weights, bit for bit."""
    cfg = tiny_config("bf16_sr")
    torch.manual_seed(0)
    init, grads = torch.randn(8, 4).to(torch.bfloat16), [torch.randn(8, 4).to(torch.bfloat16) for _ in range(3)]
    embed, copy = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    copy.tied_copy = True                    # pipeline.build_model marks the last stage's
    first = optim.AdamW([("embed.weight", embed)], cfg.optim, Grid(pp=2, pp_rank=0))
    last = optim.AdamW([("lm_head.weight", copy)], cfg.optim, Grid(pp=2, pp_rank=1))
    for g in grads:
        embed.grad, copy.grad = g.clone(), g.clone()
        first.step()
        last.step()
        assert torch.equal(embed, copy)
    assert not torch.equal(embed, init)

# ----------------------------------------------------------------------------- schedule

def test_schedule_7b_closed_form():
    """The table's "LR decay steps 480,000" count from step 0, as NxD's CosineAnnealing max_steps: the cosine
    ends at step 480k (it ended at 482k, decay counted after the warmup), then 3e-5 for the last 20k steps."""
    o = configs.llama2_7b().optim        # 2000 warmup, cosine 3e-4 -> 3e-5 until step 480k, 500k steps
    assert (o.warmup_steps, o.decay_steps, o.max_steps, o.lr, o.min_lr) == (2000, 478_000, 500_000, 3e-4, 3e-5)

    def cosine(s):       # NxD's _cosine_annealing(step - warmup, max_steps - warmup) with max_steps 480k
        return 3e-5 + 0.5 * (1 + math.cos(math.pi * (s - 2000) / (480_000 - 2000))) * (3e-4 - 3e-5)
    expected = {0: 3e-4 * 1 / 2000, 1000: 3e-4 * 1001 / 2000, 2000: 3e-4, 250_000: cosine(250_000),
                479_000: cosine(479_000), 480_000: 3e-5, 500_000: 3e-5}
    for step, lr in expected.items():
        assert optim.lr_at(step, o) == pytest.approx(lr, rel=1e-12, abs=0), step
    assert 3e-5 < optim.lr_at(479_999, o) < optim.lr_at(250_000, o) < 3e-4


def test_schedule_constant_phase_and_edges():
    o = configs.OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, constant_steps=5, decay_steps=20)
    assert [optim.lr_at(s, o) for s in (9, 10, 14)] == [1.0, 1.0, 1.0]   # warmup ends at lr, then holds
    assert optim.lr_at(15, o) == 1.0 and optim.lr_at(25, o) == pytest.approx(0.55)
    assert optim.lr_at(35, o) == 0.1
    lrs = [optim.lr_at(s, o) for s in range(40)]
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:11]))                # warmup rises
    assert all(a >= b for a, b in zip(lrs[15:35], lrs[16:36]))             # decay falls
    o0 = configs.OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=0, decay_steps=0)
    assert optim.lr_at(0, o0) == 0.1


def test_fp32_gradient_accumulation_over_64_microbatches():
    """mixed (bf16 params), 64 microbatches of one sequence each, as in the 70B preset: gradients
    accumulated in fp32 (NxD's use_fp32_grad_acc, the default) stay as close to the fp32 reference
    (the same bf16-rounded weights, computed and accumulated in fp32) as one bf16 backward allows;
    accumulated in bf16 (--optim.fp32_grad_acc=false) they drift about twice as far."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                 # 4 x 64 tiny backwards: threads only contend
    n_micro = 64
    ref = tiny_model(tiny_config("mixed")).float()
    runs = {}
    for fp32_acc in (True, False):
        cfg = tiny_config("mixed", fp32_grad_acc=fp32_acc)
        model = tiny_model(cfg)
        runs[fp32_acc] = (model, optim.build_optimizer(model, cfg))
    for i in range(n_micro):
        tokens, targets = batch(100 + i, n=1)
        for m in (ref, *(model for model, _ in runs.values())):
            backward(m, tokens, targets, scale=targets.numel() * n_micro)
    torch.set_num_threads(threads)
    flat = lambda gs: torch.cat([g.float().flatten() for g in gs])  # noqa: E731
    want = flat(p.grad for p in ref.parameters())
    err = {}
    for fp32_acc, (model, opt) in runs.items():
        got = [parallel.grad_of(p) for p in model.parameters()]
        assert all(g.dtype == (torch.float32 if fp32_acc else torch.bfloat16) for g in got)
        assert all((p.grad is None) == fp32_acc for p in model.parameters())   # bf16 grads freed
        err[fp32_acc] = ((flat(got) - want).norm() / want.norm()).item()
    print(f"relative gradient error after {n_micro} microbatches: fp32 accumulation "
          f"{err[True]:.2e}, bf16 accumulation {err[False]:.2e}")
    assert err[True] < 0.01 and err[True] < 0.6 * err[False]
    model, opt = runs[True]
    opt.step()                               # the update reads the fp32 buffers, then frees them
    opt.zero_grad()
    assert all(p.main_grad is None and p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- ZeRO-1

def test_zero1_shards_cover_every_element_once():
    """No collectives needed: the shard layout alone. Each rank's state is ceil(N / DP) elements
    (1/DP of the unsharded state, padding aside), and the ranks' slots tile all N elements."""
    cfg = tiny_config("mixed")
    model = tiny_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    for dp in (2, 3):
        covered = {name: torch.zeros(p.numel(), dtype=torch.int32) for name, p in model.named_parameters()}
        for r in range(dp):
            opt = optim.Zero1AdamW(list(model.named_parameters()), cfg.optim, Grid(dp=dp, dp_rank=r))
            assert opt.flat["exp_avg"].numel() == -(-n // dp)
            assert opt.state_bytes() == 12 * -(-n // dp)
            for s in opt.slots:
                start = s.value.data_ptr() - s.param.data_ptr()
                covered[s.name][start // s.value.element_size():][:s.value.numel()] += 1
        assert all(torch.all(c == 1) for c in covered.values())
    with pytest.raises(RuntimeError, match="reduce_scatter_and_clip"):
        opt.step()


def test_a_bucket_cap_below_one_byte_is_the_smallest_not_unbounded():
    """--parallel.zero1_bucket_mb=1e-7 (0.1 byte) gave int(0.1) = 0, the value that means one unbounded
    bucket: the smallest cap asked for moved the whole local model at once (1 bucket of 1.07 MB in
    train.py's model line at 0.28M parameters), while 1 byte gave one element a rank a bucket."""
    cfg = tiny_config("fp32")
    cfg.parallel.zero1 = True
    model = tiny_model(cfg)
    for mb in (1e-7, 2.0 ** -20):            # 0.1 byte, 1 byte: both below one element a rank
        cfg.parallel.zero1_bucket_mb = mb
        opt = optim.build_optimizer(model, cfg, Grid(dp=2, dp_rank=0))
        assert len(opt.buckets) == opt.shard and all(c1 - c0 == 1 for c0, c1, _ in opt.buckets), (mb, len(opt.buckets))
        # train.py's model line: 2 ranks x 4 bytes, in bytes (was "at most 0.00781 KB")
        assert opt.describe().endswith(f"{opt.shard:,} collective buckets of at most 8 bytes"), opt.describe()
    # the cap is on what a collective moves over the DP group: 4 KB at DP 3 is 341 fp32 elements a rank, not 1024
    cfg.parallel.zero1_bucket_mb = 2.0 ** -8
    sizes = [(c1 - c0) * 3 * 4 for c0, c1, _ in optim.build_optimizer(model, cfg, Grid(dp=3, dp_rank=0)).buckets]
    assert max(sizes) == 341 * 12 <= 4096 and len(sizes) > 2, sizes[:3]
    cfg.parallel.zero1_bucket_mb = 0.0       # 0: one bucket, as documented
    assert len(optim.build_optimizer(model, cfg, Grid(dp=2, dp_rank=0)).buckets) == 1


@pytest.mark.parametrize("fp32_grad_acc,itemsize", [(True, 4), (False, 2)])
def test_the_bucket_cap_counts_the_fp32_gradients_mixed_reduce_scatters(fp32_grad_acc, itemsize):
    """mixed with fp32 gradient accumulation (the default) reduce-scatters fp32 gradients, 4 bytes an
    element, where its parameters are bf16: a cap sized by the parameters' 2 bytes let each bucket move
    twice the bytes asked for (NxD's 130 MB cap is there because larger buckets gave NaN)."""
    cfg = tiny_config("mixed", fp32_grad_acc=fp32_grad_acc)
    cfg.parallel.zero1, cfg.parallel.zero1_bucket_mb = True, 2.0 ** -8        # 4 KB
    opt = optim.build_optimizer(tiny_model(cfg), cfg, Grid(dp=2, dp_rank=0))
    sizes = [(c1 - c0) * 2 * itemsize for c0, c1, _ in opt.buckets]
    assert max(sizes) == 4096 and len(sizes) > 2, sizes[:3]
    assert opt.describe().endswith("collective buckets of at most 4 KB"), opt.describe()


def _init_gloo(rank: int, world: int, store_file: str):
    # Rendezvous through a file unique to this test (not a TCP port picked in advance): concurrent
    # test runs on a shared machine cannot join each other's groups.
    torch.set_num_threads(1)
    import xla_rules
    xla_rules.install()             # ZeRO-1's collectives in their XLA form, checked by the xla backend's rules
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)


def _zero1_worker(rank: int, world: int, store_file: str):
    """DP=2: ZeRO-1 against the unsharded optimizer on the whole batch, in every precision mode."""
    _init_gloo(rank, world, store_file)
    grid = Grid(world=world, rank=rank, dp=world, dp_rank=rank, dp_group=dist.new_group(list(range(world))))
    try:
        # clip 0.5 is below the tiny model's grad norm: clipping is active, so the global norm matters;
        # clip 50 is above it: the gradients must stay as they are, not be scaled up to the limit; clip 0 is
        # --optim.grad_clip=0, no clipping: the gradients as they are, not scaled to a norm of 0
        for precision, clip in (("fp32", 0.5), ("mixed", 0.5), ("bf16", 0.5), ("bf16_sr", 0.5), ("fp32", 50.0),
                                ("fp32", 0.0)):
            cfg = tiny_config(precision, grad_clip=clip, lr=3e-3)
            cfg.parallel.zero1 = True
            model, ref = tiny_model(cfg), tiny_model(cfg)
            opt = optim.build_optimizer(model, cfg, grid)
            ref_opt = optim.build_optimizer(ref, cfg)            # no grid: the unsharded optimizer
            assert isinstance(opt, optim.Zero1AdamW) and not ref_opt.zero1
            n = sum(p.numel() for p in model.parameters())
            assert opt.state_bytes() * world == pytest.approx(ref_opt.state_bytes(), rel=1e-3)
            for step in range(3):
                tokens, targets = batch(step, n=4)
                mine = slice(2 * rank, 2 * rank + 2)
                # the train.py rule: local sum * dp / global tokens, then 1/DP in the reduce
                backward(model, tokens[mine], targets[mine], scale=targets.numel() / world)
                norm = opt.reduce_scatter_and_clip(cfg.optim.grad_clip)
                if step == 1:       # skipped on the device (XLA's select): the shard's old values gathered
                    optim.guarded_step(opt, torch.tensor(False))
                else:
                    opt.step()
                opt.zero_grad()
                ref_norm = reference_step(ref, ref_opt, tokens, targets, clip, active=clip < 1, apply=step != 1)
                if precision == "fp32":
                    assert abs(norm.item() - ref_norm.item()) < 1e-5 * ref_norm.item()
            # every rank holds the same full model after the all-gather
            flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            assert torch.equal(gathered[0], gathered[1]), precision
            masters = opt.masters()      # the export's weights (train.py): every rank's shard, gathered whole
            if precision == "mixed":
                assert all(torch.equal(masters[id(p)].bfloat16(), p) for p in model.parameters())
                assert any(not torch.equal(masters[id(p)], p.float()) for p in model.parameters())
                ref_masters = ref_opt.masters()      # bf16 grads summed in another order, as the weights below
                assert max((masters[id(p)] - ref_masters[id(q)]).abs().max().item()
                           for p, q in zip(model.parameters(), ref.parameters())) < 4e-3
            else:
                assert masters == {}
            diff = max((p.float() - q.float()).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
            if precision == "fp32":
                assert diff < 1e-6, diff
            elif precision == "mixed":
                # bf16 grads summed in another order: a few bf16 ulps of a 0.02-scale weight at most
                assert diff < 4e-3, diff
            assert math.isfinite(diff) and opt.step_count == 3
            assert opt.flat["exp_avg"].numel() == -(-n // world)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero1_dp2_matches_unsharded(tmp_path):
    spawn(_zero1_worker, (2, str(tmp_path / "store")), nprocs=2)


def test_a_global_norm_of_no_piece_is_a_zero_on_the_models_device():
    """A ZeRO-1 rank whose shard holds no parameter (N < ~DP^2) has no piece: its zero was made on the CPU, which an
    nccl or xla all-reduce refuses beside the other ranks' device tensors. It is made on the device it is given."""
    meta = torch.device("meta")
    for pieces in ([], [(torch.ones(3, dtype=torch.bfloat16, device=meta), 1)]):
        norm = parallel.global_norm(pieces, Grid(), meta, over_dp=True)
        assert (norm.device, norm.dtype, norm.shape) == (meta, torch.float32, ()), (len(pieces), norm.device)


def _zero1_bf16_clip_worker(rank: int, world: int, store_file: str):
    """A world of one: ZeRO-1's clipped bf16 gradient shard is max_norm within 3e-4 on average over 50 scales."""
    _init_gloo(rank, world, store_file)
    grid = Grid(world=1, rank=0, dp=1, dp_rank=0, dp_group=dist.new_group([0]))
    try:
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(8192).bfloat16())
        opt = optim.Zero1AdamW([("w", p)], tiny_config("bf16", grad_clip=1.0).optim, grid)
        misses = []
        for i in range(50):
            p.grad = (torch.randn(8192) * (1.5 + i * 0.29) / 90.5).bfloat16()        # norms 1.5x to 16x the limit
            opt.reduce_scatter_and_clip(1.0)
            misses.append(abs(opt._grad_shard[:8192].double().norm().item() - 1))
        assert sum(misses) / 50 < 3e-4, sum(misses) / 50
    finally:
        dist.destroy_process_group()


@pytest.mark.slow               # one spawned process (torch's import)
def test_zero1_clips_bf16_gradients_rounding_each_element_once(tmp_path):
    """c94e9d5 made ZeRO-1's clip multiply each bf16 gradient by the fp32 coefficient (parallel.scale_to_norm_), as
    clip_grad_norm_; only the latter was tested (test_parallel): the coefficient rounded to bf16 first in
    reduce_scatter_and_clip (up to 2^-9) still passed every ZeRO-1 test. Rounded first: a mean miss of ~1e-3."""
    spawn(_zero1_bf16_clip_worker, (1, str(tmp_path / "store")), nprocs=1)


def _zero1_empty_rank_worker(rank: int, world: int, store_file: str):
    """DP=4 over 5 elements: S = 2, so rank 3's shard [6, 8) holds none of them (no slot)."""
    _init_gloo(rank, world, store_file)
    grid = Grid(world=world, rank=rank, dp=world, dp_rank=rank, dp_group=dist.new_group(list(range(world))))
    try:
        cfg = tiny_config("fp32", grad_clip=0.5, lr=0.1)
        p, q = (torch.nn.Parameter(torch.arange(5.0)) for _ in range(2))
        opt, ref = optim.Zero1AdamW([("w", p)], cfg.optim, grid), optim.AdamW([("w", q)], cfg.optim)
        assert (len(opt.slots) == 0) == (rank == 3), (rank, len(opt.slots))
        grads = [torch.linspace(-1, 1, 5) * (r + 1) for r in range(world)]
        p.grad, q.grad = grads[rank].clone(), sum(grads) / world
        norm = opt.reduce_scatter_and_clip(0.5)
        opt.step()
        ref_norm = torch.linalg.vector_norm(q.grad)
        q.grad.mul_(0.5 / (ref_norm + 1e-6))
        ref.step()
        assert norm.device == p.device and abs(norm.item() - ref_norm.item()) < 1e-6 * ref_norm.item(), (rank, norm)
        assert torch.allclose(p.detach(), q.detach(), atol=1e-7), (rank, p, q)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero1_with_a_rank_that_holds_no_parameter_matches_unsharded(tmp_path):
    spawn(_zero1_empty_rank_worker, (4, str(tmp_path / "store")), nprocs=4)


def _tp_dp_worker(rank: int, world: int, store_file: str):
    """TP=2 x DP=2 with SP and a KV head replicated on both TP ranks (n_kv_heads=1): ZeRO-1 on
    parallel.py's TP model against the unsharded optimizer on one full model."""
    import parallel
    _init_gloo(rank, world, store_file)
    try:
        for precision in ("fp32", "bf16_sr"):
            cfg = tiny_config(precision, grad_clip=0.5, lr=3e-3)
            cfg.model.n_kv_heads = 1
            cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.zero1 = 2, True, True
            grid = parallel.new_grid(world, rank, 2, 1, sharding.kv_replicas(cfg.model, 2), "gloo")
            assert grid.dp == 2 and grid.kv_group is not None
            model = seeded_model(cfg, grid).to(optim.param_dtype(precision))
            ref = tiny_model(cfg)
            opt, ref_opt = optim.build_optimizer(model, cfg, grid), optim.build_optimizer(ref, cfg)
            assert opt.zero1
            for step in range(3):
                tokens, targets = batch(step, n=4)
                mine = slice(2 * grid.dp_rank, 2 * grid.dp_rank + 2)
                loss = model(tokens[mine], targets=targets[mine])
                (loss * grid.dp / targets.numel()).backward()
                parallel.reduce_tp_replicated_gradients(model, grid)    # SP norms, KV copies: sum over TP
                norm = opt.reduce_scatter_and_clip(cfg.optim.grad_clip)
                opt.step()
                opt.zero_grad()
                ref_norm = reference_step(ref, ref_opt, tokens, targets, cfg.optim.grad_clip)
                if precision == "fp32":
                    assert abs(norm.item() - ref_norm.item()) < 1e-5 * ref_norm.item(), (norm, ref_norm)
            full = parallel.gather_full_state_dict(model, grid)
            if precision == "fp32":
                for n, q in ref.named_parameters():
                    assert (full[n] - q).abs().max().item() < 1e-6, n
            else:
                # copies must stay bitwise equal under SR: norm weights over TP, the KV head over its
                # replicas, and every weight over DP
                def same_over(t, group):
                    ts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
                    dist.all_gather(ts, t.contiguous(), group=group)
                    return all(torch.equal(ts[0], x) for x in ts)
                blk = model.layers[0]
                q_rows = blk.attn.qkv_proj.weight.q_rows
                assert same_over(blk.attn_norm.weight.float(), grid.tp_group)
                assert same_over(blk.attn.qkv_proj.weight[q_rows:].float(), grid.kv_group)
                assert not same_over(blk.attn.qkv_proj.weight[:q_rows].float(), grid.tp_group)
                for p in model.parameters():
                    assert same_over(p.float(), grid.dp_group)
                moved = (full["layers.0.attn.o_proj.weight"].float() - tiny_model(cfg).layers[0].attn.o_proj.weight.float())
                assert moved.abs().max() > 1e-3
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero1_tp2_dp2_matches_unsharded(tmp_path):
    spawn(_tp_dp_worker, (4, str(tmp_path / "store")), nprocs=4)


def test_second_optimizer_over_the_same_mixed_model():
    """Rebuilding the optimizer of a mixed model (a notebook, a changed config) leaves the first one's
    fp32-accumulation hook in place: the gradient is still accumulated once, without a traceback."""
    cfg = tiny_config("mixed")
    model, one = tiny_model(cfg), tiny_model(cfg)
    for _ in range(2):
        optim.build_optimizer(model, cfg)
    optim.build_optimizer(one, cfg)
    tokens, targets = batch(7)
    for m in (model, one):
        backward(m, tokens, targets)
        backward(m, tokens, targets)
    for p, q in zip(model.parameters(), one.parameters()):
        assert p.grad is None and torch.equal(p.main_grad, q.main_grad)


def _zero1_bucket_worker(rank: int, world: int, store_file: str):
    """DP=2, fp32, bucket caps 1 KB, 130 MB and none: each run's weights after 3 steps equal, bit
    for bit, one process applying the same AdamW to the same summed gradient; the buckets are the
    planned ones, each within the cap, in both collectives."""
    _init_gloo(rank, world, store_file)
    grid = Grid(world=world, rank=rank, dp=world, dp_rank=rank, dp_group=dist.new_group(list(range(world))))
    try:
        for cap in (1024, 130 * 2**20, 0):
            cfg = tiny_config("fp32", grad_clip=0.0, lr=3e-3)      # no clipping: bitwise is reachable
            cfg.parallel.zero1, cfg.parallel.zero1_bucket_mb = True, cap / 2**20
            model, ref = tiny_model(cfg), tiny_model(cfg)
            opt, ref_opt = optim.build_optimizer(model, cfg, grid), optim.build_optimizer(ref, cfg)
            n = sum(p.numel() for p in model.parameters())
            shard = -(-n // world)
            cols = shard if cap == 0 else min(shard, cap // (world * 4))
            want = [world * 4 * min(cols, shard - c) for c in range(0, shard, cols)]    # bytes per bucket
            assert len(opt.buckets) == len(want) == (-(-shard // 128) if cap == 1024 else 1), (cap, len(opt.buckets))
            said = f"{shard:,} elements of optimizer state a rank, {len(want):,} collective bucket"   # train.py's console
            most = f"at most {max(want) / 2**20:.3g} MB" if max(want) >= 2**20 else f"at most {max(want) / 2**10:.3g} KB"
            assert said in opt.describe() and opt.describe().endswith(most), (opt.describe(), most)
            for step in range(3):
                tokens, targets = batch(step, n=4)
                scale = targets.numel() / world           # the train.py rule: local sum * dp / global tokens
                with count_collectives() as log:
                    backward(model, tokens[2 * rank:2 * rank + 2], targets[2 * rank:2 * rank + 2], scale=scale)
                    opt.reduce_scatter_and_clip(cfg.optim.grad_clip)
                    gathered, alive, real = [], [], dist.all_gather_into_tensor
                    def watched(out, *a, **k):            # how many earlier buckets' outputs are still held
                        alive.append(sum(r() is not None for r in gathered))
                        gathered.append(weakref.ref(out))
                        return real(out, *a, **k)
                    dist.all_gather_into_tensor = watched
                    try:
                        opt.step()
                    finally:
                        dist.all_gather_into_tensor = real
                opt.zero_grad()
                for op in ("reduce_scatter", "all_gather"):
                    got = [nbytes for o, _, nbytes in log if o == op]
                    assert got == want and all(b <= (cap or b) for b in got), (cap, op, got, want)
                # one bucket in flight: each all-gather's output is written into the params and let go
                # (kept to the end, they held the whole local model: 88 of 89 at the last). A few may
                # linger: gloo's threads drop a finished collective's tensors a moment late.
                assert len(alive) == len(want) and max(alive) <= 8, (cap, alive)
                # one process: both halves' gradients, each scaled 1/DP and summed, as the reduce-scatter does
                halves = []
                for r in range(world):
                    backward(ref, tokens[2 * r:2 * r + 2], targets[2 * r:2 * r + 2], scale=scale)
                    halves.append([p.grad.clone() for p in ref.parameters()])
                    ref.zero_grad()
                for p, g0, g1 in zip(ref.parameters(), *halves):
                    p.grad = g0 * (1.0 / world) + g1 * (1.0 / world)
                ref_opt.step()
                ref_opt.zero_grad()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p, q), (cap, name, (p - q).abs().max().item())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_zero1_buckets_match_one_process_bitwise(tmp_path):
    spawn(_zero1_bucket_worker, (2, str(tmp_path / "store")), nprocs=2)


ZERO1_ON_XLA = r"""
import optim, parallel, train
from test_optim import tiny_config, tiny_model, batch
grid = parallel.Grid(dp=1, dp_group=dist.group.WORLD)
dev = torch_xla.device()
def trained(precision, zero1):
    cfg = tiny_config(precision)
    model = tiny_model(cfg).to(dev)
    named = list(model.named_parameters())
    opt = optim.Zero1AdamW(named, cfg.optim, grid, bucket_bytes=1024) if zero1 else optim.AdamW(named, cfg.optim, grid)
    for s in range(2):
        tok, tgt = batch(s)
        b = {"tokens": tok, "positions": torch.arange(tok.shape[1]).expand_as(tok), "targets": tgt}
        train.train_step(model, opt, [{k: v.to(dev) for k, v in b.items()}], grid, cfg, cut=torch_xla.sync)
        torch_xla.sync()
    return model, opt
ref, _ = trained("fp32", False)
model, opt = trained("fp32", True)                  # 1 KB buckets: many reduce-scatters and all-gathers
assert len(opt.buckets) > 4, len(opt.buckets)
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    assert torch.equal(p.cpu(), q.cpu()), f"{name}: ZeRO-1 on the xla backend is not AdamW's"
model, opt = trained("mixed", True)
kept = opt.masters()
for name, p in model.named_parameters():
    t = kept[id(p)]
    assert t.device == p.device, f"{name}: the master is on {t.device}, the param on {p.device}"
    parallel._all_gather(t, dist.group.WORLD, dim=0)           # the export's TP gather of it
    parallel.broadcast(t.clone(), 0, dist.group.WORLD)         # the pipeline's, over PP
# A ZeRO-1 rank holding no parameter: its zero was a CPU tensor, which the backend refuses ("Expected all tensors ...
# to be XLA tensors") once its all-reduce runs: in a world of one only with XLA_ALWAYS_ALLREDUCE (else a clone).
import os
os.environ["XLA_ALWAYS_ALLREDUCE"] = "1"
norm = parallel.global_norm([], grid, dev, over_dp=True)
assert norm.device == dev and norm.dtype == torch.float32 and norm.cpu().item() == 0.0, norm.device
print("ok", len(kept))
"""


@pytest.mark.slow
def test_zero1_runs_on_the_xla_backend_and_its_masters_are_device_tensors():
    """ZeRO-1's bucketed reduce-scatters and all-gathers through the real xla backend (ProcessGroupXla, in a world of
    one on XLA:CPU: its own checks of operands), 2 steps equal to AdamW's bit for bit in fp32. And a mixed ZeRO-1 run's
    export (TP > 1 or PP > 1, up to 1B) gathers each param's fp32 master over TP (broadcasts it over PP): masters()
    handed them on the host, as it cuts them there, and the xla backend takes only XLA tensors: 'RuntimeError: Expected
    XLA tensor. Got: torch.FloatTensor' after the whole run. They now go back to the device (a transfer each, no
    graph), as AdamW's are."""
    from conftest import run_in_xla_world_of_one
    run_in_xla_world_of_one(ZERO1_ON_XLA)
