"""Presets hold the blog's settings; overrides are type-checked; bad layouts fail before any work."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import configs  # noqa: E402
from configs import ConfigError  # noqa: E402


def test_7b_preset_is_the_blogs_table():
    c = configs.llama2_7b()
    m, p, o, d = c.model, c.parallel, c.optim, c.data
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size) == (4096, 32, 32, 32, 11008, 32000)
    assert (d.seq_len, d.global_batch, d.micro_batch) == (4096, 1024, 1)
    assert (o.lr, o.min_lr, o.warmup_steps, o.decay_steps, o.max_steps, o.constant_steps) == (3e-4, 3e-5, 2000, 478_000, 500_000, 0)
    assert (o.beta1, o.beta2, o.eps, o.weight_decay, o.grad_clip, o.decay_norms) == (0.9, 0.95, 1e-5, 0.1, 1.0, True)
    assert (p.tp, p.pp, p.sp, o.precision, m.checkpointing) == (8, 1, True, "bf16_sr", "selective")
    # 128 trn1.32xlarge = 4096 NeuronCores: DP 512, gradient accumulation 2 (the blog's table)
    configs.validate(c, world_size=128 * 32)
    assert configs.resolve_dp(c, 4096) == 512 and configs.grad_accum_steps(c, 512) == 2


def test_70b_preset_is_hlats_layout():
    c = configs.llama2_70b()
    m, p = c.model, c.parallel
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim) == (8192, 80, 64, 8, 28672)
    assert (p.tp, p.pp, p.zero1, c.data.seq_len, c.data.global_batch) == (32, 8, True, 4096, 1024)
    configs.validate(c, world_size=256 * 32)     # HLAT: 256 nodes; 8 KV heads replicated over TP=32
    # on Trainium: NxD's point-to-point (all-gather over neighbour pairs), an even PP
    assert p.pp_p2p == "allgather"
    configs.validate(c, world_size=256 * 32, backend="xla")


@pytest.mark.parametrize("args,message", [
    (["--pp=2", "--parallel.pp_p2p=send", "--global_batch=32"], "--parallel.pp_p2p='send' does not work on the xla backend.*"
                                           "use --parallel.pp_p2p=allgather"),
    (["--pp=3", "--parallel.pp_p2p=allgather", "--model.n_layers=3", "--global_batch=48"],
     "pp 3 on the xla backend must be even.*use pp 2 or 4"),
    (["--pp=4", "--parallel.pp_p2p=allgather", "--model.n_layers=4", "--global_batch=64", "--model.tie_embeddings"],
     "tied embeddings with pp 4 on the xla backend"),
])
def test_xla_backend_rules_fail_before_any_work(args, message):
    """What the xla backend cannot run is refused in validation, on xla only (gloo runs it)."""
    cfg = configs.from_args(args)
    configs.validate(cfg, 2 * cfg.parallel.pp, backend="gloo")
    with pytest.raises(ConfigError, match=message):
        configs.validate(cfg, 2 * cfg.parallel.pp, backend="xla")


def test_overrides_are_typed():
    c = configs.from_args(["--model.n_layers=2", "--optim.lr", "3e-3", "--parallel.sp", "--tp=2",
                           "--data.global_batch=1_024"])
    assert c.model.n_layers == 2 and c.optim.lr == 3e-3 and c.parallel.sp is True
    assert c.parallel.tp == 2 and c.data.global_batch == 1024
    with pytest.raises(ConfigError, match="expected an int"):
        configs.from_args(["--model.n_layers=two"])
    with pytest.raises(ConfigError, match="choose one of fp32, mixed, bf16, bf16_sr"):
        configs.from_args(["--optim.precision=fp16"])


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"did you mean --model\.n_layers"):
        configs.from_args(["--model.n_layer=4"])
    with pytest.raises(ConfigError, match=r"did you mean --optim\.warmup_steps"):
        configs.from_args(["--optim.warmup=4"])
    with pytest.raises(ConfigError, match="unknown preset 'llama2_7B'.*llama2_7b"):
        configs.from_args(["--preset", "llama2_7B"])


@pytest.mark.parametrize("flag,hint", [         # nanoGPT's, torchtitan's and Hugging Face's names for ours
    ("--learning_rate", "--optim.lr (--lr)"), ("--batch_size", "--data.global_batch (--global_batch), --data.micro_batch"),
    ("--max_iters", "--optim.max_steps (--steps)"), ("--n_layer", "--model.n_layers"), ("--n_embd", "--model.dim"),
    ("--warmup_iters", "--optim.warmup_steps"), ("--grad_clip", "--optim.grad_clip"), ("--block_size", "--data.seq_len"),
    ("--lr_decay_iters", "--optim.decay_steps"), ("--training.seq_len", "--data.seq_len (--seq_len)"),
    ("--max_grad_norm", "--optim.grad_clip"), ("--hidden_size", "--model.dim"), ("--optim.learning_rate", "--optim.lr")])
def test_other_trainers_names_get_our_flag_as_a_hint(flag, hint):
    """The hint matches the unknown key's last part against each key's last part and the aliases, and knows other
    trainers' names no spelling brings near: --learning_rate hinted --log.hang_factor, --batch_size nothing."""
    with pytest.raises(ConfigError) as e:
        configs.from_args([f"{flag}=1"])
    assert f"did you mean {hint}" in str(e.value) and str(e.value).count("--") <= 6, str(e.value)


