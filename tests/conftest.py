"""What the test files share: the repository on sys.path, and the helpers that two files each
defined for themselves.

Two tiers (the `slow` marker is registered in pytest.ini):
    make test-fast    pytest -m "not slow": every module, in-process, under 2 minutes on 2 cores
    make test         everything: also the tests marked @pytest.mark.slow, which start processes that
                      load torch (train.py, torchrun, gloo worlds of 2-8 ranks, XLA) or soak
"""
import contextlib
import inspect
import os
import re
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The session's forkserver (gloo_spawn's worlds, prepare.py's worker pools) preloads what its children import:
# a spawned gloo worker's fresh interpreter spent ~3 s of CPU on torch and pytest (8 workers for test_pipeline's
# world alone, ~30 in the suite); torch._dynamo (and sympy), ~1.5 s more, is imported on first use by a worker
# that steps torch.optim (the tests' reference) or checkpoints activations; prepare and pandas (pyarrow's
# pa.array imports it), ~1.1 s of CPU a pool of 2 prepare workers (~15 pools in the fast tier). The server is
# a fresh interpreter that imported and ran nothing else (none of these starts a thread): forking it is safe.
# Set here, not where it is first used, so that it holds whichever file starts the server.
torch.multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["torch", "torch.distributed", "torch._dynamo", "pytest", "prepare", "pandas"])

# XLA:CPU compiles at LLVM -O0 in the tests, in this process and in every child: compiling is most of
# an XLA test's time (-O0 takes ~40% less CPU), and what the tests check (graphs, their counts and HLO,
# host reads, losses within 1e-4) does not depend on how fast XLA:CPU's code runs (Trainium's is
# neuronx-cc's). A user's own XLA_FLAGS are kept.
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# The environment as the session got it, read before any test module is imported. Importing
# torch_xla sets PJRT_DEVICE=CPU (and XLA_FLAGS, ...) in os.environ: test_tied.py and test_data.py do
# in a test (test_xla.py did at collection). hardware.pick_device follows PJRT_DEVICE (--device=auto), so
# a later train.main in this process, or a train.py child that inherits it, ran on XLA:CPU instead of
# CPU depending on which files were collected or ran first; after a CPU backward, in-process XLA
# fails (test_model, test_tied, then test_bad_input: an autograd engine INTERNAL ASSERT).
SESSION_ENV = dict(os.environ)


def restore_environ():
    """os.environ as SESSION_ENV, but for pytest's own PYTEST_CURRENT_TEST (it sets and deletes it)."""
    for k in set(os.environ) - set(SESSION_ENV) - {"PYTEST_CURRENT_TEST"}:
        del os.environ[k]
    os.environ.update(SESSION_ENV)


@pytest.fixture(autouse=True, scope="session")
def _session_environ():
    """Undo what collection set (torch_xla's import) before the first test and its fixtures."""
    restore_environ()


@pytest.fixture(autouse=True)
def _environ():
    """Undo what a test set (an in-process import of torch_xla) before the next one's fixtures. A test that
    changes torch's thread count restores it: the tests after it in the session would run on its count."""
    threads = torch.get_num_threads()
    yield
    restore_environ()
    assert torch.get_num_threads() == threads, f"the test left torch at {torch.get_num_threads()} threads, not {threads}"


# The session's one data cache, passed to every train.py run as --data.cache_dir (gloo_spawn.run_train
# adds it): the default, .cache in the cwd, is the repository's, which `make test` must leave as it
# found it. Shared, so the embedded corpus's tokenizer is trained once per session (the cache's
# .lock files make concurrent runs safe).
SESSION_CACHE: list[str] = []


@pytest.fixture(autouse=True, scope="session")
def _session_cache(tmp_path_factory):
    SESSION_CACHE.append(str(tmp_path_factory.mktemp("cache")))


def cache_arg() -> str:
    """--data.cache_dir=the session's cache folder (for a train.py command line or train.main)."""
    return f"--data.cache_dir={SESSION_CACHE[-1]}"


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference, relative to b's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max()).item()


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference loss on whole logits: the sum of token cross-entropies, -100 ignored (what
    model.LinearCrossEntropy computes fused, without the logits)."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                             reduction="sum")


def load_hf(folder: str, **overrides):
    """Our Llama, one process, from a Hugging Face folder: the loading path of a run
    (--init_from: hf.read_config, then hf.load_sharded into the model) at TP 1."""
    import hf
    import model
    cfg = hf.read_config(folder, **overrides)
    m = model.Llama(cfg)
    hf.load_sharded(m, folder, cfg)
    return m


def assert_close(got: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 1e-5):
    """got equals ref up to tol x ref's max-abs (a layout against its single-process reference)."""
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err, scale = (got - ref).abs().max().item(), ref.abs().max().item()
    assert err <= tol * scale, f"{what}: max-abs error {err:.3e} > {tol} x {scale:.3e}"


