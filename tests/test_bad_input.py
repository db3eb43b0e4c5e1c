"""Bad input, table-driven: every entry point (train.py, data.py, checkpoint.py, configs.py, plan.py)
given something a user could type. Each case asserts the exit code, that the one-line message names
the offending value, that no traceback is printed, that nothing was trained or built when the
input could be refused early, and that every file that existed before is byte-identical after.
Cases run in-process through each command line's own main() (SystemExit and stderr captured);
only Ctrl-C and one plain launch spawn a real Python."""
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import time

import numpy as np
import pyarrow as pa
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import checkpoint  # noqa: E402
import eks  # noqa: E402
import healthcheck  # noqa: E402
from benchmarks import cli as bench  # noqa: E402
import configs  # noqa: E402
import corpus  # noqa: E402
import data  # noqa: E402
import parallel  # noqa: E402
import pipeline  # noqa: E402
import plan  # noqa: E402
import prepare  # noqa: E402
import monitor  # noqa: E402
import train  # noqa: E402

VOCAB = 512
TINY = ["--model.n_layers=1", "--model.dim=32", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_dim=64",
        "--seq_len=32", "--model.max_seq_len=32", "--global_batch=2", "--micro_batch=2", f"--model.vocab_size={VOCAB}",
        "--log.eval_interval=0", "--log.sample_tokens=0", "--log.peak_tflops=1", "--log.tensorboard=",
        "--ckpt.async_save=false", "--optim.warmup_steps=1", "--steps=2"]


def write_arrow(path, table):
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)


