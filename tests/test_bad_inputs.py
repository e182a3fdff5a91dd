"""Every bad input through the CLI: ``error: <message naming the culprit>`` on stderr, exit code 2,
no traceback, no ``*.tmp`` left behind, and a run's ``config.yaml`` untouched by a command that then fails.

The inputs are made here (tiny Criteo/Avazu-format text, shards, a profile, a plan, runs) by the CLI itself;
each case damages a copy and runs one ``embedscale`` command: in this process through click's ``CliRunner``
(the same ``main`` the ``embedscale`` script runs: exit code and stderr as the shell sees them, an escaping
exception is exit 1 and fails the case), or as a subprocess where the process is what is tested (a file size
limit set before it starts; a launch on several ranks, whose ranks write to the process's own stderr).
"""

from __future__ import annotations

import gzip
import json
import os
import random
import resource
import shutil
import signal
import stat
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner

from embedscale.cli import main
from embedscale.io import atomic_write_text
from embedscale.specs import AVAZU_COLUMNS

SRC = Path(__file__).resolve().parents[1] / "src"
ROWS = 240
FAST = ["--data-source", "shards", "--train-batch-size", "32", "--train-max-steps", "2", "--train-eval-every", "0",
        "--train-log-every", "1", "--model-embedding-dim", "4", "--model-bottom-mlp", "8", "--model-top-mlp", "8",
        "--train-prefetch", "0", "--no-progress"]


def embedscale(*args, preexec_fn=None, timeout=600) -> subprocess.CompletedProcess:
    argv = [str(a) for a in args]
    if preexec_fn is None and "--nproc" not in argv:
        r = CliRunner().invoke(main, argv, prog_name="embedscale")
        err = r.stderr
        if r.exception is not None and not isinstance(r.exception, SystemExit):  # what the shell would show
            err += "".join(traceback.format_exception(r.exception))
        return subprocess.CompletedProcess(["embedscale", *argv], r.exit_code, r.stdout, err)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "embedscale", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout, preexec_fn=preexec_fn)


def ok(*args) -> subprocess.CompletedProcess:
    p = embedscale(*args)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def criteo_text(n: int, seed: int = 0) -> str:
    r = random.Random(seed)
    lines = []
    for _ in range(n):
        dense = [str(r.randint(0, 50)) if r.random() > 0.1 else "" for _ in range(13)]
        cats = [f"{r.randrange(16 ** 6):08x}"[: r.choice([8, 8, 8, 0]) or 0] for _ in range(26)]
        lines.append("\t".join([str(int(r.random() < 0.3)), *dense, *cats]))
    return "\n".join(lines) + "\n"


def avazu_text(n: int, seed: int = 0) -> str:
    r = random.Random(seed)
    lines = [",".join(AVAZU_COLUMNS)]
    for i in range(n):
        cats = [f"{r.randrange(16 ** 8):08x}" for _ in AVAZU_COLUMNS[3:]]
        lines.append(",".join([str(10 ** 18 + i), str(int(r.random() < 0.2)), f"141021{r.randint(0, 23):02d}",
                               *cats]))
    return "\n".join(lines) + "\n"