@pytest.mark.parametrize("flag,keys", [("--interval", ["--log.interval", "--ckpt.interval"]),
                                       ("--checkpoint.interval", ["--log.interval", "--ckpt.interval"]),
                                       ("--rng_seed", ["--seed", "--data.seed"])])
def test_a_name_that_ends_several_keys_hints_each(flag, keys):
    """A last part that several keys share hints every one of them: --interval hinted --log.interval and
    --log.eval_interval, never --ckpt.interval (one key kept per last part)."""
    with pytest.raises(ConfigError) as e:
        configs.from_args([f"{flag}=1"])
    hint = str(e.value).split("did you mean ")[1].split("?")[0].split(", ")
    assert all(k in hint for k in keys), str(e.value)


@pytest.mark.parametrize("args,world,message", [
    (["--model.n_heads=8", "--model.n_kv_heads=4", "--tp=3"], 3, "n_heads 8 is not divisible by tp 3"),
    (["--model.n_heads=8", "--model.n_kv_heads=4", "--tp=8", "--global_batch=16"], 8, None),   # KV replication: fine
    (["--model.n_heads=12", "--model.n_kv_heads=4", "--tp=6", "--model.dim=384"], 6, "n_kv_heads 4 and tp 6"),
    (["--model.n_layers=4", "--pp=3"], 3, "n_layers 4 is not divisible by pp 3"),
    (["--model.n_layers=4", "--pp=3", "--parallel.pp_cuts=1,2", "--global_batch=24"], 3, None),
    # a stage of no layers: a cut at 0, or two cuts at one layer
    (["--model.n_layers=4", "--pp=3", "--parallel.pp_cuts=0,2", "--global_batch=24"], 3, "pp_cuts '0,2' must be 2 increasing"),
    (["--model.n_layers=4", "--pp=3", "--parallel.pp_cuts=2,2", "--global_batch=24"], 3, "pp_cuts '2,2' must be 2 increasing"),
    (["--global_batch=12", "--micro_batch=8"], 1, "global batch 12 is not divisible by micro_batch\\*dp = 8\\*1"),
    (["--global_batch=16", "--micro_batch=8"], 4, "global batch 16 is not divisible by micro_batch\\*dp = 8\\*4"),
    (["--tp=2"], 3, "world size 3 is not divisible by tp\\*pp = 2\\*1"),
    (["--tp=2", "--dp=2"], 6, "world size 6 != tp\\*pp\\*dp = 2\\*1\\*2"),
    (["--pp=2", "--model.n_layers=4", "--global_batch=8", "--micro_batch=8"], 2, "needs at least 2 microbatches"),
    (["--model.dim=100", "--model.n_heads=8"], 1, "--model.dim=100 is not divisible by --model.n_heads=8"),
    (["--data.seq_len=512"], 1, "--seq_len=512 exceeds --model.max_seq_len=256"),
    (["--sp", "--tp=2", "--data.seq_len=255"], 2, "sequence parallelism splits --seq_len=255"),
])
def test_bad_layouts_fail_with_clear_errors(args, world, message):
    cfg = configs.from_args(args)
    if message is None:
        configs.validate(cfg, world)
    else:
        with pytest.raises(ConfigError, match=message):
            configs.validate(cfg, world)