@pytest.fixture(scope="module")
def W(tmp_path_factory):
    """The shared files the cases point at: a corpus, its tokenizer, a checkpoint, and bad files."""
    w = tmp_path_factory.mktemp("bad_input")
    stdlib = sysconfig.get_paths()["stdlib"]
    (w / "corpus").mkdir()
    for name in ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py",
                 "keyword.py", "colorsys.py", "getopt.py", "this.py", "copy.py"):
        shutil.copy(os.path.join(stdlib, name), w / "corpus" / name)
    cfg = configs.DataConfig(data=str(w / "corpus"), cache_dir=str(w / "tokcache"))
    tok = data.build_tokenizer(cfg, VOCAB)
    shutil.copy(tok.path, w / "tok.model")
    shutil.copy(data.build_tokenizer(cfg, 1024).path, w / "tok1024.model")      # another model's
    (w / "other").mkdir()                           # another corpus: a "new" one for continuing a run
    for name in ("pprint.py", "difflib.py", "calendar.py", "locale.py", "gettext.py"):
        shutil.copy(os.path.join(stdlib, name), w / "other" / name)
    other = configs.DataConfig(data=str(w / "other"), cache_dir=str(w / "tokcache"))
    shutil.copy(data.build_tokenizer(other, VOCAB).path, w / "tokother.model")   # the new corpus's own
    # A finished tiny run: its checkpoint and its export.
    run = [*TINY, f"--data={w}/corpus", f"--data.tokenizer={w}/tok.model", f"--out_dir={w}/run",
           f"--ckpt.dir={w}/run/ckpt", f"--data.cache_dir={w}/tokcache"]
    train.main(run)
    assert os.path.exists(w / "run" / "hf" / "config.json")
    # Bad files.
    (w / "afile").write_text("a plain file\n")
    (w / "emptydir").mkdir()
    (w / "empties").mkdir()
    (w / "empties" / "a.txt").write_text("")
    (w / "empties" / "b.txt").write_text("   \n\n")
    os.mkfifo(w / "fifo.txt")
    os.symlink(w / "nowhere", w / "dangling")      # a symbolic link to nothing: not "nothing there"
    rng = np.random.default_rng(0)
    (w / "random.arrow").write_bytes(rng.bytes(100_000))
    (w / "random.parquet").write_bytes(rng.bytes(50_000))
    (w / "binary.txt").write_bytes(rng.bytes(300_000))
    (w / "utf16.txt").write_bytes((w / "corpus" / sorted(os.listdir(w / "corpus"))[0]).read_text().encode("utf-16"))
    (w / "random.model").write_bytes(rng.bytes(5_000))
    write_arrow(w / "good.arrow", pa.table({"text": ["def f(x):\n    return x\n" * 50] * 40}))
    (w / "truncated.arrow").write_bytes((w / "good.arrow").read_bytes()[:3000])
    write_arrow(w / "notext.arrow", pa.table({"body": ["hello"] * 10}))
    write_arrow(w / "intcol.arrow", pa.table({"text": list(range(10))}))
    (w / "notjson.jsonl").write_text("this is not json\n")
    (w / "nofield.jsonl").write_text('{"content": "hello"}\n')
    (w / "table.csv").write_text("a,b\n1,2\n")
    (w / "ready.arrow").write_bytes((w / "good.arrow").read_bytes())
    (w / "hfout").mkdir()
    (w / "hfout" / "config.json").write_text('{"model_type": "llama"}')
    (w / "hfout" / "model.safetensors").write_bytes(b"weights")
    (w / "usersdir").mkdir()                        # a user's folder: an export of theirs and their notes
    shutil.copytree(w / "run" / "hf", w / "usersdir", dirs_exist_ok=True)
    (w / "usersdir" / "notes.txt").write_text("what this model is")
    (w / "prev").mkdir()                            # an earlier run's export, and no checkpoint
    (w / "killed").mkdir()                          # a run's --out_dir, killed before its export: checkpoints only
    os.symlink(w / "run" / "ckpt", w / "killed" / "ckpt")
    shutil.copytree(w / "run" / "hf", w / "prev" / "hf")
    (w / "bad.txt.gz").write_bytes(b"not gzip at all")
    # --init_from folders: the run's export with one thing wrong.
    conf = json.loads((w / "run" / "hf" / "config.json").read_text())
    rope = {"rope_type": "llama3", "factor": 8.0}
    for name, text in (("notjson", "{not json"), ("list", "[1, 2]"), ("latin1", b"\xff\xfe{}"),
                       *[(n, json.dumps({k: v for k, v in {**conf, **change}.items() if v is not None}))
                         for n, change in (("nohidden", {"hidden_size": None}), ("zeroheads", {"num_attention_heads": 0}),
                                           ("strdim", {"hidden_size": "32"}), ("ropepart", {"rope_scaling": rope}),
                                           ("twolayers", {"num_hidden_layers": 2}))]):
        shutil.copytree(w / "run" / "hf", w / f"init_{name}")
        (w / f"init_{name}" / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    shutil.copytree(w / "run" / "hf", w / "init_truncated")
    f = w / "init_truncated" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:3000])
    shutil.copytree(w / "run" / "hf", w / "init_badindex")
    (w / "init_badindex" / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    os.remove(w / "init_badindex" / "model.safetensors")       # else read first, as transformers does
    shutil.copytree(w / "run" / "hf", w / "init_noweights")
    os.remove(w / "init_noweights" / "model.safetensors")
    return w


def snapshot(*roots) -> dict:
    out = {}
    for root in roots:
        for d, _, files in os.walk(root):
            for f in files:
                p = os.path.join(d, f)
                if os.path.isfile(p) and not os.path.islink(p):
                    out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


class Spy:
    """Counts the expensive work a case must not reach: tokenizer training and model building.
    The real functions run: only the calls are counted."""

    def __init__(self, monkeypatch):
        self.calls = []
        for owner, name in ((corpus.spm.SentencePieceTrainer, "train"), (parallel, "build_model"),
                            (pipeline, "build_model")):
            real = getattr(owner, name)
            monkeypatch.setattr(owner, name, self._wrap(f"{getattr(owner, '__name__', owner)}.{name}", real))

    def _wrap(self, label, real):
        def spy(*a, **k):
            self.calls.append(label)
            return real(*a, **k)
        return staticmethod(spy) if label.startswith("SentencePieceTrainer") else spy


ENTRY = {"train": train.cli, "data": data.main, "checkpoint": checkpoint.main, "configs": configs.main,
         "plan": plan.main, "bench": bench.main, "eks": eks.main, "health": healthcheck.main}


def run_entry(entry, argv, capsys):
    """(exit code, everything written to stderr and stdout plus the exit message)."""
    with pytest.raises(SystemExit) as e:
        ENTRY[entry](argv)
    cap = capsys.readouterr()
    code = e.value.code
    text = cap.err + cap.out + ("" if code is None or isinstance(code, int) else str(code))
    return (code if isinstance(code, int) else 1), text


def T(*args):
    """train.py with the tiny model, writing only inside the case's own directory {t}."""
    return ("train", [*TINY, "--data={W}/corpus", "--data.tokenizer={W}/tok.model", "--out_dir={t}/out",
                      "--ckpt.dir={t}/out/ckpt", "--data.cache_dir={t}/cache", *args])


def CK(*args, data="{W}/corpus", tok="{W}/tok.model"):
    """train.py continuing the finished run's checkpoints (copied to {t}/ck), writing only inside {t}."""
    return ("train", [*TINY, f"--data={data}", f"--data.tokenizer={tok}", "--out_dir={t}/o", "--ckpt.dir={t}/ck",
                      "--data.cache_dir={t}/c", "--steps=3", *args])


def TI(*args):
    """train.py from a Hugging Face folder (--init_from sets the model: no --model.* key)."""
    run = [a for a in TINY if not a.startswith("--model.")]
    return ("train", [*run, "--data={W}/corpus", "--out_dir={t}/out", "--data.cache_dir={t}/cache", *args])


# (id, (entry, argv), strings the message must hold, exit code, refused before any tokenizer or model)
CASES = [
    # ---- train.py: every numeric key's domain
    *[(f"domain:{a}", T(a), [a.split("=")[0], a.split("=")[1]], 1, True) for a in (
        "--model.n_heads=0", "--model.n_kv_heads=0", "--model.dim=0", "--model.n_layers=0", "--model.vocab_size=0",
        "--model.ffn_dim=-1", "--model.max_seq_len=0", "--model.rope_theta=0.0", "--model.norm_eps=-1e-05",
        "--model.init_std=0.0", "--parallel.tp=0", "--parallel.pp=0", "--parallel.dp=0", "--parallel.dp=-2",
        "--data.micro_batch=0", "--data.global_batch=0", "--data.seq_len=0", "--log.interval=0",
        "--log.eval_windows=0", "--log.eval_interval=-1", "--log.sample_tokens=-1", "--log.peak_tflops=-1.0",
        "--seed=-1", "--seed=4294967296", "--data.seed=-5", "--optim.beta1=1.0", "--optim.beta2=1.5",
        "--optim.beta1=-0.1", "--optim.lr=0.0", "--optim.lr=nan", "--optim.lr=inf", "--optim.eps=0.0",
        "--optim.min_lr=-1.0", "--optim.weight_decay=-0.1", "--optim.grad_clip=-1.0", "--optim.warmup_steps=-1",
        "--optim.decay_steps=-5", "--optim.constant_steps=-1", "--optim.max_steps=0", "--ckpt.interval=-1",
        "--ckpt.keep=-1", "--data.val_fraction=1.0", "--data.val_fraction=-0.1", "--parallel.cores=-32",
        "--data.shuffle=0", "--data.shuffle=-1",
        # beyond a float (shown as 0.0 or inf, not as typed), and a positive value float32 holds as 0 (eps: every
        # parameter with a zero gradient became 0/0 = NaN at step 1, "non-finite loss ... lower --optim.lr" at 2)
        "--optim.eps=1e-400", "--optim.lr=1e400", "--model.norm_eps=-1e-999", "--optim.eps=1e-50",
        "--model.norm_eps=1e-46", "--model.init_std=1e-50", "--optim.lr=1e-50")],
    ("min_lr above lr", T("--optim.min_lr=0.5"), ["--optim.min_lr=0.5", "lower min_lr"], 1, True),
    # nothing held out, evaluation on: was refused after a tokenizer was trained and the checkpoint directory claimed
    ("no held-out text", ("train", ["--data.val_fraction=0", "--log.eval_interval=1", "--out_dir={t}/o",
                                    "--data.cache_dir={t}/c", "--log.tensorboard="]),
     ["--data.val_fraction=0", "--log.eval_interval=0"], 1, True),
    *[(f"empty:{k}", T(f"--{k}="), [f"--{k}", "empty"], 1, True)
      for k in ("data.text_field", "data.data", "out_dir", "ckpt.dir", "data.cache_dir")],
    # ---- train.py: types, names, choices
    ("not an int", T("--model.n_layers=two"), ["--model.n_layers", "'two'", "int"], 1, True),
    ("not a float", T("--optim.lr=fast"), ["--optim.lr", "'fast'"], 1, True),
    ("not a bool", T("--sp=maybe"), ["--parallel.sp", "'maybe'"], 1, True),
    ("bad choice", T("--optim.precision=fp16"), ["fp16", "bf16_sr"], 1, True),
    ("unknown key", T("--model.n_layer=4"), ["--model.n_layer", "did you mean --model.n_layers"], 1, True),
    ("unknown preset", ("train", ["--preset=llama2_7B"]), ["llama2_7B", "llama2_7b"], 1, True),
    ("preset without name", ("train", ["--preset"]), ["--preset needs a name"], 1, True),
    ("preset twice", ("train", ["--preset=tiny", "--preset=llama2_7b"]), ["--preset tiny", "--preset=llama2_7b",
                                                                         "give one preset"], 1, True),
    ("stray argument", T("foo"), ["'foo'", "--model.n_layers=4"], 1, True),
    # a bare flag is a bool's true; any other key's was "--model.dim='true': expected an int", a value never typed
    *[(f"bare {a}", T(a), [f"--{k} was given no value", f"--{k}=VALUE"], 1, True)
      for a, k in (("--model.dim", "model.dim"), ("--data", "data.data"))],
    # ---- train.py: the model's shape and the layout
    ("tp splits heads", T("--tp=3"), ["n_heads 2", "tp 3"], 1, True),
    ("dim by heads", T("--model.dim=30", "--model.n_heads=4"), ["--model.dim=30", "--model.n_heads=4"], 1, True),
    ("odd head_dim", T("--model.dim=24", "--model.n_heads=8", "--model.n_kv_heads=8"), ["head_dim 3", "dim 24"], 1, True),
    ("kv groups", T("--model.n_kv_heads=3", "--model.n_heads=4"), ["--model.n_kv_heads=3"], 1, True),
    ("pp above layers", T("--pp=2"), ["--pp=2", "--model.n_layers=1"], 1, True),
    ("pp_cuts", T("--model.n_layers=4", "--pp=2", "--parallel.pp_cuts=x"), ["'x'"], 1, True),
    ("pp_cuts without pp", T("--model.n_layers=2", "--parallel.pp_cuts=1"), ["'1'", "--pp=1"], 1, True),
    ("seq above max", T("--seq_len=64"), ["--seq_len=64", "--model.max_seq_len=32"], 1, True),
    ("batch split", T("--global_batch=3"), ["global batch 3", "micro_batch*dp = 2*1"], 1, True),
    ("dp vs world", T("--dp=2"), ["--dp=1"], 1, True),
    ("no cuda", T("--device=cuda"), ["--device=cuda"], 1, True),
    # ---- train.py: sizes that must fit in memory
    ("vocab 1e9", ("train", ["--model.vocab_size=1000000000", "--out_dir={t}/o", "--ckpt.dir={t}/o/c",
                             "--data.cache_dir={t}/c", "--log.tensorboard="]),
     ["1,000,000,000-piece", "--model.vocab_size=65536 or less"], 1, True),     # a tokenizer to train: that bound first
    ("dim 2^20", T("--model.dim=1048576", "--model.n_heads=2", "--model.max_seq_len=32"),
     ["--model.dim=1048576", "does not fit"], 1, True),
    ("head dim 2^30", T("--model.head_dim_override=1073741824", "--model.n_kv_heads=2"),
     ["does not fit", "its largest weight, an attention weight (--model.n_heads=2 x head dim 1073741824 x --model.dim=32), "
      "alone 256.0 GiB"], 1, True),
    # ---- train.py: every path's kind
    ("out_dir is a file", T("--out_dir={W}/afile"), ["--out_dir", "afile", "is a file"], 1, True),
    ("ckpt.dir is a file", T("--ckpt.dir={W}/afile"), ["--ckpt.dir", "afile", "is a file"], 1, True),
    ("tensorboard is a file", T("--log.tensorboard={W}/afile"), ["--log.tensorboard", "afile"], 1, True),
    ("cache_dir is a file", T("--data.cache_dir={W}/afile"), ["--data.cache_dir", "afile"], 1, True),
    ("parent is a file", T("--out_dir={W}/afile/sub"), ["afile", "not a directory"], 1, True),
    ("ckpt.dir is a FIFO", T("--ckpt.dir={W}/fifo.txt"), ["fifo.txt", "a FIFO"], 1, True),
    ("tokenizer missing", T("--data.tokenizer={W}/nope.model"), ["nope.model", "missing"], 1, True),
    ("tokenizer folder without one", T("--data.tokenizer={W}/emptydir"), ["emptydir", "neither tokenizer.model"], 1, True),
    ("tokenizer is a FIFO", T("--data.tokenizer={W}/fifo.txt"), ["fifo.txt", "a FIFO"], 1, True),
    # ---- train.py: data that cannot be used
    ("data missing", T("--data={W}/nope.txt"), ["nope.txt", "does not exist"], 1, True),
    ("data is a FIFO", T("--data={W}/fifo.txt"), ["fifo.txt", "a FIFO"], 1, True),
    ("data type", T("--data={W}/table.csv"), ["table.csv", "unsupported file type"], 1, True),
    ("data dir without files", T("--data={W}/emptydir"), ["emptydir", "holds no"], 1, True),
    ("data only empty files", T("--data={W}/empties"), ["0 tokens", "empties"], 1, True),
    ("random .arrow", T("--data={W}/random.arrow"), ["random.arrow", "not a valid .arrow file"], 1, True),
    ("truncated .arrow", T("--data={W}/truncated.arrow"), ["truncated.arrow", "not a valid .arrow"], 1, True),
    ("random .parquet", T("--data={W}/random.parquet"), ["random.parquet", "not a valid .parquet"], 1, True),
    ("arrow without text", T("--data={W}/notext.arrow"), ["notext.arrow", "'text'", "--data.text_field"], 1, True),
    ("arrow int column", T("--data={W}/intcol.arrow"), ["intcol.arrow", "int64"], 1, True),
    ("jsonl not json", T("--data={W}/notjson.jsonl"), ["notjson.jsonl:1", "not JSON"], 1, True),
    ("jsonl without field", T("--data={W}/nofield.jsonl"), ["nofield.jsonl:1", "'text'", "content"], 1, True),
    ("binary corpus", ("train", ["--data={W}/binary.txt", "--out_dir={t}/o", "--ckpt.dir={t}/o/c",
                                 "--data.cache_dir={t}/c", "--log.tensorboard="]),
     ["binary.txt", "invalid UTF-8"], 1, True),
    ("utf-16 corpus", T("--data={W}/utf16.txt"), ["utf16.txt", "is UTF-16 text", "iconv -f UTF-16 -t UTF-8"], 1, True),
    ("vocab above corpus", ("train", [*TINY[:-8], "--model.vocab_size=60000", "--model.max_seq_len=32",
                                      "--data={W}/corpus", "--out_dir={t}/o", "--ckpt.dir={t}/o/c",
                                      "--data.cache_dir={t}/c", "--log.tensorboard="]),
     ["60000", "lower --model.vocab_size"], 1, False),
    ("eval windows above corpus", T("--log.eval_windows=1000000", "--log.eval_interval=1"),
     ["--log.eval_windows=1000000", "lower --log.eval_windows"], 1, True),
    ("random tokenizer", T("--data.tokenizer={W}/random.model"), ["random.model", "not a sentencepiece"], 1, True),
    ("tokenizer below vocab", T("--model.vocab_size=4096"), ["tok.model", "512 pieces", "4096",
                                                             "--model.vocab_size=512"], 1, True),
    ("tokenizer above vocab", T("--model.vocab_size=128"), ["tok.model", "512 pieces", "128"], 1, True),
    ("seq_len above corpus", T("--seq_len=30000", "--model.max_seq_len=30000", "--global_batch=64",
                               "--micro_batch=1"), ["seq_len 30000", "tokens"], 1, True),    # (64 x 30000^2 masks: no memory)
    # ---- train.py: nothing of an earlier run overwritten
    ("earlier export", ("train", [*TINY, "--data={W}/corpus", "--data.tokenizer={W}/tok.model",
                                  "--out_dir={W}/prev", "--ckpt.dir={t}/ckpt", "--data.cache_dir={t}/c"]),
     ["prev/hf", "move it away"], 1, True),
    ("resume=false over checkpoints", ("train", [*TINY, "--data={W}/corpus", "--data.tokenizer={W}/tok.model",
                                                 "--out_dir={t}/o", "--ckpt.dir={W}/run/ckpt", "--ckpt.resume=false",
                                                 "--data.cache_dir={t}/c"]),
     ["--ckpt.resume=false", "run/ckpt", "another --out_dir"], 1, True),
    ("ckpt.dir is the export folder", T("--ckpt.dir={t}/out/hf"), ["--ckpt.dir", "inside the export folder"], 1, True),
    # inside a step folder of the checkpoint directory: a save wrote into it, pruning deleted it; an export there made the
    # next run refuse the folder as "named like a checkpoint but not nanotrn's" (fuzz)
    *[(f"{k} in a checkpoint's folder", T(f"--{k}={{t}}/out/ckpt/step_00000002/x"),
       [f"--{k}=", "out/ckpt/step_00000002", "deleted when it is pruned"], 1, True)
      for k in ("log.tensorboard", "data.cache_dir", "out_dir")],
    ("tensorboard in the export folder", T("--log.tensorboard={t}/out/hf/tb"), ["--log.tensorboard", "out/hf"], 1, True),
    ("fault spec", T(), ["NANOTRN_FAULT='boom'"], 1, True),
    ("start_fresh while resuming", T("--ckpt.start_fresh"), ["--ckpt.start_fresh", "--ckpt.resume=false"], 1, True),
    # ---- train.py: a checkpoint directory holding what is not nanotrn's, or nothing valid (issue 25)
    ("ckpt: foreign step folder", CK(), ["ck/step_00000009", "not nanotrn's", "Move it out"], 1, True),
    ("ckpt: foreign latest", CK(), ["ck/latest is not nanotrn's `latest` pointer"], 1, True),
    # a file where the run keeps its tokenizer: was "could not keep the tokenizer ...: free space", after it loaded
    *[(f"ckpt: foreign tokenizer file{' (fresh)' * fresh}", CK(),
       ["ck/tokenizer is a file, not a folder", "Move it out of the checkpoint directory"], 1, True) for fresh in (0, 1)],
    ("ckpt: only checkpoint damaged", CK(),
     ["holds no valid checkpoint", "step_00000002", "--ckpt.resume=false --ckpt.start_fresh"], 1, False),
    ("ckpt: a user's tokenizer folder (fresh)", ("train", [*TINY, "--data={W}/corpus", "--data.tokenizer={W}/tok.model",
                                                          "--out_dir={t}/o", "--ckpt.dir={t}/ck", "--data.cache_dir={t}/cache"]),
     ["ck/tokenizer/tokenizer.model is not this run's tokenizer", "move that folder out"], 1, True),
    ("ckpt: only the checkpoints, no kept tokenizer", ("train", [*TINY, "--data={W}/corpus", "--out_dir={t}/o",
                                                                "--ckpt.dir={t}/ck", "--data.cache_dir={t}/cache", "--steps=3"]),
     ["/ck/tokenizer", "--data.tokenizer="], 1, True),      # was: a tokenizer trained now, silently
    # ---- train.py: resuming as something else (a model exists by then: not early)
    ("resume other precision", CK("--precision=bf16"), ["--optim.precision=fp32", "bf16", "another --out_dir"], 1, False),
    ("resume other model", CK("--model.n_layers=2"), ["model.n_layers: checkpoint 1, now 2", "another --out_dir"], 1, False),
    ("new corpus, same layout", CK(data="{W}/other"), ["corpus=", "--ckpt.reset_data"], 1, False),
    ("new corpus, new tokenizer", CK("--ckpt.reset_data", data="{W}/other", tok="{W}/tokother.model"),
     ["trained with the tokenizer", "--data.tokenizer=", "ck/tokenizer/tokenizer.model"], 1, False),
    # ---- train.py --init_from: a folder that is not a Llama export, refused before any work
    ("init: no such folder", TI("--init_from={W}/no/such/folder"),     # was: 'has no config.json'
     ["--init_from={W}/no/such/folder does not exist", "save_pretrained"], 1, True),
    ("init: config not JSON", TI("--init_from={W}/init_notjson"), ["init_notjson/config.json", "not a readable JSON"], 1, True),
    ("init: config a list", TI("--init_from={W}/init_list"), ["init_list/config.json", "JSON list"], 1, True),
    ("init: config not UTF-8", TI("--init_from={W}/init_latin1"), ["init_latin1/config.json", "utf-8"], 1, True),
    ("init: no hidden_size", TI("--init_from={W}/init_nohidden"), ["init_nohidden/config.json", "no hidden_size"], 1, True),
    ("init: zero heads", TI("--init_from={W}/init_zeroheads"), ["num_attention_heads=0", ">= 1"], 1, True),
    ("init: dim a string", TI("--init_from={W}/init_strdim"), ["hidden_size='32'", "whole number"], 1, True),
    ("init: llama3 rope incomplete", TI("--init_from={W}/init_ropepart"), ["low_freq_factor", "incomplete"], 1, True),
    ("init: weights truncated", TI("--init_from={W}/init_truncated"), ["init_truncated", "cannot read its weights"], 1, True),
    ("init: bad index", TI("--init_from={W}/init_badindex"), ["model.safetensors.index.json", "not a safetensors index"],
     1, True),
    *[(f"init: a nanotrn checkpoint {what}", TI(f"--init_from={{W}}/run/ckpt{sub}"),       # was: only 'give a Hugging Face folder'
       ["has no config.json", "--ckpt.dir={W}/run/ckpt", "python checkpoint.py export {W}/run/ckpt OUT"], 1, True)
      for what, sub in (("directory", ""), ("step folder", "/step_00000002"))],
    # a run's --out_dir (its export in hf/, its checkpoints in ckpt/): was only 'has no config.json: give a Hugging Face folder'
    ("init: a run's --out_dir", TI("--init_from={W}/run"), ["{W}/run is a run's --out_dir", "--init_from={W}/run/hf"], 1, True),
    ("init: a killed run's --out_dir", TI("--init_from={W}/killed"),       # its checkpoints, no export yet
     ["has no config.json", "--ckpt.dir={W}/killed/ckpt", "python checkpoint.py export {W}/killed/ckpt OUT"], 1, True),
    # was: a traceback after the corpus index (resume set step_2 aside, then loaded the missing folder)
    ("init: folder gone, its checkpoints all interrupted", TI("--init_from={t}/gone", "--ckpt.dir={t}/ck"),
     ["--init_from={t}/gone does not exist"], 1, True),
    ("init: no weights", TI("--init_from={W}/init_noweights"), ["no .safetensors files", "init_noweights"], 1, True),
    ("init: another vocabulary's tokenizer", TI("--init_from={W}/run/hf", "--data.tokenizer={W}/tok1024.model"),
     ["tok1024.model has 1024 pieces", "vocab_size is 512", "leave --data.tokenizer empty"], 1, True),
    ("init: weights of another model", TI("--init_from={W}/init_twolayers"), ["lacks 9 tensors", "do not belong"], 1, True),
    # ---- train.py: data that cannot be used (2)
    ("corrupt .txt.gz", T("--data={W}/bad.txt.gz"), ["bad.txt.gz", "cannot be decompressed"], 1, True),
    # a weight so small next to the others that the 53-bit draw never picks its source: was read by nobody, silently (fuzz)
    *[(f"mixture weight {w} never drawn", T(f"--data={{W}}/corpus:{v},{{W}}/other:{w}"), [f"other:{w}", "never drawn"], 1, True)
      for v, w in (("1", "1e-300"), ("1e300", "1e-300"), ("1", "1e-17"))],
    ("mixture names a folder twice", T("--data={W}/corpus:1,{W}/corpus:1"), ["earlier source", "one source only"], 1, True),
    # ---- data.py
    ("data: no command", ("data", []), ["usage"], 2, True),
    ("data: prepare without --out", ("data", ["prepare", "{W}/corpus"]), ["--out"], 2, True),
    ("data: --out not .arrow", ("data", ["prepare", "{W}/corpus", "--out", "{t}/x.txt"]), ["x.txt", ".arrow"], 1, True),
    ("data: --out exists", ("data", ["prepare", "{W}/corpus", "--out", "{W}/ready.arrow"]),
     ["ready.arrow", "--force"], 1, True),
    ("data: --out a directory", ("data", ["prepare", "{W}/corpus", "--out", "{t}/d.arrow"]), ["d.arrow", "a directory"], 1, True),
    ("data: --out under a file", ("data", ["prepare", "{W}/corpus", "--out", "{W}/afile/x.arrow"]), ["afile"], 1, True),
    ("data: --out is a source", ("data", ["prepare", "{W}/ready.arrow", "--out", "{W}/ready.arrow", "--force"]),
     ["ready.arrow", "one of the sources"], 1, True),
    ("data: source missing", ("data", ["prepare", "{W}/nope", "--out", "{t}/x.arrow"]), ["nope", "does not exist"], 1, True),
    ("data: 0 documents", ("data", ["prepare", "{W}/empties", "--out", "{t}/x.arrow"]), ["no document has text"], 1, True),
    ("data: empty field", ("data", ["prepare", "{W}/corpus", "--out", "{t}/x.arrow", "--text-field", ""]),
     ["--text-field"], 1, True),
    ("data: jsonl field", ("data", ["prepare", "{W}/nofield.jsonl", "--out", "{t}/x.arrow"]), ["nofield.jsonl", "'text'"], 1, True),
    ("data: random arrow source", ("data", ["prepare", "{W}/random.arrow", "--out", "{t}/x.arrow"]),
     ["random.arrow", "not a valid"], 1, True),
    ("data: vocab 0", ("data", ["tokenizer", "--data", "{W}/corpus", "--vocab", "0", "--cache-dir", "{t}/c"]),
     ["--vocab=0"], 1, True),
    ("data: vocab negative", ("data", ["tokenizer", "--data", "{W}/corpus", "--vocab", "-5", "--cache-dir", "{t}/c"]),
     ["--vocab=-5"], 1, True),
    ("data: vocab not int", ("data", ["tokenizer", "--vocab", "many"]), ["--vocab", "'many'"], 2, True),
    ("data: tokenizer data missing", ("data", ["tokenizer", "--data", "{W}/nope", "--cache-dir", "{t}/c"]),
     ["nope", "does not exist"], 1, True),
    ("data: cache-dir a file", ("data", ["tokenizer", "--data", "{W}/corpus", "--cache-dir", "{W}/afile"]),
     ["--cache-dir", "afile"], 1, True),
    ("data: vocab above corpus", ("data", ["tokenizer", "--data", "{W}/corpus", "--vocab", "60000",
                                           "--cache-dir", "{t}/c"]), ["60000", "<= ", "lower --vocab"], 1, False),
    ("data: vocab above what is trained", ("data", ["tokenizer", "--data", "{W}/corpus", "--vocab", "65537",
                                                    "--cache-dir", "{t}/c"]), ["65,537-piece", "--vocab=65536"], 1, True),
    ("data: --out inside a source", ("data", ["prepare", "{W}/corpus", "--out", "{W}/corpus/all.arrow"]),
     ["inside the source directory", "read its documents twice"], 1, True),
    ("data: corrupt .txt.gz", ("data", ["prepare", "{W}/bad.txt.gz", "--out", "{t}/x.arrow"]),
     ["bad.txt.gz", "cannot be decompressed"], 1, True),
    ("data: vocab beyond int32", ("data", ["tokenizer", "--data", "{W}/corpus", "--vocab", "99999999999",   # (past 2**63: a domain)
                                           "--cache-dir", "{t}/c"]), ["99,999,999,999-piece", "--vocab=65536"], 1, True),
    # ---- checkpoint.py
    ("ckpt: ls one step", ("checkpoint", ["ls", "{W}/run/ckpt/step_00000002"]), ["is one checkpoint", "run/ckpt"], 1, True),
    ("ckpt: export into the checkpoints", ("checkpoint", ["export", "--overwrite", "{W}/run/ckpt", "{W}/run/ckpt/tokenizer"]),
     ["inside the checkpoint directory", "outside it"], 1, True),
    # ---- bench.py
    *[(f"bench: {a}", ("bench", [w, a]), [a.split("=")[0], "give"], 2, True) for w, a in (
        ("step", "--threads=0"), ("step", "--threads=100000"), ("init", "--layers=0"), ("init", "--lr=nan"), ("step", "--steps=-1"),
        ("data", "--data_shapes=arrow,foo"), ("data", "--data_corpora=files,foo"), ("ckpt", "--out={W}/afile"),
        ("step", "--device=cuda"),
        # were accepted: 2^31 layers built for minutes (no output in 40 s), lr 1e308 trained 150 steps of NaN (fuzz)
        ("init", "--layers=2147483648"), ("init", "--lr=1e308"), ("init", "--lr=5"))],
    ("ckpt: no arguments", ("checkpoint", []), ["usage: python checkpoint.py"], 1, True),
    ("ckpt: ls without dir", ("checkpoint", ["ls"]), ["usage"], 1, True),
    ("ckpt: unknown command", ("checkpoint", ["show", "x"]), ["'show'", "usage"], 1, True),
    ("ckpt: ls missing", ("checkpoint", ["ls", "{W}/nope"]), ["nope", "missing"], 1, True),
    ("ckpt: ls ''", ("checkpoint", ["ls", ""]), ["'' is missing"], 1, True),      # was " is missing": no value named
    ("ckpt: ls a file", ("checkpoint", ["ls", "{W}/afile"]), ["afile", "is a file"], 1, True),
    ("ckpt: ls no checkpoint", ("checkpoint", ["ls", "{W}/emptydir"]), ["emptydir", "holds no checkpoint"], 1, True),
    ("ckpt: bad flag", ("checkpoint", ["ls", "{W}/run/ckpt", "--force"]), ["--force: unknown flag", "usage"], 1, True),
    *[(f"ckpt: ls {f}", ("checkpoint", ["ls", f, "{W}/run/ckpt"]), [f, "export's flag", "ls takes CKPT_DIR only"], 1, True)
      for f in ("--overwrite", "--dtype=bf16")],       # was the listing, exit 0: the flag silently ignored (fuzz)
    ("ckpt: bad dtype", ("checkpoint", ["export", "--dtype=fp16", "{W}/run/ckpt", "{t}/hf"]),   # was the usage alone
     ["--dtype=fp16: give --dtype=auto, --dtype=fp32 or --dtype=bf16"], 1, True),
    ("ckpt: dtype without '='", ("checkpoint", ["export", "--dtype", "bf16", "{W}/run/ckpt", "{t}/hf"]),
     ["--dtype: give", "--dtype=bf16"], 1, True),
    ("ckpt: export missing", ("checkpoint", ["export", "{W}/nope", "{t}/hf"]), ["nope", "missing"], 1, True),
    ("ckpt: export over a model", ("checkpoint", ["export", "{W}/run/ckpt", "{W}/hfout"]),
     ["hfout", "not empty", "--overwrite"], 1, True),
    ("ckpt: export --overwrite among a user's files", ("checkpoint", ["export", "--overwrite", "{W}/run/ckpt", "{W}/usersdir"]),
     ["usersdir holds files that are not a nanotrn export (notes.txt)", "move them"], 1, True),    # was mixed in, exit 0
    ("ckpt: export to a file", ("checkpoint", ["export", "{W}/run/ckpt", "{W}/afile"]), ["afile", "is a file"], 1, True),
    ("ckpt: export extra args", ("checkpoint", ["export", "{W}/run/ckpt", "{t}/a", "{t}/b"]), ["usage"], 1, True),
    # ---- scripts/eks.py: a manifest Kubernetes would refuse at apply time
    *[(f"eks: {flag} {value!r}", ("eks", ["--nodes", "2", "--image", "x:1", "--fsx-claim", "fsx", flag, value]),
       [flag, value, "give"], 1, True) for flag, value in (
        ("--port", "0"), ("--port", "99999"), ("--shm", "lots"), ("--image", ""), ("--image", "a b"),
        ("--shm", "1"), ("--shm", "63Mi"), ("--shm", "0.05Gi"),    # below the container's default 64 MB: written (fuzz)
        ("--out", "{W}/afile"), ("--out", "{W}/afile/sub"),
        ("--max-restarts", "2147483648"),
        # not image references (a repository is lower case; a tag <= 128 of [A-Za-z0-9_.-]): every pod would wait in
        # InvalidImageName, and `kubectl wait` with it for 3 h (fuzz)
        ("--image", "ECR/Nanotrn:1"), ("--image", "x:1:2"), ("--image", "x:" + "t" * 129), ("--image", "x/:1"))],       # backoffLimitPerIndex is an int32: was written, refused by kubectl apply
    ("eks: --out unwritable", ("eks", ["--nodes", "2", "--image", "x:1", "--fsx-claim", "fsx", "--out", "/proc/m"]),
     ["--out='/proc/m'", "/proc is not writable"], 1, True),     # was mkdir's traceback, after every check
    # the compile cache goes into NEURON_CC_FLAGS as --cache_dir=PATH, split on whitespace: was written (fuzz)
    ("eks: --cache-dir with a space", ("eks", ["--nodes", "16", "--image", "x:1", "--fsx-claim", "fsx", "--preset",
                                              "llama2_7b", "--cache-dir", "/var/tmp/neuron cache", "--out", "{t}/m"]),
     ["NEURON_CACHE_DIR='/var/tmp/neuron cache'", "give a path without whitespace"], 1, True),
    ("eks: --fsx-claim", ("eks", ["--nodes", "2", "--image", "x:1", "--fsx-claim", "FSx_Claim"]),
     ["--fsx-claim 'FSx_Claim'", "PersistentVolumeClaim name"], 1, True),
    # ---- configs.py and plan.py
    ("configs: no command", ("configs", []), ["usage: python configs.py show"], 1, True),
    ("configs: plan, a bad value", ("configs", ["plan", "--model.n_heads=0"]), ["--model.n_heads=0"], 1, True),
    ("configs: another command", ("configs", ["plans"]), ["python configs.py plan"], 1, True),
    ("configs: bad key", ("configs", ["show", "--model.n_layer=2"]), ["--model.n_layer"], 1, True),
    ("configs: bad value", ("configs", ["show", "--model.n_heads=0"]), ["--model.n_heads=0"], 1, True),
    ("configs: help with a bad key", ("configs", ["--help", "--bogus"]), ["--bogus"], 1, True),   # was a traceback
    ("plan: zero heads", ("plan", ["--model.n_heads=0"]), ["--model.n_heads=0"], 1, True),
    ("plan: negative cores", ("plan", ["--parallel.cores=-32"]), ["--parallel.cores=-32"], 1, True),
    ("plan: beta2", ("plan", ["--preset", "llama2_7b", "--optim.beta2=1.5"]), ["--optim.beta2=1.5"], 1, True),
    ("plan: tp splits heads", ("plan", ["--preset", "llama2_7b", "--tp=3"]), ["n_heads 32", "tp 3"], 1, True),
    ("plan: batch over cores", ("plan", ["--preset", "llama2_7b", "--global_batch=8"]),
     ["global batch 8", "--parallel.cores=4096"], 1, True),
    ("plan: tp above cores", ("plan", ["--preset", "llama2_7b", "--parallel.cores=4"]),
     ["world size 4", "tp*pp = 8*1"], 1, True),
    ("plan: unknown preset", ("plan", ["--preset", "llama4_8b"]), ["llama4_8b"], 1, True),
    ("plan: ffn by tp", ("plan", ["--preset", "llama2_7b", "--model.ffn_dim=11001"]), ["ffn_dim=11001"], 1, True),
    # ---- found by fuzzing every entry point (vinput): a link to nothing, a name of spaces
    *[(f"dangling --{k}", T(f"--{k}={{W}}/dangling"), [f"--{k}=", "dangling", "broken symbolic link"], 1, True)
      for k in ("out_dir", "ckpt.dir", "log.tensorboard", "data.cache_dir")],
    ("tensorboard of spaces", T("--log.tensorboard=   "), ["--log.tensorboard='   '", "names no directory"], 1, True),
    ("data: cache-dir dangling", ("data", ["tokenizer", "--data", "{W}/corpus", "--cache-dir", "{W}/dangling"]),
     ["--cache-dir", "broken symbolic link"], 1, True),
    ("ckpt: export to a dangling link", ("checkpoint", ["export", "{W}/run/ckpt", "{W}/dangling"]),
     ["dangling", "broken symbolic link"], 1, True),
    ("ckpt: export to ''", ("checkpoint", ["export", "{W}/run/ckpt", ""]), ["''", "names no directory"], 1, True),
    ("bench: --out dangling", ("bench", ["ckpt", "--out={W}/dangling"]), ["--out", "broken symbolic link"], 2, True),
    # ---- numbers past what the clock, a timedelta or the data order's 64-bit hash can hold (were OverflowError)
    *[(f"domain: {a}", T(a), [a.split("=")[0] + "=1e+", "at most 1e9"], 1, True) for a in (
        "--log.hang_startup_s=1e308", "--log.hang_min_s=1e16", "--parallel.timeout_s=1e17", "--ckpt.grace_s=1e300")],
    # the sample printed at the end never ended (one forward pass per token): refused before any work
    ("domain: --log.sample_tokens=10**20", T(f"--log.sample_tokens={10**20}"), [f"--log.sample_tokens={10**20}",
                                                                                 "at most 10000"], 1, True),
    ("domain: data.seed 2**63", T("--data.seed=9223372036854775808"), ["--data.seed=9223372036854775808", "2**63"], 1, True),
    ("export folder is a file", T(), ["out/hf is a file", "--out_dir"], 1, True),    # was a traceback after training
    ("data: --out ''", ("data", ["prepare", "{W}/corpus", "--out", ""]), ["--out ''", "is empty"], 1, True),
    # ---- torchrun's environment set by hand (ENV below): was int()'s ValueError, a ZeroDivisionError, torch's
    # "MASTER_ADDR expected" traceback, or (RANK >= WORLD_SIZE) a rank waiting forever for peers
    *[(f"env: {e}", T("--global_batch=4", "--parallel.timeout_s=5"), [e.split(", ")[-1], "torchrun sets these"], 1, True) for e in (
        "WORLD_SIZE='x'", "WORLD_SIZE='0'", "WORLD_SIZE=''", "RANK='-1'", "LOCAL_WORLD_SIZE='0'", "LOCAL_WORLD_SIZE='x'",
        "WORLD_SIZE='2', RANK='2'", "WORLD_SIZE='2', MASTER_ADDR=None", "WORLD_SIZE='2', MASTER_PORT='x'",
        # `torchrun --master_port=0` hands every rank port 0: each waited for a store there past --parallel.timeout_s
        # (killed after 90 s at timeout_s=5); 65536 is no port either (fuzz)
        "WORLD_SIZE='2', MASTER_PORT='0'", "WORLD_SIZE='2', RANK='1', MASTER_PORT='65536'",
        # int()'s ValueError on a CUDA host (hardware.pick_device, torch.cuda.set_device); here it trained (fuzz)
        "LOCAL_RANK='x'", "LOCAL_RANK='-1'")],
    # ---- values whose first steps are NaN (weights or updates near 1e308, a RoPE frequency of 1/1e-300): were
    # a non-finite stop after step 1, with the model built; now refused with the other domains (vinput2)
    *[(f"domain: {a}", T(*a.split()), [a.split()[-1].split("=")[0] + "=", says], 1, True) for a, says in (
        ("--model.init_std=1e308", "at most 1"), ("--optim.lr=1e308", "at most 1"),
        # an epsilon past float32's largest is inf there: every normalized activation 0 (grad norm 0 from step 1), every
        # AdamW update 0: the run trained nothing, silently (fuzz)
        ("--model.norm_eps=1e308", "at most 1"), ("--optim.eps=1e300", "at most 1"),
        # clipped to a norm below AdamW's eps: each update at most lr x grad_clip/eps (1e-300: the losses of a run
        # that never updated, step for step); 0 turns clipping off and stays accepted (fuzz)
        # a peak given in FLOP/s (190e12): 'MFU 0.0%' at every step, or 'MFU peak: inf' at 1e308 (fuzz)
        # torch counts a collective's timeout in milliseconds: 1e-9 s was 0 ms, and at world 2 the first collective
        # failed as "another rank is gone or hung (wait timeout after 0ms)" (fuzz)
        ("--parallel.timeout_s=1e-9", "at least 0.001"), ("--parallel.timeout_s=0.0004", "at least 0.001"),
        ("--log.peak_tflops=1.9e14", "TFLOP/s, not FLOP/s"), ("--log.peak_tflops=1e308", "at most 100000"),
        ("--optim.grad_clip=1e-300", "below --optim.eps=1e-05"), ("--optim.grad_clip=1e-44", "below --optim.eps=1e-05"),
        ("--optim.weight_decay=1e308", "lower weight_decay below 1000"), ("--model.rope_theta=1e-300", "must be > 1"),
        ("--model.rope_scaling=llama3 --model.rope_factor=1e-300", "must be >= 1"),
        # torch takes a Python int as 64 bits: RoPE's llama3 scaling was an OverflowError traceback, the model built
        ("--model.rope_scaling=llama3 --model.rope_original_max_len=18446744073709551616", "below 2**63"))],
    # a [B, T, T] document mask of 2 TiB on a CPU run: was DefaultCPUAllocator's RuntimeError traceback, after the
    # model was built (at 2**17 tokens: the OOM killer, on this 24 GiB host)
    ("document mask 2^20", T("--data=stdlib", "--seq_len=1048576", "--model.max_seq_len=1048576", "--global_batch=1",
                             "--micro_batch=1"), ["--data.seq_len=1048576", "does not fit", "lower --data.micro_batch"], 1, True),
    # a name in another encoding than UTF-8 (bytes Python keeps as surrogate escapes): were tracebacks from
    # json, sentencepiece or Arrow, the export's after its files were half written (vinput2)
    *[(f"non-UTF-8 {name}", call, ["not in UTF-8 (rename it)"], 1, True) for name, call in (
        ("--data.cache_dir", T("--data.cache_dir={t}/c\udcff")), ("--out_dir", T("--out_dir={t}/o\udcff")),
        ("--data.tokenizer", T("--data.tokenizer={W}/t\udcff.model")),
        ("data.py --out", ("data", ["prepare", "{W}/corpus", "--out", "{t}/x\udcff.arrow"])),
        ("checkpoint.py export", ("checkpoint", ["export", "{W}/run/ckpt", "{t}/h\udcff"])))],
    ("data: vocab 1", ("data", ["tokenizer", "--data", "{W}/corpus", "--vocab", "1", "--cache-dir", "{t}/c"]),
     ["1-piece", "--vocab=260 or more"], 1, True),           # was "could not train ...: ; lower --vocab"
    # ---- a folder even root cannot write into (/proc; os.access says root may): were tracebacks or errors after the work
    *[(f"unwritable {k}", T(f"--{k}=/proc/nanotrn/x"), [f"--{k}='/proc/nanotrn/x'", "/proc is not writable"], 1, True)
      for k in ("out_dir", "log.tensorboard")],
    ("data: --out unwritable", ("data", ["prepare", "{W}/corpus", "--out", "/proc/x.arrow"]), ["/proc is not writable"], 1, True),
    ("data: --cache-dir unwritable", ("data", ["tokenizer", "--data", "{W}/corpus", "--cache-dir", "/proc/c"]),
     ["--cache-dir='/proc/c'", "/proc is not writable"], 1, True),
    ("ckpt: export unwritable", ("checkpoint", ["export", "{W}/run/ckpt", "/proc/hf"]), ["/proc is not writable"], 1, True),
    ("bench: --out unwritable", ("bench", ["ckpt", "--out=/proc/b"]), ["--out='/proc/b'", "/proc is not writable"], 2, True),
    # ---- scripts/healthcheck.py: every flag was a traceback (init_process_group's first, run bare)
    *[(f"health: {' '.join(a)}", ("health", a), [" ".join(a[:2]) if a else "torchrun", "give" if a else "WORLD_SIZE"], 1, True)
      for a in (["--tp", "0"], ["--pp", "-1"], ["--reps", "0"], ["--mb", "nan"], ["--mb", "0"], ["--timeout-s", "0"],
                ["--factor", "1"], ["--inject-delay", "x"], ["--json", "{W}/emptydir"], [])],
    # the report is written after every measurement: into /proc (a directory root cannot write) it was a traceback then
    ("health: --json unwritable", ("health", ["--json", "/proc/nanotrn.json"]), ["--json='/proc/nanotrn.json'",
                                                                              "/proc is not writable"], 1, True),
]


@pytest.mark.parametrize("name,call,expect,code,early", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_with_its_exit_code_no_traceback_no_work_no_file_changed(
        W, tmp_path, monkeypatch, capsys, name, call, expect, code, early):
    entry, argv = call
    t = tmp_path
    if name.startswith(("resume other", "new corpus", "ckpt: foreign", "ckpt: only", "init: folder gone")):
        shutil.copytree(W / "run" / "ckpt", t / "ck")          # the finished run's checkpoint, to continue
    if name == "ckpt: foreign step folder":
        (t / "ck" / "step_00000009").mkdir()
        (t / "ck" / "step_00000009" / "notes.txt").write_text("a user's own files")
    if name == "ckpt: foreign latest":
        (t / "ck" / "latest").write_text("my own notes")
    if name.startswith("ckpt: foreign tokenizer file"):
        shutil.rmtree(t / "ck") if name.endswith("(fresh)") else shutil.rmtree(t / "ck" / "tokenizer")
        (t / "ck").mkdir(exist_ok=True)
        (t / "ck" / "tokenizer").write_text("a user's file")
    if name == "ckpt: a user's tokenizer folder (fresh)":         # was replaced by this run's
        (t / "ck" / "tokenizer").mkdir(parents=True)
        (t / "ck" / "tokenizer" / "tokenizer.model").write_text("a user's own tokenizer")
    if name == "ckpt: only the checkpoints, no kept tokenizer":    # an older nanotrn's run, or step folders copied
        shutil.rmtree(t / "ck" / "tokenizer")
    if name == "ckpt: only checkpoint damaged":
        f = t / "ck" / "step_00000002" / "model_tp00_pp00.pt"
        f.write_bytes(f.read_bytes()[:1000])
    if name == "init: folder gone, its checkpoints all interrupted":     # a run started --init_from={t}/gone
        meta = json.loads((t / "ck" / "step_00000002" / "meta.json").read_text())
        meta["config"]["init_from"] = f"{t}/gone"
        (t / "ck" / "step_00000002" / "meta.json").write_text(json.dumps(meta))
        os.remove(t / "ck" / "step_00000002" / "manifest.json")
    if name == "data: --out a directory":
        (t / "d.arrow").mkdir()
    if name == "export folder is a file":
        (t / "out").mkdir()
        (t / "out" / "hf").write_text("a user's file where the export would go")
    if name == "fault spec":
        monkeypatch.setenv("NANOTRN_FAULT", "boom")
    argv = [a.replace("{W}", str(W)).replace("{t}", str(t)) for a in argv]
    expect = [e.replace("{W}", str(W)).replace("{t}", str(t)) for e in expect]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if name.startswith("env: "):            # a rendezvous that is never reached, unless the case takes it away
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **eval(f"dict({name[5:]})")}
        for k, v in env.items():
            monkeypatch.setenv(k, v) if v is not None else monkeypatch.delenv(k, raising=False)
    before = snapshot(W, t)
    spy = Spy(monkeypatch)
    got, text = run_entry(entry, argv, capsys)
    assert got == code, text
    for e in expect:
        assert e in text, f"{e!r} not in {text!r}"
    assert "Traceback" not in text, text
    message = [line for line in text.splitlines() if "error" in line.lower() or "usage" in line.lower()]
    assert message and all(len(m) < 700 for m in message), text      # one line, not a dump
    if early:
        assert not spy.calls, (spy.calls, text)                       # no tokenizer trained, no model built
    after = snapshot(W, t)
    changed = [p for p, h in before.items() if after.get(p) != h and not p.endswith("run.lock")]  # the run's lock: ours
    assert not changed, changed


def test_data_tokenizer_says_only_its_own_flags(W, tmp_path, capsys):
    """`data.py tokenizer` has --vocab and no --data.tokenizer: its fix names only what it takes."""
    code, text = run_entry("data", ["tokenizer", "--data", str(W / "corpus"), "--vocab", "10",
                                    "--cache-dir", str(tmp_path / "c")], capsys)
    assert code == 1 and "set --vocab=" in text and "--data.tokenizer" not in text, text


def test_data_tokenizer_names_its_flags_by_itself_and_checks_only_what_it_uses(W, tmp_path, capsys, monkeypatch):
    """Its refusals name its flags as the checks are made, not rewritten afterwards: the rewrite also renamed
    a path holding '--data.split' or '--data.cache_dir'. It checked train.py's --out_dir too (refused where
    ./out is a file) and refused --val-fraction 0 telling to set --log.eval_interval, which it does not take."""
    folder = tmp_path / "dump--data.split"
    folder.mkdir()
    (folder / "validation.jsonl").write_text('{"text": "a document"}\n')
    cache = ["--cache-dir", str(tmp_path / "c")]
    code, text = run_entry("data", ["tokenizer", "--data", str(folder), *cache], capsys)
    assert code == 1 and text.strip() == f"data error: {folder} holds the splits validation, not 'train'; choose one with --split"
    code, text = run_entry("data", ["tokenizer", "--data", f"{tmp_path}/x--data.cache_dir/a.txt", *cache], capsys)
    assert code == 1 and f"'{tmp_path}/x--data.cache_dir/a.txt' does not exist" in text, text
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").write_text("a user's file, where train.py's --out_dir would be")
    for extra in ([], ["--val-fraction", "0"]):     # refused for --vocab 10 alone, before any corpus is read
        code, text = run_entry("data", ["tokenizer", "--data", str(W / "corpus"), "--vocab", "10", *cache, *extra], capsys)
        assert code == 1 and text.strip().startswith("data error: a 10-piece tokenizer") and "set --vocab=260" in text, text
    assert not (tmp_path / "c").exists()


def run_as_plain_user(script: str):
    """`python -c script` as a plain user (root's bypass of permissions dropped: conftest.as_plain_user), which
    must print no traceback; its result and the 'exit ...' lines the script printed for each SystemExit."""
    from conftest import as_plain_user
    r = subprocess.run([*as_plain_user(), sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    return r, [line for line in r.stderr.splitlines() if line.startswith("exit ")]


@pytest.mark.slow       # one process (~4 s: torch's import)
def test_a_folder_this_user_cannot_list_is_named_so(W, tmp_path):
    """--data (train.py, data.py prepare and tokenizer) a folder of mode 0300 as a non-root user: os.walk passed it
    over silently, and the refusal said "'FOLDER' holds no .txt/... files", as if it were empty; `monitor.py plot` of a
    TensorBoard folder of mode 0300 was a PermissionError traceback; such a subfolder of a folder this user lists was
    skipped, its files left out of the run without a word. Root reads them anyway: root's bypass is dropped."""
    corpus, tb = tmp_path / "corpus", tmp_path / "tb"
    shutil.copytree(W / "corpus", corpus)
    tb.mkdir()
    corpus.chmod(0o300)
    tb.chmod(0o300)
    nested = tmp_path / "nested"        # a folder this user lists, with a subfolder it cannot: that one was skipped
    shutil.copytree(W / "corpus", nested / "a")
    shutil.copytree(W / "corpus", nested / "b")
    (nested / "b").chmod(0o300)
    calls = [(f, [x.replace(str(corpus), str(where)) for x in argv]) for where in (corpus, nested) for f, argv in (
             ("data.main", ["tokenizer", "--data", str(corpus), "--cache-dir", f"{tmp_path}/c"]),
             ("data.main", ["prepare", str(corpus), "--out", f"{tmp_path}/x.arrow"]),
             ("train.cli", [*TINY, f"--data={corpus}", f"--out_dir={tmp_path}/out", f"--data.cache_dir={tmp_path}/c"]))]
    calls.append(("plot", [str(tb), f"{tmp_path}/curves.png"]))
    script = (f"import runpy, sys\nsys.path.insert(0, {ROOT!r})\nimport data, train\nfor f, argv in {calls!r}:\n"
              f"    sys.argv = ['monitor.py', 'plot', *argv]\n    try:\n"
              f"        eval(f)(argv) if f != 'plot' else runpy.run_path({ROOT + '/monitor.py'!r}, run_name='__main__')\n"
              f"    except SystemExit as e:\n        print('exit', e.code, file=sys.stderr)\n")
    r, said = run_as_plain_user(script)
    assert len(said) == 7, r.stderr
    assert all(f"{corpus} cannot be listed by this user: fix its permissions" in line for line in said[:3]), r.stderr
    assert all(f"{nested}/b cannot be listed by this user: fix its permissions" in line for line in said[3:6]), said
    assert f"{tb} is not readable by this user (the run's --log.tensorboard)" in said[6], r.stderr
    assert not any((tmp_path / d).exists() for d in ("c", "out", "x.arrow", "curves.png")), "work started"


@pytest.mark.slow       # one process (~4 s: torch's import)
def test_an_init_from_folder_or_weights_this_user_cannot_read_is_one_line(W, tmp_path):
    """--init_from another user's folder (mode 0700) was a PermissionError traceback in hf.read_config (it lists the
    folder for nanotrn checkpoints once config.json seems missing); a model.safetensors of mode 0000 was 'cannot read
    its weights (No such file or directory: ...); re-download them' (safetensors' words). Each is one line naming the
    fix before any work, as a plain user (root's bypass of permissions dropped: conftest.as_plain_user); the HFError
    does not chain safetensors' error for a Python caller."""
    other, unread = tmp_path / "other", tmp_path / "unread"
    shutil.copytree(W / "run" / "hf", other)
    shutil.copytree(W / "run" / "hf", unread)
    (unread / "model.safetensors").chmod(0)
    if os.geteuid() == 0:
        os.chown(other, 65534, -1)          # nobody's; a plain user's own folder of mode 0000 stands in for it
    other.chmod(0o700 if os.geteuid() == 0 else 0)
    calls = [[a.replace("{W}", str(W)).replace("{t}", f"{tmp_path}/{d.name}-run") for a in TI(f"--init_from={d}")[1]]
             for d in (other, unread)]
    script = (f"import sys\nsys.path.insert(0, {ROOT!r})\nimport train\nfor argv in {calls!r}:\n    try:\n"
              f"        train.cli(argv)\n    except SystemExit as e:\n        print('exit', e.code, file=sys.stderr)\n"
              f"import hf\ntry:\n    hf.SafetensorsFolder({str(unread)!r})\nexcept hf.HFError as e:\n"
              f"    print('chained', None if e.__suppress_context__ else repr(e.__context__), file=sys.stderr)\n")
    r, said = run_as_plain_user(script)
    assert said == [f"exit error: {other} cannot be read by this user: fix its permissions, or copy the model to your own",
                    f"exit error: {unread}/model.safetensors is not readable by this user: fix its permissions"], r.stderr
    assert not any((tmp_path / f"{d}-run").exists() for d in ("other", "unread")), "work started"
    assert "chained None" in r.stderr, r.stderr     # a Python caller sees our line, not safetensors' error under it


@pytest.mark.parametrize("source", ["nope.txt", "fifo.txt", "table.csv", "emptydir"])
def test_a_bad_data_source_is_refused_before_the_checkpoint_directory_is_claimed(W, tmp_path, capsys, source):
    """A --data missing, a FIFO, of a type nanotrn does not read or a folder without files: refused before the run
    claims its checkpoint directory (it was after <ckpt.dir>/run.lock was made and the process group started)."""
    argv = [a.replace("{W}", str(W)).replace("{t}", str(tmp_path)) for a in T(f"--data={W}/{source}")[1]]
    code, text = run_entry("train", argv, capsys)
    assert code == 1 and source in text and "Traceback" not in text, text
    assert not (tmp_path / "out").exists(), "the checkpoint directory was claimed first"


@pytest.mark.parametrize("spec,says", [
    ("{W}/corpus:", ["{W}/corpus:'", "'' after its last ':' is not a mixture weight"]),   # was: 'does not exist'
    ("{W}/corpus:x", ["{W}/corpus:x'", "'x' after its last ':'"]),
    ("{W}/corpus:-1", ["{W}/corpus:-1", "positive"]),
    ("{W}/corpus:0", ["{W}/corpus:0", "positive", "leave a source out"]),
    ("{W}/corpus:0.5,{W}/corpus:0.5", ["mixture source '{W}/corpus'", "one source only"]),  # was: after the claim
    ("{W}/corpus:0.5,{W}/corpus/copy.py:0.5", ["'{W}/corpus/copy.py'", "one source only"]),
    ("{W}/corpus:0.7,{W}/other", ["'{W}/other' has no weight"]),
    ("{W}/no/such:1", ["'{W}/no/such' does not exist"]),
    ("{W}/corpus:1e308,{W}/other:1e308", ["1e+308, 1e+308", "relative"])])     # was: every window from corpus
def test_a_bad_mixture_is_refused_in_one_line_before_the_claim(W, tmp_path, capsys, spec, says):
    """--data's mixture syntax (a weight empty, not a number, not positive; a source whose files an earlier one
    names; a source of no weight among weighted ones): one line naming the entry, before the checkpoint directory
    is claimed. A source named twice was refused after the claim and the process group's start."""
    argv = [a.replace("{W}", str(W)).replace("{t}", str(tmp_path)) for a in T(f"--data={spec}")[1]]
    code, text = run_entry("train", argv, capsys)
    errors = [line for line in text.splitlines() if "error" in line]
    assert code == 1 and len(errors) == 1 and "Traceback" not in text, text
    assert all(s.replace("{W}", str(W)) in errors[0] for s in says), text
    assert not (tmp_path / "out").exists(), "the checkpoint directory was claimed first"


@pytest.mark.parametrize("args,says", [(["--data=,"], ["--data.data=','", "a source"]),
                                       (["--data.tokenizer=", "--model.vocab_size=100"], ["100-piece", "260 or more"]),
                                       # Llama 3's vocabulary, none given: sentencepiece said so after the whole training
                                       (["--data.tokenizer=", "--model.vocab_size=128256"],
                                        ["128,256-piece", "--model.vocab_size=65536 or less", "--data.tokenizer", "e.g. Llama 3's"])])
def test_a_run_that_cannot_get_data_or_a_tokenizer_is_refused_before_the_claim(W, tmp_path, capsys, args, says):
    """--data=, (a mixture of no source) and a vocabulary too small for a tokenizer to be trained (none given, no
    resume of a run that keeps its own): one line before any work; they were refused after the checkpoint directory
    was claimed (run.lock written) and the process group started."""
    argv = [a.replace("{W}", str(W)).replace("{t}", str(tmp_path)) for a in T(*args)[1]]
    code, text = run_entry("train", argv, capsys)
    errors = [line for line in text.splitlines() if "error" in line]
    assert code == 1 and len(errors) == 1 and all(s in errors[0] for s in says) and "Traceback" not in text, text
    assert not (tmp_path / "out").exists(), "the checkpoint directory was claimed first"


def test_a_kept_tokenizer_without_checkpoints_does_not_skip_the_vocabulary_check(W, tmp_path, capsys):
    """<ckpt.dir>/tokenizer/ kept by a run stopped before its first checkpoint: this run trains a tokenizer anew,
    so a vocabulary too small for one is refused before the corpus is indexed (it was skipped, and the same
    error came after the claim, the index and the corpus read)."""
    (tmp_path / "out" / "ckpt" / "tokenizer").mkdir(parents=True)
    shutil.copy(W / "tok.model", tmp_path / "out" / "ckpt" / "tokenizer" / "tokenizer.model")
    argv = [a.replace("{W}", str(W)).replace("{t}", str(tmp_path))
            for a in T("--data.tokenizer=", "--model.vocab_size=100")[1]]
    code, text = run_entry("train", argv, capsys)
    assert code == 1 and "100-piece" in text and "Traceback" not in text, text
    assert not (tmp_path / "cache").exists(), "the corpus was indexed first"


def test_a_resume_without_its_kept_tokenizer_is_refused_before_the_corpus_is_indexed(W, tmp_path, capsys):
    """Step folders without the tokenizer their model was trained with (an older nanotrn's, or copied without
    it): refused in one line before any work (it came after the claim and the span index of the whole corpus)."""
    (tmp_path / "out" / "ckpt" / "step_00000001").mkdir(parents=True)
    argv = [a.replace("{W}", str(W)).replace("{t}", str(tmp_path)) for a in T("--data.tokenizer=")[1]]
    code, text = run_entry("train", argv, capsys)
    errors = [line for line in text.splitlines() if "error" in line]
    assert code == 1 and len(errors) == 1 and "not the tokenizer their model" in errors[0] and "Traceback" not in text, text
    assert not (tmp_path / "cache").exists(), "the corpus was indexed first"
    assert not (tmp_path / "out" / "ckpt" / "run.lock").exists(), "the checkpoint directory was claimed first"


def test_a_fresh_run_over_checkpoints_checks_the_vocabulary_it_will_train(W, tmp_path, capsys):
    """--ckpt.resume=false over step folders loads none of them and trains its tokenizer: the check before any work
    is the vocabulary's (a 100-piece one cannot be trained), not the kept tokenizer only a resume needs."""
    (tmp_path / "out" / "ckpt" / "step_00000001").mkdir(parents=True)
    argv = [a.replace("{W}", str(W)).replace("{t}", str(tmp_path)) for a in T("--data.tokenizer=")[1]]
    code, text = run_entry("train", [*argv, "--ckpt.resume=false", "--model.vocab_size=100"], capsys)
    assert code == 1 and "a 100-piece tokenizer cannot hold the 256 byte pieces" in text, text
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out" / "ckpt" / "run.lock").exists()


def test_checkpoints_beside_another_tokenizer_are_not_exported_with_it_nor_resumed_on_it(W, tmp_path, capsys):
    """Step folders copied beside another run's tokenizer/ (or a kept tokenizer damaged since): `checkpoint.py
    export` shipped that tokenizer with the model, exit 0, its token ids meaning other things than in training; a
    resume was refused advising --ckpt.reset_data, which trains on with it. Both now one line naming the kept
    tokenizer and the checkpoint, nothing written."""
    ck = tmp_path / "ck"
    shutil.copytree(W / "run" / "ckpt", ck, ignore=shutil.ignore_patterns("run.lock"))
    shutil.copy(W / "tokother.model", ck / "tokenizer" / "tokenizer.model")     # same vocabulary, another corpus's
    code, text = run_entry("checkpoint", ["export", str(ck), str(tmp_path / "hf")], capsys)
    says = f"{ck / 'tokenizer'} holds another tokenizer than the one step_00000002 was trained with"
    assert code == 1 and says in text and "Traceback" not in text, text
    assert not (tmp_path / "hf").exists()
    argv = [a.replace("{W}", str(W)).replace("{t}", str(tmp_path)) for a in CK("--data.tokenizer=")[1]]
    code, text = run_entry("train", argv, capsys)
    errors = [line for line in text.splitlines() if "error" in line]
    assert code == 1 and len(errors) == 1 and "Traceback" not in text, text
    assert "another tokenizer than the one" in errors[0] and "reset_data" not in errors[0], errors
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("tok,says", [("empty.model", "not a sentencepiece model"), ("tok.model", "--model.vocab_size=512")])
def test_a_given_tokenizer_is_checked_before_the_corpus_is_indexed(W, tmp_path, capsys, tok, says):
    """An empty .model file, or one of fewer pieces than --model.vocab_size: refused before the span index is
    written into the cache (it was, and only then the tokenizer loaded)."""
    (tmp_path / "empty.model").touch()
    argv = [a.replace("{W}", str(W)).replace("{t}", str(tmp_path)) for a in T("--model.vocab_size=4096")[1]]
    code, text = run_entry("train", [*argv, f"--data.tokenizer={tmp_path if tok == 'empty.model' else W}/{tok}"], capsys)
    assert code == 1 and says in text and "Traceback" not in text, text
    assert not (tmp_path / "cache").exists(), "the corpus was indexed first"


def test_prepare_reads_a_folder_holding_a_file_named_in_another_encoding(W, tmp_path):
    """caf\xe9.py (Latin-1 bytes) among UTF-8 names: train.py reads such a folder, and so does prepare (its shard's
    temporary name was the source's, which Arrow cannot open: a UnicodeEncodeError traceback)."""
    shutil.copytree(W / "corpus", tmp_path / "src")
    (tmp_path / os.fsdecode(b"src/caf\xe9.py")).write_text("x = 1\n" * 50)
    counts = prepare.prepare([str(tmp_path / "src")], str(tmp_path / "all.arrow"), workers=1)
    assert counts["documents"] == 13 and (tmp_path / "all.arrow").exists()


def test_plan_of_a_billion_layers_ends(capsys):
    """The planner tried every PP degree from 1 to n_layers (x TP x SP x ZeRO-1 x checkpointing x micro-batch):
    --model.n_layers=1000000000 never ended. A PP degree divides n_layers and the world: their gcd's divisors."""
    plan.main(["--model.n_layers=1000000000"])
    assert "layouts that fit, fastest first (0 of 924)" in capsys.readouterr().out


def test_prepare_py_run_alone_says_how_to_prepare():
    """The brief names `python prepare.py`: it is data.py prepare's library, and did nothing with exit 0."""
    import runpy
    with pytest.raises(SystemExit, match="usage: python data.py prepare SOURCES"):
        runpy.run_path(os.path.join(ROOT, "prepare.py"), run_name="__main__")


def test_checkpoint_help_is_not_an_error(capsys):
    checkpoint.main(["--help"])
    out = capsys.readouterr().out
    assert "usage: python checkpoint.py" in out
    # each command at the margin, what it does under it (the docstring's indent was printed: ls at 0, export at 4)
    commands = [line for line in out.splitlines() if "python checkpoint.py" in line and not line.startswith("usage")]
    assert [c.split()[2] for c in commands] == ["ls", "export"] and all(c.startswith("python") for c in commands), out
    assert {len(x) - len(x.lstrip()) for x in out.splitlines() if x.strip()} == {0, 4}, out


def test_at_least_80_kinds_of_bad_input_are_checked():
    assert len(CASES) >= 80, len(CASES)
    # docs/testing.md's count holds and says about how many ("over 250" where there were 308)
    said = int(re.search(r"runs over (\d+) cases of bad input", open(os.path.join(ROOT, "docs", "testing.md")).read())[1])
    assert said <= len(CASES) < said + 50, f"docs/testing.md says over {said} cases: say over {len(CASES) // 50 * 50}"


# ----------------------------------------------------------------------------- Ctrl-C

def test_ctrl_c_in_data_prepare_leaves_nothing(W, tmp_path, monkeypatch, capsys):
    """Ctrl-C while prepare writes: one word, no traceback, no partial file."""
    def interrupt(self, n=1):
        raise KeyboardInterrupt
    import tqdm
    monkeypatch.setattr(tqdm.tqdm, "update", interrupt)
    code, text = run_entry("data", ["prepare", str(W / "corpus"), "--out", str(tmp_path / "x.arrow")], capsys)
    assert code == 130 and "interrupted" in text and "Traceback" not in text    # was 1: train.py's 130, the shell's
    assert os.listdir(tmp_path) == []


def test_ctrl_c_in_checkpoint_py_is_one_word_and_the_shells_status(tmp_path, monkeypatch, capsys):
    """checkpoint.py ls/export interrupted: "interrupted" and 130 (128 + SIGINT) as train.py and data.py; was 1,
    which a script cannot tell from a refusal."""
    import checkpoint
    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint, "cli", interrupt)
    code, text = run_entry("checkpoint", ["ls", str(tmp_path)], capsys)
    assert (code, text.strip()) == (130, "interrupted")


def test_a_cpu_run_is_refused_where_its_gradients_and_moments_do_not_fit(monkeypatch):
    """train.check_memory: a CPU run holds each parameter with its gradient and AdamW's two moments (16 bytes),
    an accelerator's host only the fp32 weights (4). A host share between the two (LOCAL_WORLD_SIZE processes
    on this host, as torchrun says it) refuses the CPU run before any work, and lets the other through."""
    import torch
    import model as llama
    cfg = configs.from_args(["--model.vocab_size=32000", "--model.dim=256", "--model.n_heads=4", "--model.n_kv_heads=4",
                             "--model.ffn_dim=512", "--model.n_layers=2"])
    m, d = cfg.model, cfg.data
    largest = 4 * max(m.vocab_size * m.dim, m.ffn_dim * m.dim, m.n_heads * m.head_dim * m.dim)
    act = 2 * d.micro_batch * d.seq_len ** 2 * d.document_mask
    room = (4 * llama.num_params(m) + 16 * llama.num_params(m)) / 2 + largest + act
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // room)))
    with pytest.raises(configs.ConfigError, match="does not fit in memory"):
        train.check_memory(cfg, torch.device("cpu"))
    train.check_memory(cfg, torch.device("meta"))          # not a CPU run: the weights alone on the host


def test_ctrl_c_in_train_pys_set_up_is_one_word_and_the_shells_status(W, tmp_path, monkeypatch, capsys):
    """A KeyboardInterrupt before the training loop's graceful stop is installed (the config checked, the corpus
    indexed, a tokenizer trained): "interrupted", no traceback, status 130 (128 + SIGINT, what the shell and
    test_ctrl_c_while_train_py_starts take for Ctrl-C), nothing written. Raised here where the config is read."""
    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(configs, "from_args", interrupt)
    code, text = run_entry("train", [*TINY, f"--out_dir={tmp_path}/o"], capsys)
    assert (code, text.strip()) == (130, "interrupted") and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_ctrl_c_during_tokenizer_training_is_quiet(tmp_path):
    """A real process: SIGINT while sentencepiece trains ends it at once, quietly, with no model file."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "data.py"), "tokenizer", "--data", "stdlib",
                          "--vocab", "16000", "--cache-dir", str(tmp_path / "c")],
                         stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    line = ""
    deadline = time.time() + 120
    while "training a" not in line and time.time() < deadline:
        line = p.stderr.readline()
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    graceful = "SIGINT during step" in err                # checkpoint.StopSignal's line
    assert p.returncode in ((0,) if graceful else (-signal.SIGINT, 130)), (p.returncode, err)
    assert "Traceback" not in err, err
    assert not [f for f in os.listdir(tmp_path / "c") if f.endswith(".model")]


@pytest.mark.slow
@pytest.mark.parametrize("after", [0.5, 2.5])
def test_ctrl_c_while_train_py_starts(tmp_path, after):
    """SIGINT while torch loads, or while the config is checked and the corpus indexed: quiet. On a
    fast machine 2.5 s may already reach the training loop, where Ctrl-C is the graceful stop (issue
    17: save the step, exit 0): also quiet, and then it must say so."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path}/o",
                          f"--ckpt.dir={tmp_path}/o/c", f"--data.cache_dir={tmp_path}/c"],
                         stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    graceful = "SIGINT during " in err                    # checkpoint.StopSignal's line (a step, or the set-up)
    assert p.returncode in ((0,) if graceful else (-signal.SIGINT, 130)), (p.returncode, err)
    assert "Traceback" not in err, err


@pytest.mark.slow
def test_train_py_process_prints_one_line(tmp_path):
    """The plain launch: exit code 1 and one line, through train.py's own __main__."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--optim.beta2=1.5",
                        f"--out_dir={tmp_path}/o"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == "error: --optim.beta2=1.5: must be in [0, 1)", r.stderr
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_torchrun_says_a_config_error_once_per_node(tmp_path):
    """Every rank refuses --dp=3 on 2 processes before the process group exists; the line is said
    once (by local rank 0), not once per rank."""
    from gloo_spawn import run_train
    r = run_train([*TINY, "--dp=3", f"--out_dir={tmp_path}/o"], nproc=2, timeout=120)
    said = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and said == ["error: world size 2 != tp*pp*dp = 1*1*3; launch 3 processes or set "
                                          "--dp=2 (or -1 to infer it)"], r.stderr
    assert not os.listdir(tmp_path)


@pytest.mark.slow
def test_torchrun_says_a_refusal_after_the_process_group_once(tmp_path):
    """A corpus too small for one global batch is refused by every rank once the process group
    exists (4096 copies at 4096 ranks): rank 0 says it, the others exit 1 quietly (monitor.say_once)."""
    from gloo_spawn import run_train
    (tmp_path / "small.txt").write_text("a corpus far too small\n")
    r = run_train([*TINY, "--dp=2", "--micro_batch=1", f"--data={tmp_path}/small.txt", f"--out_dir={tmp_path}/o"], nproc=2, timeout=120)
    said = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(said) == 1 and "but one global batch" in said[0], r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["train.py", "--help"], ["checkpoint.py", "--help"], ["configs.py", "show"],
                                  ["configs.py", "--help"]])
def test_output_into_a_closed_pipe_is_no_traceback(argv):
    """`python train.py --help | head -1`: the reader is gone before the text is written. (Gone before
    the child starts: closing it after Popen let a fast child, configs.py, fill the pipe's buffer first
    on a loaded host and exit 0.)"""
    read, write = os.pipe()
    os.close(read)
    p = subprocess.Popen([sys.executable, *argv], stdout=write, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    os.close(write)
    err = p.stderr.read()
    assert p.wait(timeout=120) != 0 and "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize("var,value", [("NNODES", "x"), ("NNODES", "0"), ("NPROC_PER_NODE", "0"),
                                       ("NPROC_PER_NODE", "-3"), ("MAX_RESTARTS", "-1"), ("COMPILE_STEPS", "ten"),
                                       ("MASTER_PORT", "abc")])
def test_launch_sh_refuses_a_bad_number_in_its_environment(var, value):
    """scripts/launch.sh's environment: one line naming the variable (was int('x')'s traceback, or
    a ZeroDivisionError from NPROC_PER_NODE=0), exit 2 as a config error, nothing run."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHON": sys.executable,
           "DRY_RUN": "1", var: value}
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), "train", "--preset=llama2_7b"],
                       capture_output=True, text=True, timeout=60, env=env, cwd="/tmp")
    assert r.returncode == 2 and r.stderr.strip() == f"error: {var}={value}: give a whole number >= " \
        f"{0 if var == 'MAX_RESTARTS' else 1}" and not r.stdout, (r.stderr, r.stdout)


