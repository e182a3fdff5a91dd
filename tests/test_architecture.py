"""Layering: the planner is numpy-only (it sits below the embedding modules, never imports torch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules_after(stmt: str) -> set[str]:
    code = f"import sys\n{stmt}\nprint('\\n'.join(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)  # a torch import under heavy load took > 120 s once
    assert p.returncode == 0, p.stderr
    return set(p.stdout.split())


def test_plan_package_does_not_import_torch_or_embedding():
    mods = _modules_after("import embedscale.plan, embedscale.plan.forms, embedscale.plan.api, embedscale.plan.oper, "
                         "embedscale.plan.towers, embedscale.plan.tower_placement")
    assert "embedscale.plan.forms" in mods  # the check itself sees what it imports
    assert "torch" not in mods
    assert not {m for m in mods if m.startswith("embedscale.embedding")}


def test_the_check_can_fail():
    assert "torch" in _modules_after("import embedscale.embedding.compression")
