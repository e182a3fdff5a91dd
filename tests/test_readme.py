"""The README is the manual: every command it shows runs, as written, on tiny data.

The shell commands of the README's ```bash blocks run in order in one scratch directory (the later ones use
what the earlier ones wrote: data -> profile -> plan -> train -> evaluate -> infer), with the `embedscale` of
this environment first on PATH. The user's own log file the README names (`train.txt`, Criteo TSV) is the
first rows of the real Criteo sample; the test skips when that file is absent. "Your own data" reads those
rows in other formats (`day1.csv` with a header, `day2.csv` without, `day1.parquet`, `day1.jsonl`,
`day1.libfm`, `day1.ffm`), which the fixture writes, and the schemas its ```yaml blocks name (``# file: NAME``). `make ...` lines are what
runs this suite and `source` only sets PATH: both are left out. The ```python blocks run too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REAL = ROOT.parent / "shared/data/criteo_kaggle_head10k.tsv"
SKIP = ("make ", "source ")


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def shell_commands(text: str) -> list[str]:
    """The commands of every ```bash block: continuation lines joined, comments and `make`/`source` left out."""
    out = []
    for block in blocks(text, "bash"):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            cmd = line.strip()
            if not cmd or cmd.startswith("#") or cmd.startswith(SKIP):
                continue
            out.append(cmd)
    return out


def test_shell_commands_are_found():
    cmds = shell_commands(README.read_text())
    assert any(c.startswith("embedscale data criteo") for c in cmds)
    assert any("--nproc" in c for c in cmds)
    assert shell_commands("```bash\nmake run\nembedscale a \\\n  --b 1  # c\n# d\n```\n") == ["embedscale a  --b 1  # c"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    if not REAL.exists():
        pytest.skip(f"real Criteo sample not found at {REAL} (see shared/data/README.md)")
    d = tmp_path_factory.mktemp("readme")
    with REAL.open() as src, (d / "train.txt").open("w") as dst:  # the user's log: 6,000 real rows
        for i, line in enumerate(src):
            if i == 6000:
                break
            dst.write(line)
    write_own_data(d)
    for name, text in schema_files(README.read_text()).items():
        (d / name).write_text(text)
    return d


def schema_files(text: str) -> dict[str, str]:
    """The README's ```yaml blocks that start with ``# file: NAME``: the files its commands read."""
    out = {}
    for block in blocks(text, "yaml"):
        first = block.splitlines()[0] if block.strip() else ""
        m = re.fullmatch(r"#\s*file:\s*(\S+)\s*", first)
        if m:
            out[m.group(1)] = block
    return out


def write_own_data(d: Path) -> None:
    """The real rows 6,000-9,999 as the README's "Your own data" files: the first 3,000 as day1.* and the
    rest as day2.csv (no header)."""
    import json

    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    names = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
    with REAL.open() as src:
        rows = [line.rstrip("\n").split("\t") for i, line in enumerate(src) if i >= 6000]
    day1, day2 = rows[:3000], rows[3000:]
    (d / "day1.csv").write_text(",".join(names) + "\n" + "".join(",".join(r) + "\n" for r in day1))
    (d / "day2.csv").write_text("".join(",".join(r) + "\n" for r in day2))
    table = pacsv.read_csv(d / "day1.csv", convert_options=pacsv.ConvertOptions(
        column_types={**{c: pa.string() for c in names[14:]}}, strings_can_be_null=True))
    pq.write_table(table, d / "day1.parquet")
    with (d / "day1.jsonl").open("w") as f:
        for r in table.to_pylist():
            f.write(json.dumps(r) + "\n")
    with (d / "day1.ffm").open("w") as f:  # fields 0-2: I1-I3 (dense), 3-5: C1-C3 (index = the hex value)
        for r in day1:
            toks = [r[0]] + [f"{k}:0:{r[1 + k]}" for k in range(3) if r[1 + k]]
            toks += [f"{3 + k}:{int(r[14 + k], 16)}:1" for k in range(3) if r[14 + k]]
            f.write(" ".join(toks) + "\n")
    with (d / "day1.libfm").open("w") as f:  # C1-C26 as ids of one table: index = k * 2^32 + the hex value
        for r in day1:
            f.write(" ".join([r[0]] + [f"{(k << 32) + int(r[14 + k], 16)}:1" for k in range(26) if r[14 + k]]) + "\n")


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def test_every_readme_command_runs(workdir):
    env = _env()
    assert shutil.which("embedscale", path=env["PATH"]), "embedscale is not installed in this environment"
    for cmd in shell_commands(README.read_text()):
        r = subprocess.run(["bash", "-c", cmd], cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"README command failed (exit {r.returncode}): {cmd}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr, f"{cmd}\n{r.stderr[-3000:]}"


def test_readme_python_runs(tmp_path):
    for i, code in enumerate(blocks(README.read_text(), "python")):
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"README python block {i} failed:\n{code}\n{r.stderr[-3000:]}"