@pytest.mark.parametrize("env,message", [({"MASTER_PORT": "70000"}, "error: MASTER_PORT=70000: give a TCP port, 1 to 65535"),
                                         ({"NODE_RANK": "2"}, "error: NODE_RANK=2: give a whole number below NNODES=2"),
                                         ({"SLURM_NODEID": "x"}, "error: NODE_RANK=x: give a whole number below NNODES=2"),
                                         ({"NPROC_PER_NODE": "64"}, "config error: NPROC_PER_NODE=64: a trn1.32xlarge has 32 "
                                          "NeuronCores (one rank each; trn2: logical cores at LNC=2); give at most 32, or the "
                                          "--instance it runs on")])
def test_launch_sh_refuses_a_port_or_node_rank_out_of_range(env, message):
    """Out of range for torchrun: its ValueError traceback (port) or ranks past the world on every node,
    as a retried failure (exit 1) on each; launch.sh says it in one line with the config error's 2. More ranks
    per node than NeuronCores (64 on a trn1): was printed and started, the ranks past 32 failing in the runtime."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHON": sys.executable,
           "DRY_RUN": "1", "NNODES": "2", "MASTER_ADDR": "node-0", **env}
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), "train", "--preset=llama2_7b"],
                       capture_output=True, text=True, timeout=60, env=env, cwd="/tmp")
    assert r.returncode == 2 and r.stderr.strip() == message and not r.stdout, (r.stderr, r.stdout)


@pytest.mark.slow
def test_launch_sh_names_a_compile_cache_it_cannot_create(tmp_path):
    """NEURON_CACHE_DIR under /proc (or any folder it cannot make): was mkdir's own line, naming neither the
    variable nor a fix, after the node's setup; now one line naming both, exit 2 as a config error, nothing run."""
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHON": sys.executable,
           "NPROC_PER_NODE": "1", "TORCHRUN": "/bin/echo", "NEURON_CACHE_DIR": "/proc/nanotrn-cache"}
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "launch.sh"), "train", f"--out_dir={tmp_path}/o", "--device=cpu"],
                       capture_output=True, text=True, timeout=60, env=env, cwd="/tmp")
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 2 and errors == ["error: NEURON_CACHE_DIR=/proc/nanotrn-cache cannot be created here; give a "
                                            "folder on this node's own disk"] and not r.stdout, (r.stderr, r.stdout)