def truncated_gz(path: Path, text: str) -> None:
    data = gzip.compress(text.encode())
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Raw files, shards ``d``, profile ``p``, plan ``plans/oper``, a run ``run`` with a checkpoint and a run
    ``noeval`` trained with ``data.eval_fraction 0``."""
    b = tmp_path_factory.mktemp("bad")
    text, atext = criteo_text(ROWS), avazu_text(ROWS)
    (b / "c.tsv").write_text(text)
    (b / "a.csv").write_text(atext)
    truncated_gz(b / "c_trunc.gz", text)
    truncated_gz(b / "a_trunc.gz", atext)
    (b / "c_plain.gz").write_text(text)
    (b / "a_plain.gz").write_text(atext)
    ok("data", "criteo", b / "c.tsv", "--out", b / "d", "--table-rows", "20", "--no-progress")
    ok("profile", b / "d", "--out", b / "p", "--no-progress")
    ok("plan", "--profile", b / "p", "--out", b / "plans", "--dim", "4")
    ok("train", *FAST, "--data-path", b / "d", "--run-dir", b / "run")
    ok("train", *FAST, "--data-path", b / "d", "--run-dir", b / "noeval", "--data-eval-fraction", "0")
    return b


@pytest.fixture(scope="module")
def sharded(base) -> Path:
    """A 2-rank run (the one multi-rank launch of this file): its checkpoint has rank-00000.pt and rank-00001.pt."""
    ok("train", *FAST, "--data-path", base / "d", "--run-dir", base / "run2", "--nproc", "2",
       "--dist-timeout-s", "120")
    return base / "run2"


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)  # checkpoints/best stays the link to step-N the run wrote
    return dst


def truncate(path: Path, keep: int = 600) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def rank_file(run: Path, rank: int) -> Path:
    (ck,) = sorted((run / "checkpoints").iterdir())[-1:]
    return ck / f"rank-{rank:05d}.pt"


def edit_json(path: Path, fn) -> None:
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def file_size_limit(limit: int):
    """preexec_fn: files larger than ``limit`` bytes cannot be written (EFBIG, what a full disk looks like to the
    writer: every write path ends in the same OSError handling); SIGXFSZ ignored so the write fails, not the process."""

    def fn():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return fn


def read_only_dir(tmp: Path) -> Path:
    """A directory nothing can be written under: a 0555 directory, or for root (whom modes do not stop) a
    path under the read-only /sys."""
    if os.geteuid() != 0:
        d = tmp / "ro"
        d.mkdir()
        d.chmod(0o555)
        return d / "out"
    if Path("/sys").is_dir() and _sys_read_only():
        return Path("/sys/embedscale-bad-inputs-test")
    pytest.skip("running as root without a read-only /sys")


def _sys_read_only() -> bool:
    try:
        os.mkdir("/sys/embedscale-bad-inputs-probe")
    except OSError:
        return True
    os.rmdir("/sys/embedscale-bad-inputs-probe")
    return False


# ---------------------------------------------------------------------------------------------------------------
# the cases: each returns (argv, strings stderr must name, run dir whose config.yaml must stay, preexec_fn)

def case_gz(kind, fmt):
    def make(b, t, request):
        f = b / f"{'c' if fmt == 'criteo' else 'a'}_{kind}.gz"
        return ["data", fmt, f, "--out", t / "out", "--no-progress"], \
            [str(f), "truncated gzip" if kind == "trunc" else "not a gzip file"], None, None
    return make


def case_gz_train(b, t, request):
    f = b / "c_trunc.gz"
    return ["train", *FAST, "--data-source", "criteo", "--data-path", f, "--run-dir", t / "r"], \
        [str(f), "truncated gzip"], None, None


def case_read_only(cmd):
    def make(b, t, request):
        out = read_only_dir(t)
        argv = {"data": ["data", "criteo", b / "c.tsv", "--out", out, "--no-progress"],
                "profile": ["profile", b / "d", "--out", out, "--no-progress"],
                "plan": ["plan", "--profile", b / "p", "--out", out, "--dim", "4"],
                "train": ["train", *FAST, "--data-path", b / "d", "--run-dir", out]}[cmd]
        return argv, [str(out)], None, None
    return make


def case_full_disk(cmd, limit):
    def make(b, t, request):
        out = t / "out"
        argv = {"data": ["data", "criteo", b / "c.tsv", "--out", out, "--no-progress"],
                "profile": ["profile", b / "d", "--out", out, "--no-progress"],
                "train": ["train", *FAST, "--data-path", b / "d", "--run-dir", out, "--train-checkpoint-every", "1"]
                }[cmd]
        return argv, [str(out), "File too large"], None, file_size_limit(limit)
    return make


def case_manifest(kind):
    def make(b, t, request):
        d = copy(b / "d", t / "d")
        if kind == "rows":
            edit_json(d / "manifest.json", lambda m: m["shards"][0].update(rows=ROWS + 7))
            want = [str(d / "manifest.json"), "shard-00000.arrow", str(ROWS + 7), str(ROWS)]
        else:
            edit_json(d / "manifest.json",
                      lambda m: m["sparse"].append({"name": "C27", "num_rows": 5, "multi_hot": False}))
            want = [str(d / "manifest.json"), "'C27'", "shard-00000.arrow"]
        return ["profile", d, "--out", t / "p", "--no-progress"], want, None, None
    return make


def case_manifest_train(b, t, request):
    d = copy(b / "d", t / "d")
    edit_json(d / "manifest.json", lambda m: m["shards"][0].update(rows=ROWS + 7))
    run = copy(b / "run", t / "run")
    return ["train", *FAST, "--data-path", d, "--run-dir", run, "--train-max-steps", "4"], \
        [str(d / "manifest.json"), "shard-00000.arrow"], run, None


def case_non_utf8(what):
    def make(b, t, request):
        if what == "plan":
            plan = copy(b / "plans" / "oper", t / "plan")
            raw = (plan / "plan.json").read_bytes()
            (plan / "plan.json").write_bytes(raw[:40] + b"\xff\xfe" + raw[40:])
            return ["drift", plan, "--profile", b / "p"], [str(plan / "plan.json"), "UTF-8"], None, None
        prof = copy(b / "p", t / "p")
        raw = (prof / "profile.json").read_bytes()
        (prof / "profile.json").write_bytes(raw[:40] + b"\xc3\x28" + raw[40:])
        return ["plan", "--profile", prof, "--out", t / "plans", "--dim", "4"], \
            [str(prof / "profile.json"), "UTF-8"], None, None
    return make


def case_partitions(nproc):
    def make(b, t, request):
        plan = copy(b / "plans" / "oper", t / "plan")
        truncate(plan / "partitions.npz", 200)
        if nproc == 1:
            return ["drift", plan, "--profile", b / "p"], [str(plan / "partitions.npz")], None, None
        return ["train", *FAST, "--data-path", b / "d", "--run-dir", t / "r", "--nproc", "2", "--dist-plan", plan], \
            [str(plan / "partitions.npz")], None, None
    return make


def case_config(flags, want):
    def make(b, t, request):
        run = copy(b / "run", t / "run")
        return ["train", *FAST, "--data-path", b / "d", "--run-dir", run, "--train-max-steps", "4", *flags], \
            want, run, None
    return make


def case_config_file(b, t, request):
    cfg = t / "c.yaml"
    cfg.write_text("train:\n  lr_dense: .nan\n")
    run = copy(b / "run", t / "run")
    return ["train", "--config", cfg, *FAST, "--data-path", b / "d", "--run-dir", run, "--train-max-steps", "4"], \
        [str(cfg), "train.lr_dense", "nan"], run, None


def case_checkpoint(kind):
    def make(b, t, request):
        if kind == "sharded":  # a 2-rank checkpoint, resumed in one process: every rank file is read
            run = copy(request.getfixturevalue("sharded"), t / "run")
            f = rank_file(run, 1)
            truncate(f)
            return ["train", *FAST, "--data-path", b / "d", "--run-dir", run, "--train-max-steps", "4"], \
                [str(f)], run, None
        run = copy(b / "run", t / "run")
        if kind == "shape":
            return ["train", *FAST, "--data-path", b / "d", "--run-dir", run, "--train-max-steps", "4",
                    "--model-bottom-mlp", "16"], ["dense_arch", "(8, 13)", "(16, 13)", "step-"], run, None
        f = rank_file(run, 0)
        truncate(f)
        if kind == "evaluate":
            return ["evaluate", run], [str(f)], run, None
        return ["train", *FAST, "--data-path", b / "d", "--run-dir", run, "--train-max-steps", "4"], [str(f)], run, None
    return make


def case_sharded_evaluate(b, t, request):
    run = copy(request.getfixturevalue("sharded"), t / "run")
    f = rank_file(run, 1)
    truncate(f)
    return ["evaluate", run], [str(f)], run, None


def case_two_tables(b, t, request):
    cfg = t / "c.yaml"
    cfg.write_text("model:\n  tables:\n"
                   "    - {name: ta, num_rows: 20, dim: 4, features: [C1, C6]}\n"
                   f"    - {{name: tb, num_rows: 20, dim: 4, features: [{', '.join(f'C{i}' for i in range(2, 27))}]}}\n")
    return ["train", "--config", cfg, *FAST, "--data-path", b / "d", "--run-dir", t / "r"], \
        ["'C6'", "'ta'", "'tb'"], None, None


def case_no_eval_split(cmd):
    def make(b, t, request):
        run = b / "noeval"
        if cmd == "evaluate":
            return ["evaluate", run], ["no eval split", "--split train"], run, None
        return ["infer", run, "--run-dir", t / "inf", "--no-progress"], ["eval split"], run, None
    return make


CASES = {
    "gz-truncated-criteo": case_gz("trunc", "criteo"),
    "gz-truncated-avazu": case_gz("trunc", "avazu"),
    "gz-plain-text-criteo": case_gz("plain", "criteo"),
    "gz-plain-text-avazu": case_gz("plain", "avazu"),
    "gz-truncated-train": case_gz_train,
    "read-only-out-data": case_read_only("data"),
    "read-only-out-profile": case_read_only("profile"),
    "read-only-out-plan": case_read_only("plan"),
    "read-only-run-dir-train": case_read_only("train"),
    "full-disk-data": case_full_disk("data", 4000),
    "full-disk-profile": case_full_disk("profile", 100),
    "full-disk-train": case_full_disk("train", 3000),
    "manifest-rows-exceed-shard": case_manifest("rows"),
    "manifest-feature-not-in-shard": case_manifest("feature"),
    "manifest-rows-exceed-shard-train": case_manifest_train,
    "non-utf8-plan-json": case_non_utf8("plan"),
    "non-utf8-profile-json": case_non_utf8("profile"),
    "truncated-partitions-npz": case_partitions(1),
    "truncated-partitions-npz-2-ranks": case_partitions(2),
    "lr-dense-nan-flag": case_config(["--train-lr-dense", "nan"], ["train.lr_dense", "nan"]),
    "lr-dense-nan-yaml": case_config_file,
    "lr-sparse-inf": case_config(["--train-lr-sparse", "inf"], ["train.lr_sparse", "inf"]),
    "eval-fraction-1": case_config(["--data-eval-fraction", "1"], ["data.eval_fraction", "1.0"]),
    "device-missing": case_config(["--train-device", "cuda:7"], ["train.device", "cuda:7", "cpu"]),
    "device-not-a-device": case_config(["--train-device", "gpu0"], ["train.device", "gpu0"]),
    "dist-design-unknown": case_config(["--dist-design", "pull"], ["dist.design", "'pull'", "retrieve"]),
    "dist-transport-unknown": case_config(["--dist-transport", "mpi"], ["dist.transport", "'mpi'", "pgas"]),
    "dist-grad-sync-unknown": case_config(["--dist-grad-sync", "ring"], ["dist.grad_sync", "'ring'"]),
    "dense-optimizer-unknown": case_config(["--train-dense-optimizer", "lamb"], ["train.dense_optimizer", "'lamb'"]),
    "sparse-optimizer-unknown": case_config(["--train-sparse-optimizer", "adam"],
                                            ["train.sparse_optimizer", "'adam'"]),
    "checkpoint-truncated": case_checkpoint("truncated"),
    "checkpoint-truncated-evaluate": case_checkpoint("evaluate"),
    "checkpoint-other-model-shape": case_checkpoint("shape"),
    "checkpoint-sharded-rank-file-truncated": case_checkpoint("sharded"),
    "checkpoint-sharded-rank-file-truncated-evaluate": case_sharded_evaluate,
    "feature-in-two-tables": case_two_tables,
    "evaluate-without-eval-split": case_no_eval_split("evaluate"),
    "infer-without-eval-split": case_no_eval_split("infer"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_named_error_exit_2_no_traceback(case, base, tmp_path, request):
    argv, names, run, preexec = CASES[case](base, tmp_path, request)
    before = (run / "config.yaml").read_bytes() if run is not None else None
    p = embedscale(*argv, preexec_fn=preexec)
    err = p.stderr
    assert p.returncode == 2, (p.returncode, err[-3000:])
    assert "Traceback" not in err and "Aborted!" not in err, err[-3000:]
    last = [line for line in err.splitlines() if line.startswith("error: ")]
    assert last, err[-3000:]
    for name in names:
        assert name in err, (name, err[-3000:])
    assert not [f for f in tmp_path.rglob("*") if f.name.endswith(".tmp") or f.name.startswith(".staging-")]
    if run is not None:
        assert (run / "config.yaml").read_bytes() == before, "config.yaml of the run was rewritten"
    if "full-disk" in case:  # nothing half-written: no checkpoint without its manifest, no shard without manifest
        out = tmp_path / "out"
        for ck in (out / "checkpoints").glob("step-*") if (out / "checkpoints").is_dir() else []:
            assert (ck / "manifest.json").is_file() or not list(ck.glob("rank-*.pt")), ck


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_files_keep_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "f.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f.txt").stat().st_mode) == 0o666 & ~umask


def test_cli_outputs_keep_the_umask(tmp_path):
    """Shards and manifest written by `embedscale data` under umask 027: 0640, not mkstemp's 0600."""
    (tmp_path / "c.tsv").write_text(criteo_text(20))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "embedscale", "data", "criteo", str(tmp_path / "c.tsv"), "--out",
                        str(tmp_path / "d"), "--no-progress"], capture_output=True, text=True, env=env, timeout=120,
                       preexec_fn=lambda: os.umask(0o027))
    assert p.returncode == 0, p.stderr
    for f in (tmp_path / "d").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f
