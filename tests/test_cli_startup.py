"""`embedscale --help` and `embedscale data --help` start without torch: the commands' modules
(torch, pyarrow, scipy) load only when a command runs (``cli._Lazy``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from embedscale import cli
from embedscale.train import ranks

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pyarrow", "numpy", "scipy")

PROBE = """
import json, sys
from embedscale.cli import main
try:
    main(sys.argv[1:], prog_name="embedscale")
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


@pytest.mark.parametrize("argv", [["--help"], ["data", "--help"], ["data", "criteo", "--help"], ["train", "--help"]])
def test_help_imports_no_torch(argv):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["code"] == 0 and out["loaded"] == [], out
    assert "Usage: embedscale" in r.stdout


def test_lazy_names_resolve_to_the_modules_attributes():
    """Every lazy name in cli's table exists (a renamed function fails here, not in the middle of a run)."""
    lazy = {name: v for name, v in vars(cli).items() if isinstance(v, cli._Lazy)}
    assert {"workflow", "train_distributed", "launch_ranks", "towers_command"} <= set(lazy)
    for name, v in lazy.items():
        assert v._resolve() is not None, name
    assert cli.train_distributed._resolve() is ranks.train_distributed
    assert cli.workflow.new_run_dir is sys.modules["embedscale.workflow"].new_run_dir


def test_a_command_still_runs_through_the_lazy_names(tmp_path):
    r = CliRunner().invoke(cli.main, ["topology", "--hosts", "1", "--ranks-per-host", "2", "--out",
                                      str(tmp_path / "t.json")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "t.json").read_text())


LAUNCH_PROBE = """
import json, sys
import embedscale.train.launcher as launcher
seen = {}
def fake_launch(nproc, args, **kw):  # what the launcher has loaded when it would start torchrun
    seen["loaded"] = [m for m in %r if m in sys.modules]
    seen["nproc"] = nproc
    return 3
launcher.launch_ranks = fake_launch
from embedscale.cli import main
try:
    main(sys.argv[1:], prog_name="embedscale")
except SystemExit as e:
    seen["code"] = e.code
print(json.dumps(seen))
""" % (HEAVY,)


def test_the_launcher_of_ranks_loads_no_torch(tmp_path):
    """`train --nproc 2` only starts torchrun and watches it: the launcher process has not imported torch (nor scipy)
    when it starts the ranks, which pay for it themselves."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", LAUNCH_PROBE, "train", "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                        "--data-source", "synthetic", "--train-max-steps", "2"], env=env, capture_output=True,
                       text=True, timeout=120)
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["nproc"] == 2 and seen["code"] == 2, (seen, r.stderr[-2000:])  # torchrun's "exit 3" is an error
    assert "torch" not in seen["loaded"] and "scipy" not in seen["loaded"], seen