def test_a_run_refused_for_its_data_leaves_no_trace(W, tmp_path):
    """train.py claims its checkpoint directory (run.lock, the folders made for it) before the data's checks, which
    need the lock's other work (the span index) first: a run refused for its data (a JSON field, a corpus too small)
    left out/ckpt/run.lock behind. What the claim made goes again when the run kept nothing; a folder the user had,
    or a lock an earlier run left, stays as it was."""
    (tmp_path / "a.jsonl").write_text('{"body": "some text"}\n')
    (tmp_path / "small.txt").write_text("tiny text\n")
    (tmp_path / "had").mkdir()
    (tmp_path / "had" / "notes.txt").write_text("mine")
    (tmp_path / "ran" / "ckpt").mkdir(parents=True)
    (tmp_path / "ran" / "ckpt" / "run.lock").write_text("pid 1 on another host")
    for source, why in (("a.jsonl", "no text field 'text'"), ("small.txt", "add data")):
        for out in ("new/o", "had", "ran"):
            before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
            with pytest.raises(Exception, match=why):
                train.main([*TINY, f"--data={tmp_path}/{source}", f"--data.tokenizer={W}/tok.model",
                            f"--out_dir={tmp_path}/{out}", f"--data.cache_dir={tmp_path}/cache"])
            after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if "cache" not in p.parts)
            assert after == [p for p in before if not p.startswith("cache")], (source, out, set(after) ^ set(before))


