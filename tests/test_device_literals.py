"""One module names a device (``embedscale/device.py``); every other module takes the device it is given.

Parses every module of ``embedscale`` (ast, nothing imported) and lists its device literals: a string constant
``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (f-strings included), and a call of ``.cpu()`` or ``.cuda()``. Prose in a
docstring is not a literal. Only ``device.py`` may hold them, and the files of ``ALLOWED``, each with its reason;
an entry whose file holds none any more fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from embedscale.device import HOST, on_host, process_group_backend, run_device

PKG = Path(__file__).resolve().parents[1] / "src" / "embedscale"
DECIDER = "device.py"
NAMES = {"cpu", "cuda"}

ALLOWED = {
    # for good: layers that must not import torch
    "specs.py": "the config names the user's device (train.device's default and its validation); specs stays "
                "torch-free for the planner, so it cannot hold HOST",
    "plan/torchrec_plan.py": "TorchRec's planner is told its compute device by name; plan/ is torch-free "
                             "(tests/test_architecture.py)",
}


def device_literals(source: str) -> list[int]:
    """Line numbers of the device literals in ``source`` (module docstring)."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    lines = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            v = n.value
            if v in NAMES or v.startswith("cuda:"):
                lines.add(n.lineno)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in NAMES:
            lines.add(n.lineno)
    return sorted(lines)


def sites() -> dict[str, list[int]]:
    found = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).as_posix()
        hits = device_literals(p.read_text())
        if hits:
            found[rel] = hits
    return found


def test_scanner_finds_a_hand_listed_set_of_literals():
    src = '''"""A module that says "cpu" in prose and .cpu() in its docstring."""
import torch
A = torch.device("cpu")                  # 3
B = x.cpu()                              # 4
C = x.to(HOST)
D = f"cuda:{i}"                          # 6
def f(t):
    """Moves to "cuda" (prose)."""
    return t.cuda() if t.device.type == 'cuda' else t   # 9
E = torch.cuda.is_available()
F = "cpu_threads"
G = x.device.type in ("meta", "cpu")     # 12
'''
    assert device_literals(src) == [3, 4, 6, 9, 12]


def test_no_device_literal_outside_the_device_module():
    found = sites()
    assert DECIDER in found  # the scan reads the decider itself
    stray = {f: ln for f, ln in found.items() if f != DECIDER and f not in ALLOWED}
    assert not stray, (f"device literals outside {DECIDER} (take the device given: a tensor's .device, the "
                       f"module's device, or embedscale.device.HOST where host memory is the point): {stray}")


def test_every_allowed_file_still_needs_its_entry():
    found = sites()
    stale = sorted(f for f in ALLOWED if f not in found)
    assert not stale, f"no device literal left in {stale}: remove them from ALLOWED"
    assert all(r.strip() for r in ALLOWED.values())


def test_run_device_binds_the_local_rank_of_an_accelerator_named_without_index():
    assert run_device("cpu") == torch.device("cpu")
    assert run_device("cpu", local_rank=3) == torch.device("cpu")  # host memory carries no index
    assert run_device("cuda", local_rank=3) == torch.device("cuda", 3)
    assert run_device("cuda:1", local_rank=3) == torch.device("cuda", 1)  # an index given is kept
    assert run_device("cuda") == torch.device("cuda")  # single process: the current device
    assert HOST == torch.device("cpu")


def test_host_and_backend_of_a_device():
    assert on_host(torch.zeros(2)) and on_host(torch.device("cpu")) and on_host("cpu")
    assert not on_host(torch.device("meta")) and not on_host(torch.zeros(2, device="meta"))
    assert process_group_backend(torch.device("cuda", 2)) == "nccl"
    assert process_group_backend(torch.device("cpu")) == "gloo"