@pytest.mark.slow
def test_train_rejects_bad_config_before_any_work(tmp_path):
    """A bad layout exits with the error, without tokenizing, building a model or writing output."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--tp=3", f"--out_dir={tmp_path}/out",
                        f"--data.cache_dir={tmp_path}/cache"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "n_heads 8 is not divisible by tp 3" in r.stderr
    assert not os.listdir(tmp_path)


def help_lines(out: str) -> dict[str, str]:
    """--help's output -> {"--section.key=VALUE": comment}; a long flag's comment is on the next line."""
    lines, table = out.splitlines(), {}
    for i, line in enumerate(lines):
        if line.startswith("  --"):
            flag, _, text = line.strip().partition(" ")
            text = text.strip()
            if text.startswith("(--"):                      # the short alias
                text = text.partition(")")[2].strip()
            table[flag] = text or lines[i + 1].strip()
    return table


def test_help_prints_every_key_with_its_value_and_comment(capsys):
    import plan
    import train
    comments = configs.field_comments()
    train.main(["--help"])                          # no model, no process group: the table and return
    shown = help_lines(capsys.readouterr().out)
    keys = configs._all_keys(configs.tiny())
    assert len(shown) == len(keys)
    for key, (holder, f) in keys.items():
        comment = comments[(type(holder).__name__, f.name)]
        assert comment, f"--{key} has no end-of-line comment in configs.py, so --help explains nothing"
        value = getattr(holder, f.name)
        flag = f"--{key}={str(value).lower() if isinstance(value, bool) else value}"
        assert shown[flag].startswith(comment), (flag, shown.get(flag))
    # the planner's help: its own preset (llama2_7b unless given), the flags given applied
    plan.main(["--preset", "llama2_70b", "--tp=8", "--help"])
    shown = help_lines(capsys.readouterr().out)
    assert "--parallel.tp=8" in shown and "--model.dim=8192" in shown and "--model.n_layers=80" in shown
    with pytest.raises(ConfigError, match="unknown config key --nope.*--help lists them all"):
        train.main(["--nope", "--help"])


def test_every_short_alias_sets_its_key():
    for alias, key in configs.ALIASES.items():
        section, name = key.split(".")
        default = getattr(getattr(configs.Config(), section), name)
        value = (configs.CHOICES[key][-1] if key in configs.CHOICES else not default if isinstance(default, bool)
                 else default + 3 if isinstance(default, (int, float)) else "x.txt")
        text = str(value).lower() if isinstance(value, bool) else str(value)
        for argv in ([f"--{alias}={text}"], [f"--{alias}", text]):
            c = configs.from_args(argv)
            assert getattr(getattr(c, section), name) == value, (argv, key)


def test_a_read_only_mount_is_named_not_the_users_rights(tmp_path):
    """--ckpt.dir (any output folder) on a read-only mount says so: "not writable by this user" sent
    the user (root included, who may write anything) to chmod, which cannot help."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k,ro", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("mounting a read-only tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        with pytest.raises(ConfigError, match=f"--ckpt.dir='{ro}/ckpt': {ro} is on a read-only file system; give"):
            configs.check_dir("ckpt.dir", str(ro / "ckpt"))
    finally:
        subprocess.run(["umount", str(ro)], check=True)
    configs.check_dir("ckpt.dir", str(ro / "ckpt"))         # the folder under it is writable again


def test_a_path_under_a_folder_this_user_cannot_search_names_the_folder(tmp_path):
    """--out_dir (any output folder) under another user's folder of mode 0700: its stat fails with EACCES, and the
    refusal said "is unreadable (Permission denied), not a directory; remove it", which no one can do there. It names
    the folder that cannot be searched and the fix, as a plain user (root's bypass dropped: conftest.as_plain_user)."""
    from conftest import as_plain_user
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() == 0:
        os.chown(locked, 65534, -1)          # nobody's; a plain user's own folder of mode 0600 stands in for it
    locked.chmod(0o700 if os.geteuid() == 0 else 0o600)
    script = (f"import sys\nsys.path.insert(0, {ROOT!r})\nimport configs\nfor p in ('run', 'run/a/b'):\n    try:\n"
              f"        configs.check_dir('out_dir', {str(locked)!r} + '/' + p)\n"
              f"    except configs.ConfigError as e:\n        print(e)\n")
    r = subprocess.run([*as_plain_user(), sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines() == [f"--out_dir='{locked}/{p}': {locked} is a folder this user cannot search: fix its "
                                     f"permissions (x for this user), or give another path" for p in ("run", "run/a/b")], r


def test_the_readmes_training_commands_start_without_a_warning():
    """Each `python train.py ...` and `make train ARGS="..."` of README.md is valid and says no warning at start: a new
    user's first commands (`--steps=100` cut the tiny preset's 280-step cosine at 80: 'lr schedule does not end ...').
    Each writes outside `make train`'s out/: run after it there, another model was refused ('out/ckpt holds another
    model')."""
    import re
    import shlex
    text = open(os.path.join(ROOT, "README.md")).read()
    runs = [shlex.split(c.split("#")[0]) for c in re.findall(r"^python train\.py(.*)$", text, re.M)]
    runs += [shlex.split(c) for c in re.findall(r'make train ARGS="([^"]*)"', text)]
    runs = [r for r in runs if "--help" not in r]
    assert len(runs) >= 2, runs
    for argv in runs:
        cfg = configs.from_args(argv)
        configs.check_values(cfg)
        assert configs.warnings(cfg) == [], argv
        default = configs.from_args([])
        assert cfg.out_dir != default.out_dir and cfg.ckpt.dir != default.ckpt.dir, argv


def test_the_readme_stays_under_11_kb():
    """Issue 29: the README is the short way in (what nanotrn is, two commands, the files, a run, presets, trn1, EKS)
    and docs/*.md the long one; a section added there must pay for itself by moving or cutting another."""
    size = os.path.getsize(os.path.join(ROOT, "README.md"))
    assert size < 11_000, f"README.md is {size} bytes: move detail to docs/*.md"


def test_a_path_under_a_file_names_the_file(tmp_path):
    # `--out_dir=notes.txt/run`: "'notes.txt/run' is unreadable (Not a directory), not a directory;
    # remove it" named no file to remove; the file in the way is what to fix
    (tmp_path / "notes.txt").write_text("a user's notes")
    with pytest.raises(configs.ConfigError) as e:
        configs.check_dir("out_dir", str(tmp_path / "notes.txt" / "run"))
    assert str(e.value) == (f"--out_dir='{tmp_path}/notes.txt/run': {tmp_path}/notes.txt is a file, not a directory; "
                            f"give another path")
    assert (tmp_path / "notes.txt").read_text() == "a user's notes"


DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))


def doc_commands(text):
    """The shell commands a page shows: each line of its fenced blocks, each inline code span (joined across lines)."""
    import re
    for block in re.findall(r"^```\w*\n(.*?)^```", text, re.S | re.M):
        yield from block.replace("\\\n", " ").splitlines()
    for span in re.findall(r"`([^`]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)):
        yield span.replace("\n", " ")


def test_the_docs_train_flags_and_commands_exist():
    """A new user copies the docs' commands: every `--section.key` a page names is a config key, and every command
    line that reaches train.py (python train.py, torchrun, launch.sh, the sbatch, `make train ARGS=`) parses and starts
    without a warning. A key renamed in configs.py with a page left behind fails here, not in the user's shell;
    checkpoints.md's recovery demo (--steps=20) warned that it cut the tiny preset's 300-step schedule."""
    import re
    import shlex
    keys = set(configs._all_keys(configs.tiny()))
    to_train = re.compile(r"(?:\bpython train\.py|\btorchrun .*?\btrain\.py|scripts/launch\.sh +(?:train|compile|health)"
                          r"|slurm_train\.sbatch|make train ARGS=\")(.*)")
    parsed = 0
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        named = set(re.findall(r"(?<![\w-])--([a-z_]+\.[\w.]*\w)", text)) - {"section.key"}   # README's pattern
        assert named <= keys, (doc, sorted(named - keys))
        for command in doc_commands(text):
            m = to_train.search(command)
            argv = shlex.split(re.split(r"\s#|[\"|;&]", m.group(1))[0]) if m else ["--help"]
            if "--help" not in argv:
                assert configs.warnings(configs.from_args(argv)) == [], (doc, argv)   # ConfigError: a bad flag
                parsed += 1
    assert parsed >= 20, parsed                         # the pattern still finds the pages' commands


def test_the_docs_bench_and_prepare_commands_parse(monkeypatch):
    """The docs' other commands a user copies: every `bench.py WHICH --flag` (also `make bench ARGS=`) and `python
    data.py prepare ... --flag` parses with the real parser, and bench.py's flags pass its checks (a flag its WHICH
    does not read is refused). A flag renamed in benchmarks/cli.py or data.py fails here, not in the user's shell.
    Nothing runs past the parse: parse_args hands back its result instead of returning to the command."""
    import argparse
    import re
    import shlex
    import data
    from benchmarks import cli

    class Parsed(Exception):
        pass
    parse = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", lambda self, a=None, n=None: (_ for _ in ()).throw(
        Parsed(self, parse(self, a, n))))
    pattern = re.compile(r"(\bbench\.py +|make bench ARGS=\"|\bpython data\.py +)(\w.*)")
    parsed = 0
    for doc in DOCS:
        for command in doc_commands(open(os.path.join(ROOT, doc)).read()):
            for tool, args in pattern.findall(command):
                argv = shlex.split(re.split(r"\s#|[\"|;&`]", args)[0])
                if "data.py" in tool and not any(a.startswith("-") for a in argv):
                    continue                            # `python data.py prepare` named in a sentence
                try:                                    # SystemExit 2: a flag or value the parser refuses,
                    with pytest.raises(Parsed) as e:    # or one this benchmark does not read (check_args)
                        (data.main if "data.py" in tool else cli.main)(argv)
                    if "data.py" not in tool:
                        cli.check_args(*e.value.args)
                except SystemExit:
                    pytest.fail(f"{doc}: `{tool}{shlex.join(argv)}` does not parse (above)")
                parsed += 1
    assert parsed >= 10, parsed                         # the pattern still finds the pages' commands