def test_a_checkpoint_disk_too_full_for_the_tokenizer_is_one_line(W, tmp_path, monkeypatch):
    """The run keeps its tokenizer beside the checkpoints before its first step: on a disk with room
    for run.lock and no more (an 8 KiB tmpfs; a simulated ENOSPC where mounting is not allowed) that
    copy failing is "disk full" by name, a CheckpointError (one line), not an OSError's traceback."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    if not mounted:
        def full(*a, **k):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(shutil, "copyfile", full)
    try:
        with pytest.raises(checkpoint.CheckpointError, match="could not keep the tokenizer in .*tokenizer .disk full."):
            train.main([*TINY, f"--data={W}/corpus", f"--data.tokenizer={W}/tok.model", f"--out_dir={tmp_path}/o",
                        f"--ckpt.dir={small}/ck", f"--data.cache_dir={W}/tokcache"])
    finally:
        if mounted:
            subprocess.run(["umount", str(small)])


def test_new_corpus_continues_at_the_same_layout(W, tmp_path, capsys):
    """The documented route: the run's own tokenizer (kept beside its checkpoints) and
    --ckpt.reset_data continue the model and optimizer on another corpus (the data stream starts afresh)."""
    shutil.copytree(W / "run" / "ckpt", tmp_path / "ck")
    train.main([*TINY, f"--data={W}/other", f"--data.tokenizer={tmp_path}/ck/tokenizer/tokenizer.model", f"--out_dir={tmp_path}/o",
                f"--ckpt.dir={tmp_path}/ck", f"--data.cache_dir={tmp_path}/cache", "--steps=3", "--ckpt.reset_data"])
    out, err = capsys.readouterr()
    assert "resuming from" in out and "the data stream starts afresh" in out, out
    assert os.path.isdir(tmp_path / "ck" / "step_00000003")
    # 3 steps of a 1 + 280 step schedule: said once, on stderr, before the run (configs.warnings)
    assert err.count("warning: --optim.max_steps=3 ends before the lr schedule") == 1, err


def test_a_resume_without_a_tokenizer_takes_the_runs_own(W, tmp_path, capsys):
    """Not the one a new corpus (or a newer nanotrn's recipe) would train: the one kept beside the
    checkpoints, so every token id keeps its meaning; no tokenizer is trained."""
    shutil.copytree(W / "run" / "ckpt", tmp_path / "ck")
    train.main([*TINY, f"--data={W}/other", f"--out_dir={tmp_path}/o", f"--ckpt.dir={tmp_path}/ck",
                f"--data.cache_dir={tmp_path}/cache", "--steps=3", "--ckpt.reset_data"])
    out = capsys.readouterr().out
    assert f"tokenizer: the run's own, kept in {tmp_path}/ck/tokenizer" in out and "resuming from" in out, out
    assert not list((tmp_path / "cache").glob("tokenizer-*.model")), "a tokenizer was trained"
    assert os.path.isdir(tmp_path / "ck" / "step_00000003")


def test_warmup_longer_than_the_run_is_said_out_loud():
    """Not refused (a pre-compile pass stops a schedule early on purpose), but never silent."""
    said = configs.warnings(configs.from_args(["--steps=8"]))
    assert len(said) == 1 and "--optim.warmup_steps=20" in said[0] and "never reaches its peak" in said[0]
    assert not any("never reaches its peak" in w for w in configs.warnings(configs.from_args(["--steps=20"])))


@pytest.mark.parametrize("argv,says", [
    (["--steps=100"], ["--optim.max_steps=100 ends before the lr schedule", "= 300 steps", "--optim.decay_steps=80"]),
    (["--steps=1000"], ["--optim.max_steps=1000 runs 700 steps at --optim.min_lr=0.0001", "--optim.decay_steps=980"]),
    (["--steps=100", "--optim.warmup_steps=10", "--optim.constant_steps=90"], ["ends before", "shorten warmup"]),
    *[(["--preset", name], []) for name in configs.PRESETS],    # the presets' own schedules end with their runs
    (["--steps=330"], []), (["--steps=1000", "--optim.min_lr=1e-3"], []),    # 10% at min_lr; a constant lr
])
def test_an_lr_schedule_that_does_not_end_with_the_run_is_said_once(argv, says):
    """--optim.max_steps far past warmup + constant + decay (most steps at min_lr), or short of it (the cosine never
    reaches min_lr): one warning line naming the fix (nanoGPT's lr_decay_iters ~= max_iters), not a refusal. Was silent."""
    said = configs.warnings(cfg := configs.from_args(argv))
    assert len(said) == len(says[:1]) and all(s in said[0] for s in says), said
    configs.validate(cfg, world_size=cfg.parallel.tp * cfg.parallel.pp)


def test_a_hang_limit_beyond_the_clocks_range_is_no_traceback():
    """--log.hang_factor times the median step can exceed what faulthandler's timer and a thread's wait
    take (~9.2e9 s): the limit is capped, not an OverflowError at the fourth step, hours in."""
    dog = monitor.Watchdog(0, 1e308, 300.0, 300.0)
    for _ in range(5):
        dog.step_done()
    assert dog.limit() == 1e308 * statistics.median(dog.times)     # the limit asked for: only the timers are capped
    dog.close()


@pytest.mark.slow
@pytest.mark.parametrize("pjrt", ["BOGUS", "NEURON", "TPU"])
def test_a_pjrt_device_torch_xla_does_not_know_is_one_line(tmp_path, pjrt):
    """PJRT_DEVICE=BOGUS (torch-xla's own variable): was torch_xla's RuntimeError traceback ('No PjRtPlugin
    registered for: BOGUS'). PJRT_DEVICE=NEURON where the Neuron runtime is missing (libneuronxla: a broken
    venv, or no Trainium): trained on the CPU, exit 0. PJRT_DEVICE=TPU, a plugin torch-xla registers, without
    libtpu: OSError's traceback ('libtpu not found'). A process: importing torch_xla here would change the
    device later tests pick."""
    if importlib.util.find_spec({"NEURON": "libneuronxla", "TPU": "libtpu"}.get(pjrt, "nanotrn_none")):
        pytest.skip(f"the {pjrt} runtime is installed: {pjrt} is a device here")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path}/o"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120, env={**os.environ, "PJRT_DEVICE": pjrt})
    assert r.returncode == 1 and r.stderr.startswith(f"error: PJRT_DEVICE='{pjrt}'") and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not os.listdir(tmp_path), r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("argv,says", [(["xla_check.py", "--threads", "0"], "--threads 0"),
                                       (["xla_check.py", "--threads", "5000", "--", "--tp=3"], "--threads 5000"),
                                       (["xla_check.py", "--", "--tp=3"], "tp 3"),
                                       (["xla_check.py", "--", "--parallel.pp=2"], "scripts/pp_graphs.py"),
                                       (["pp_graphs.py", "--microbatches", "0"], "--microbatches '0'"),
                                       (["pp_graphs.py", "--", "--model.n_heads=0"], "--model.n_heads=0"),
                                       # written at the end: a traceback after the whole run, the report lost
                                       (["xla_check.py", "--json", "tests", "--", "--tp=3"], "'tests' is a directory"),
                                       (["pp_graphs.py", "--graphs", "README.md/g"], "README.md' is a file")])
def test_the_xla_check_scripts_refuse_bad_arguments_in_one_line(argv, says):
    """scripts/xla_check.py and pp_graphs.py: were set_num_threads' RuntimeError, ConfigError's traceback from
    inside train.main, an AttributeError (no microbatches) and a ZeroDivisionError in the model's head_dim.
    Said before any work: torch-xla's import (~10 s) is not among the imports (-X importtime lists them)."""
    r = subprocess.run([sys.executable, "-X", "importtime", os.path.join(ROOT, "scripts", argv[0]), *argv[1:]],
                       capture_output=True, text=True, cwd=ROOT, timeout=300, env={**os.environ, "PJRT_DEVICE": "CPU"})
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1 and says in lines[0], r.stderr
    assert not re.search(r"\| +torch_xla$", r.stderr, re.M), "torch_xla was imported before the refusal"


@pytest.mark.slow
def test_xla_check_says_train_pys_checkpoint_refusal_in_one_line(tmp_path):
    """train.py's refusals that are not ConfigErrors (a CheckpointError, here: step folders without the
    tokenizer their model was trained with) were a traceback from xla_check, which caught only ConfigError."""
    (tmp_path / "ckpt" / "step_00000001").mkdir(parents=True)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "xla_check.py"), "--", f"--ckpt.dir={tmp_path}/ckpt",
                        f"--out_dir={tmp_path}/o", f"--data.cache_dir={tmp_path}/cache"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PJRT_DEVICE": "CPU"})
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
    assert "holds checkpoints but not the tokenizer" in lines[0], r.stderr