def packed_batch(step: int, n: int, seq: int, vocab: int = 97) -> dict:
    """A step's whole batch of n sequences: sequence i has its first 2*i targets ignored (-100), so
    DP ranks hold different numbers of valid tokens, and two packed documents (positions restart,
    document mask)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, vocab, (n, seq), generator=g)
    targets = torch.randint(0, vocab, (n, seq), generator=g)
    cut = torch.tensor([4 + i % 8 for i in range(n)])[:, None]
    ar = torch.arange(seq)[None]
    targets[ar < 2 * torch.arange(n)[:, None]] = -100
    doc_ids = (ar >= cut).long()
    return {"tokens": tokens, "targets": targets, "positions": ar - cut * doc_ids, "doc_ids": doc_ids}


def seeded_model(cfg, grid, device="cpu", build=None, dtype=None):
    """A fresh run's model as train.py makes it: built empty (parallel.build_model, or `build`:
    pipeline.build_model), initialized from cfg.seed, moved to the device."""
    import parallel
    model = (build or parallel.build_model)(cfg, grid, device, dtype=dtype)
    return parallel.move_model(parallel.init_weights(model, cfg, grid), device)


@torch.no_grad()
def load_full_state_dict(model, full_sd: dict, grid) -> None:
    """This rank's shard of full-shape weights copied into the model (sharding.cut): the inverse of
    parallel.gather_full_state_dict, which the layout tests check."""
    import sharding
    params = model.state_dict(keep_vars=True)           # tied: both names, as state_dict
    assert params.keys() == full_sd.keys(), sorted(params.keys() ^ full_sd.keys())
    for name, p in params.items():
        p.copy_(sharding.cut(name, full_sd[name].to(p.device, p.dtype), model.cfg, grid.tp, grid.tp_rank))


def mixture_counts(loader, n_batches: int | None = None):
    """Windows per source in the first n_batches global batches of every stream of a PackedLoader (default: the
    windows a stream has handed out), recounted from the hash: the reference for what the DP ranks'
    stats()["windows_by_source"] sum to, which train.py logs (global_batch x n_batches hashes)."""
    import numpy as np
    per = len(loader.lanes) * loader.lanes_max      # a stream's lanes (global_lane): their windows, summed
    n_batches = sum(p["stats"]["windows"] for k, p in loader.state_dict()["streams"].items()
                    if int(k) // per == loader.streams[0]) if n_batches is None else n_batches
    counts = np.zeros(len(loader.lanes), np.int64)
    for b0 in range(0, n_batches, 4096):
        b = np.arange(b0, min(n_batches, b0 + 4096))
        g, _ = loader.draw_source_and_lane(np.arange(loader.n_streams)[:, None], b[None, :])
        counts += np.bincount(g.ravel(), minlength=len(loader.lanes))
    return counts


class FixedLoader:
    """The held-out loader's interface as train.evaluate uses it: reset(), then next()."""
    def __init__(self, batches):
        self.batches, self.i = batches, 0

    def reset(self):
        self.i = 0

    def __next__(self):
        self.i += 1
        return self.batches[self.i - 1]


@contextlib.contextmanager
def count_collectives():
    """with count_collectives() as log: the (op, group, bytes) of every all-reduce, all-gather and
    reduce-scatter the block issues, torch.distributed's functions wrapped for its duration. Bytes:
    the all-reduced tensor, the gathered output, the scattered input."""
    log, real = [], {}
    for name, op, arg in (("all_reduce", "all_reduce", "tensor"), ("reduce_scatter_tensor", "reduce_scatter", "input"),
                          ("all_gather_into_tensor", "all_gather", "output_tensor")):
        real[name] = getattr(dist, name)
        sig = inspect.signature(getattr(dist.distributed_c10d, name))

        def counted(*a, _call=real[name], _op=op, _arg=arg, _sig=sig, **k):
            bound = _sig.bind(*a, **k).arguments
            t = bound[_arg]
            log.append((_op, bound.get("group"), t.numel() * t.element_size()))
            return _call(*a, **k)
        setattr(dist, name, counted)
    try:
        yield log
    finally:
        for name, f in real.items():
            setattr(dist, name, f)


def as_plain_user() -> list[str]:
    """The command prefix that takes away root's bypass of file permissions: setpriv drops the capabilities that
    grant it (the venv under /root stays readable, as `nobody` could not read it); a non-root user: as is."""
    import shutil
    import subprocess
    if os.geteuid() != 0:
        return []
    cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", "--"]
    if not shutil.which("setpriv") or subprocess.run([*cmd, "true"], capture_output=True).returncode != 0:
        pytest.skip("root without a working setpriv: file permissions cannot be made to apply to this process")
    return cmd


XLA_WORLD_OF_ONE = """import sys, torch, torch_xla, torch.distributed as dist, torch_xla.distributed.xla_backend
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
dist.init_process_group("xla", init_method="xla://")     # a world of one: the xla backend's own operand checks
"""


def run_in_xla_world_of_one(code: str) -> None:
    """code in a fresh process on XLA:CPU whose default group is the REAL xla backend (ProcessGroupXla) in a world of
    one: multi-process XLA does not run on CPU, but every collective still passes through the backend's own checks
    (it takes XLA tensors only), which gloo never makes. code prints "ok" at its end."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    r = subprocess.run([sys.executable, "-c", XLA_WORLD_OF_ONE + code, root], capture_output=True, text=True, env=env,
                       timeout=300, cwd=root)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


def help_flags(out: str) -> dict[str, str]:
    """An argparse --help's options as {flag: its help text}, wrapped lines joined, names and metavar left out."""
    options = out.split("options:\n")[1].split("\n\n")[0]
    blocks = re.split(r"\n  (?=-)", "\n" + options)[1:]
    return {b.split()[0].rstrip(","): re.sub(r"^(-\S+,? )+(\{\S+\}|[A-Z_:]+)? *", "", " ".join(b.split()))
            for b in blocks}