def test_the_docs_links_and_cited_names_exist():
    """Every relative link of README.md and docs/*.md resolves, and every `module.name` they cite (spans.span_bytes,
    monitor.Watchdog) is still in that module: the pages send readers to code by these names."""
    import importlib
    import re
    modules = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for link in re.findall(r"\]\(([^)\s#]+)[^)\s]*\)", text):
            if not re.match(r"[a-z]+:", link):
                assert os.path.exists(os.path.join(ROOT, os.path.dirname(doc), link)), (doc, link)
        for module, name in set(re.findall(r"`([a-z_]+)\.([A-Za-z_][\w.]*)`", text)):
            if module in modules and name.split(".")[0] not in ("py", "log", "safetensors"):   # file names
                obj = importlib.import_module(module)
                for part in name.split("."):
                    assert hasattr(obj, part), (doc, f"{module}.{name}")
                    obj = getattr(obj, part)


def test_the_testing_page_names_every_shared_test_helper():
    """docs/testing.md lists what tests/conftest.py and tests/gloo_spawn.py share: every public function and class of
    theirs is named there (mixture_counts, FixedLoader, as_plain_user, run_in_xla_world_of_one, help_flags, cache_arg
    and gloo_spawn's functions were not), so a new test finds the helper instead of writing it again."""
    import ast
    text = open(os.path.join(ROOT, "docs", "testing.md")).read()
    for helpers in ("conftest.py", "gloo_spawn.py"):
        tree = ast.parse(open(os.path.join(ROOT, "tests", helpers)).read())
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")]
        assert len(names) >= 5 and [n for n in names if f"`{n}`" not in text] == [], helpers