@pytest.mark.slow
def test_bf16_sr_where_nothing_rounds_stochastically_is_one_line(tmp_path):
    """--optim.precision=bf16_sr on XLA leaves the rounding to the device (Trainium's, with
    NEURON_RT_STOCHASTIC_ROUNDING_EN=1). On XLA:CPU nothing rounds stochastically: the run trained
    as plain bf16 (round to nearest, the mode the blog saw fall behind) under the name bf16_sr, exit 0."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path}/o", "--device=xla",
                        "--optim.precision=bf16_sr", "--steps=1"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env={**os.environ, "PJRT_DEVICE": "CPU"})
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.startswith("error: --optim.precision=bf16_sr") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--optim.precision=bf16" in r.stderr and not os.listdir(tmp_path), r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("var,precision", [("XLA_USE_BF16", "fp32"), ("XLA_DOWNCAST_BF16", "mixed")])
def test_torch_xlas_deprecated_bf16_variables_are_one_line(tmp_path, var, precision):
    """XLA_USE_BF16 / XLA_DOWNCAST_BF16 (deprecated; NxD's examples still export them) make torch-xla keep every
    fp32 tensor in bf16 on the device: the fp32 weights, master copy, moments and update of --optim.precision.
    Were tracebacks: fp32 after the checkpoint directory's claim (the HLO verifier: 'Seen floating point types
    of different precisions'), mixed from optim's dtype check ('embed.weight is torch.float32')."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path}/o", "--device=xla",
                        f"--optim.precision={precision}", "--steps=1"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300, env={**os.environ, "PJRT_DEVICE": "CPU", var: "1"})
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-3000:]
    assert f"{var}=1" in lines[0] and "--optim.precision" in lines[0] and not os.listdir(tmp_path), r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("value", ["1", "true"])
def test_functionalization_off_is_one_line(tmp_path, value):
    """XLA_DISABLE_FUNCTIONALIZATION=1 (Neuron's default; scripts/env.sh exports 0): torch-xla then returns wrong
    data from a split along the last dimension (pytorch/xla#8640), which the model's qkv and gate_up are. Was:
    trained, exit 0, the tiny model's first loss 8.3002 where eager CPU's and XLA's with it on are 8.2975."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path}/o", "--device=xla",
                        "--steps=1"], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PJRT_DEVICE": "CPU", "XLA_DISABLE_FUNCTIONALIZATION": value})
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-3000:]
    assert f"XLA_DISABLE_FUNCTIONALIZATION={value}" in lines[0] and "=0" in lines[0] and not os.listdir(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("pjrt", [None, "CPU"])
def test_multi_process_xla_on_a_cpu_host_is_refused_before_torch_xlas_import(tmp_path, pjrt):
    """--device=xla in a torchrun world of 2 on XLA:CPU (PJRT_DEVICE=CPU, or unset: torch-xla's default) has no
    collectives between processes. Refused in parallel.init_distributed, after torch_xla's import (seconds per
    process; 60-150 s for 2 processes on a loaded host) and the config's checks: now before the import."""
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    env.update({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29999", **({"PJRT_DEVICE": pjrt} if pjrt else {})})
    r = subprocess.run([sys.executable, "-X", "importtime", os.path.join(ROOT, "train.py"), f"--out_dir={tmp_path}/o",
                        "--device=xla", "--dp=2"], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr[-3000:]
    assert "multi-process XLA needs Trainium (PJRT_DEVICE=NEURON)" in lines[0] and "--device=cpu" in lines[0], lines
    assert not re.search(r"\| +torch_xla$", r.stderr, re.M), "torch_xla was imported before the refusal"
    assert not os.listdir(tmp_path)


def test_a_run_lists_its_corpus_once_a_rank(W, tmp_path, monkeypatch):
    """train.py checks --data before any work (mixture_files) and Corpus then needs the same listing: listed twice,
    every rank walked the corpus twice at start (a stat a file, a metadata request each on a shared file system,
    x4096 ranks). Corpus takes the check's listing: one walk a rank."""
    import corpus
    calls, real = [], corpus.resolve_paths
    monkeypatch.setattr(corpus, "resolve_paths", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    train.main([*TINY, f"--data={W}/corpus", f"--data.tokenizer={W}/tok.model", f"--out_dir={tmp_path}/o",
                f"--ckpt.dir={tmp_path}/ck", f"--data.cache_dir={tmp_path}/cache", "--steps=1"])
    assert calls == [f"{W}/corpus"], calls