def test_a_folder_even_root_cannot_write_into_is_refused(tmp_path):
    """/proc (and /sys, a read-only mount) refuse a new folder even to root, whom os.access lets write anywhere: the
    output folders were accepted, and a run failed at its first TensorBoard event or its export, after training
    (`--log.tensorboard=/proc/x`: FileNotFoundError's traceback). The check tries for real and leaves nothing."""
    with pytest.raises(ConfigError, match=r"^--log.tensorboard='/proc/nanotrn/tb': /proc is not writable \(.+\); give"):
        configs.check_dir("log.tensorboard", "/proc/nanotrn/tb")
    configs.check_dir("out_dir", str(tmp_path / "new" / "run"))       # a folder that can be made: no error, nothing left
    assert os.listdir(tmp_path) == []


def test_a_tilde_after_the_equals_sign_is_the_home_folder(monkeypatch, tmp_path):
    """bash expands ~ only at a word's start: `--data=~/corpus` reached nanotrn as '~/corpus', refused as
    "data source '~/corpus' does not exist" though it did. Path keys expand it as the shell would, each
    source of --data; anything else is kept as given."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = configs.from_args(["--data=~/code.jsonl:0.7,prose.txt,~/more", "--tokenizer=~/t.model", "--init_from=~/m",
                             "--out_dir=~/run", "--data.cache_dir=~/.cache", "--data.text_field=~x"])
    assert cfg.data.data == f"{tmp_path}/code.jsonl:0.7,prose.txt,{tmp_path}/more"
    assert (cfg.data.tokenizer, cfg.init_from, cfg.out_dir) == (f"{tmp_path}/t.model", f"{tmp_path}/m", f"{tmp_path}/run")
    assert (cfg.ckpt.dir, cfg.log.tensorboard, cfg.data.cache_dir) == (f"{tmp_path}/run/ckpt", f"{tmp_path}/run/tb", f"{tmp_path}/.cache")
    assert cfg.data.text_field == "~x"
