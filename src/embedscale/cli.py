"""The ``embedscale`` command.

Every command that runs a config takes ``--config FILE.yaml`` and one flag per config field
(``--train-lr-dense 0.1``, ``--data-synthetic-preset criteo-kaggle``), plus ``--set key=value`` for
anything else; flags override the file, the file overrides the defaults.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import json
import logging
import os
import signal
import sys
import typing
from pathlib import Path

import click

from embedscale.errors import EmbedscaleError
from embedscale.io import atomic_write_json, new_run_dir, read_json
from embedscale.specs import RunConfig, SyntheticConfig, TableConfig, Topology, from_dict, leaf_fields, load_config
from embedscale.specs import set_dotted
from embedscale.threads import apply_threads, rank_env, set_wait_policy
from embedscale.train.lock import RunLock, stop_on_signals, stop_requested


class _Lazy:
    """A module (``"pkg.mod"``) or one of its attributes (``"pkg.mod:name"``) imported when first used (called
    or an attribute read), so that ``embedscale --help`` and ``embedscale data --help`` start without torch and
    pyarrow: the commands' modules load only when a command runs. Only what a command body calls or reads an
    attribute of goes through here (no ``isinstance``, no ``except``)."""

    __slots__ = ("_target", "_value")

    def __init__(self, target: str):
        self._target = target
        self._value = None

    def _resolve(self):
        if self._value is None:
            module, _, attr = self._target.partition(":")
            value = importlib.import_module(module)
            self._value = getattr(value, attr) if attr else value
        return self._value

    def __call__(self, *args, **kwargs):
        return self._resolve()(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._resolve(), name)

    def __repr__(self) -> str:
        return f"<lazy {self._target}>"


# The modules behind the commands (torch, pyarrow, scipy), by name; see _Lazy.
plan_command = _Lazy("embedscale.plan.api:plan_command")
topology_command = _Lazy("embedscale.plan.api:topology_command")
drift_command = _Lazy("embedscale.plan.drift:drift_command")
decide_forms = _Lazy("embedscale.plan.forms:decide_forms")
tables_from_profile = _Lazy("embedscale.plan.forms:tables_from_profile")
table_profile = _Lazy("embedscale.plan.forms:table_profile")
Plan = _Lazy("embedscale.plan.plan:Plan")
explain_text = _Lazy("embedscale.plan.auto:explain_text")
load_costs = _Lazy("embedscale.plan.auto:load_costs")
parse_bytes = _Lazy("embedscale.units:parse_bytes")
executor_overheads_text = _Lazy("embedscale.plan.auto:executor_overheads_text")
auto_plan_command = _Lazy("embedscale.plan.autoplan:auto_plan_command")
calibrate_costs = _Lazy("embedscale.calibrate:calibrate")
calibrate_ranks = _Lazy("embedscale.calibrate_ranks:calibrate_ranks")
check_fits = _Lazy("embedscale.data.compat:check_fits")
workflow = _Lazy("embedscale.workflow")
format_summary = _Lazy("embedscale.train.summary:format_summary")
ShardLoader = _Lazy("embedscale.data.loader:ShardLoader")
AccessProfile = _Lazy("embedscale.data.profile:AccessProfile")
SyntheticGenerator = _Lazy("embedscale.data.synthetic:SyntheticGenerator")
generate_dataset = _Lazy("embedscale.data.synthetic:generate_dataset")
is_dmt_arch = _Lazy("embedscale.models.dmt:is_dmt_arch")
reorder_shards = _Lazy("embedscale.reorder:reorder_shards")
attach_to_plan = _Lazy("embedscale.reorder:attach_to_plan")
checkpoint_reordering = _Lazy("embedscale.train.trainer:checkpoint_reordering")
format_towers_summary = _Lazy("embedscale.towers.command:format_towers_summary")
towers_command = _Lazy("embedscale.towers.command:towers_command")
read_manifest = _Lazy("embedscale.train.checkpoint:read_manifest")
resolve_checkpoint = _Lazy("embedscale.train.checkpoint:resolve_checkpoint")
best_checkpoint = _Lazy("embedscale.train.checkpoint:best_checkpoint")
best_pointer = _Lazy("embedscale.train.checkpoint:best_pointer")
is_checkpoint = _Lazy("embedscale.train.checkpoint:is_checkpoint")
check_location = _Lazy("embedscale.storage:check_location")
checkpoint_towers = _Lazy("embedscale.train.dmt_run:checkpoint_towers")
infer_dmt = _Lazy("embedscale.train.dmt_run:infer_dmt")
launch_ranks = _Lazy("embedscale.train.launcher:launch_ranks")
Nodes = _Lazy("embedscale.train.launcher:Nodes")
check_auto_settings = _Lazy("embedscale.plan.auto_settings:check_auto_settings")
infer_distributed = _Lazy("embedscale.train.ranks:infer_distributed")
train_distributed = _Lazy("embedscale.train.ranks:train_distributed")
eval_model = _Lazy("embedscale.train.trainer:evaluate")
load_model_state = _Lazy("embedscale.train.trainer:load_model_state")


MAIN_JOB_RANKS = 2  # `embedscale run` without a config: the OPER plan on this many local ranks


def _flag(dotted: str) -> str:
    return "--" + dotted.replace(".", "-").replace("_", "-")


def _param(dotted: str) -> str:
    return "cfg__" + dotted.replace(".", "__")


def config_options(fn):
    """Add ``--config``, ``--set`` and one option per config leaf to a click command."""
    for dotted, tp, default in reversed(leaf_fields(RunConfig)):
        is_list = typing.get_origin(tp) is list
        help_default = ",".join(map(str, default)) if is_list else default
        fn = click.option(_flag(dotted), _param(dotted), default=None,
                          help=f"{dotted} (default {help_default!r}){'; comma-separated' if is_list else ''}",
                          show_default=False)(fn)
    fn = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                      help="Override any config key, e.g. --set train.epochs=2")(fn)
    fn = click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
                      help="YAML run config.")(fn)
    return fn


def resolve_config(config_path, overrides, kwargs) -> RunConfig:
    fields = {d: tp for d, tp, _ in leaf_fields(RunConfig)}
    values = {}
    for item in overrides:
        if "=" not in item:
            raise click.BadParameter(f"--set {item!r}: expected KEY=VALUE")
        k, v = item.split("=", 1)
        values[k.strip()] = v
    for dotted, tp in fields.items():
        v = kwargs.pop(_param(dotted), None)
        if v is None:
            continue
        if typing.get_origin(tp) is list:
            v = [x for x in v.split(",") if x.strip() != ""]
        values[dotted] = v
    return load_config(config_path, values)


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    if getattr(e, "exit_now", False):  # a rank whose peers stopped answering: no orderly exit waits on them
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(getattr(e, "exit_code", 2))
    sys.exit(getattr(e, "exit_code", 2))  # 2; a run stopped by a signal: 128 + the signal (lock.Stopped)


def _stopped(signum: int, run_dir) -> None:
    """A stop signal ended this process's part of a run: one line, no traceback, exit 128 + the signal."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    who = f"rank {os.environ['RANK']}: " if "RANK" in os.environ and world > 1 else ""
    where = f"; {run_dir} keeps its last complete checkpoint" if run_dir and not who else ""
    if who and "embedscale.train.watchdog" in sys.modules:  # stopped because a peer stopped answering?
        where = sys.modules["embedscale.train.watchdog"].lost_note()
    click.echo(f"error: {who}stopped by {signal.Signals(signum).name}{where}", err=True)
    # The clean-ups ran while unwinding. Skip the interpreter's teardown: it is slow on a rank (gloo), and
    # background threads still inside a torch op (data prefetch, input pipeline) may outlive the closing of
    # sys.stderr there and abort the process instead of exiting 128 + signum.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)


@contextlib.contextmanager
def _command(state: dict):
    """The body of a command that runs: a user error is one line and exit 2; SIGINT/SIGTERM end it with one
    line "error: stopped by SIGTERM; ..." and exit 130/143, no traceback, clean-ups run on the way out
    (nothing half-written). ``state["run_dir"]``, once set, is named in the message."""
    try:
        with stop_on_signals():
            apply_threads()
            yield
    except KeyboardInterrupt as e:
        _stopped(getattr(e, "signum", signal.SIGINT), state.get("run_dir"))
    except EmbedscaleError as e:
        _fail(e)
    except Exception:
        if stop_requested() is not None:  # e.g. a collective broken by a peer that was stopped first
            _stopped(stop_requested(), state.get("run_dir"))
        raise


def _os_message(e: OSError) -> str:
    """``<path>: <strerror>`` (both paths of a rename), or the error's own text when it names no file."""
    if e.filename is None:
        return str(e)
    where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else f"{e.filename}"
    return f"{where}: {e.strerror or e}"


class _Commands(click.Group):
    """The command group: every command's ``EmbedscaleError`` and ``OSError`` (a read-only ``--out``, a full
    disk) ends as ``error: <message>`` on stderr and exit code 2, never a traceback. Writers are atomic
    (``io.atomic_open``), so nothing half-written is left behind."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EmbedscaleError as e:
            _fail(e)
        except OSError as e:
            if e.errno == errno.EPIPE:  # stdout closed by the reader (| head): click's own handling
                raise
            _fail(_os_message(e))


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="embedscale")
def main() -> None:
    """embedscale: train and serve recommendation models with large, skewed embedding tables."""
    set_wait_policy()  # before torch is imported (the commands import it lazily): see embedscale.threads


@main.command()
@config_options
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def run(config_path, overrides, no_progress, as_json, **kwargs):
    """The main job: synthetic data (default), profile, plan, train on 2 local ranks, evaluate, summary.

    Without --config it runs the embedded default: 1.5M synthetic criteo-kaggle-shaped samples (tables capped
    at 100k rows), the `oper` plan on 2 local ranks (gloo), one epoch of DLRM (OPER Table 1 sizes).
    """
    with _command({}):
        if config_path is None and kwargs.get("cfg__dist__nproc") is None and not any(
                o.startswith("dist.nproc=") for o in overrides):
            kwargs["cfg__dist__nproc"] = str(MAIN_JOB_RANKS)  # the embedded default runs on local ranks
        cfg = resolve_config(config_path, overrides, kwargs)
        s = workflow.run_main(cfg, progress=not no_progress)
    click.echo(json.dumps(s, default=str) if as_json else format_summary(s))


def node_options(fn):
    """``--nnodes/--node-rank/--rdzv-endpoint/--rdzv-id``: this machine's part of a run over several
    (``train.launcher.Nodes``; torchrun's c10d rendezvous)."""
    opts = [click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
                         help="Machines (nodes) of the run; each runs this command with its --node-rank."),
            click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True,
                         help="This node's number; node 0 hosts the rendezvous at --rdzv-endpoint."),
            click.option("--rdzv-endpoint", default="", metavar="HOST:PORT",
                         help="Node 0's address and a free port, the same on every node (c10d rendezvous)."),
            click.option("--rdzv-id", default="", help="The run's rendezvous id, the same on every node "
                         "(default: the run's name)."),
            click.option("--rdzv-timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
                         help="Seconds a node waits for the others to join.")]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, default_id: str):
    nodes = Nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id or default_id)
    nodes.check()
    return nodes


NODE_FLAGS = ("--nnodes", "--node-rank", "--rdzv-endpoint", "--rdzv-id", "--rdzv-timeout")


@main.command()
@config_options
@node_options
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory (resumes from its latest checkpoint if it has one). Default: a new one.")
@click.option("--nproc", type=click.IntRange(min=1), default=None, help="Local ranks to launch (dist.nproc).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --nproc: restart the ranks this many times after a failure (resumes from the last checkpoint).")
@click.option("--checkpoint-dir", default=None, metavar="PATH|URI",
              help="Where checkpoints/ goes (train.checkpoint_dir): a local path or any fsspec URI (s3://bucket/run).")
@click.option("--no-progress", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def train(config_path, overrides, run_dir, nproc, max_restarts, checkpoint_dir, no_progress, as_json, nnodes, node_rank,
          rdzv_endpoint, rdzv_id, rdzv_timeout, **kwargs):
    """Train (and evaluate) a model as the config says; resumes a run directory exactly.

    With --nproc N (N > 1) it launches N local ranks under torchrun; under torchrun itself
    (`torchrun --nproc-per-node N -m embedscale train ...`) every rank runs its part. On several machines
    each runs `train --nnodes M --node-rank I --rdzv-endpoint HEAD:PORT --nproc N` with its own run directory.
    """
    state: dict = {"run_dir": run_dir}
    with _command(state):
        if nproc is not None:
            kwargs["cfg__dist__nproc"] = str(nproc)
        if checkpoint_dir is not None:
            kwargs["cfg__train__checkpoint_dir"] = checkpoint_dir
        cfg = resolve_config(config_path, overrides, kwargs)
        if cfg.train.checkpoint_dir:  # a bad URI or a missing bucket: named now, not once the data is prepared
            check_location(cfg.train.checkpoint_dir)
        nodes = _nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, cfg.name)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if "RANK" in os.environ and world > 1:
            s = train_distributed(cfg, run_dir, progress=not no_progress)
            if s is None or os.environ.get("EMBEDSCALE_LAUNCHED"):
                return
        elif cfg.dist.nproc > 1 or nodes.multi:
            s = _launch_local(cfg, config_path, overrides, kwargs_argv(sys.argv), run_dir, max_restarts, nodes,
                              rdzv_timeout)
            if s is None:  # a node without rank 0: its part ended well, rank 0's node has the summary
                click.echo(f"node {nodes.node_rank}: its ranks finished; the summary is on the node of rank 0")
                return
        else:
            workflow.check_one_process(cfg)  # before the run directory is made
            rd = state["run_dir"] = Path(run_dir) if run_dir else new_run_dir(cfg)
            with RunLock(rd):  # one run per directory, for as long as it runs
                s = workflow.train(cfg, rd, resume=True, progress=not no_progress)
    click.echo(json.dumps(s, default=str) if as_json else format_summary(s))


def kwargs_argv(argv: list[str]) -> list[str]:
    """The user's `train` arguments, minus the launcher's own (--nproc, --max-restarts, --run-dir, --json)."""
    out, skip = [], False
    args = argv[argv.index("train") + 1:] if "train" in argv else []
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--nproc", "--max-restarts", "--run-dir", *NODE_FLAGS):
            skip = True
            continue
        if a.startswith(tuple(f"{f}=" for f in ("--nproc", "--max-restarts", "--run-dir", *NODE_FLAGS))) \
                or a == "--json":
            continue
        out.append(a)
    return out


def _launch_local(cfg, config_path, overrides, user_args, run_dir, max_restarts, nodes=None,
                  rdzv_timeout: float = 600.0) -> dict | None:
    """``train --nproc N``: hold the run directory and run the ranks under the launcher (``launch_ranks``); with
    ``nodes``, this node's part of a multi-node run (None on a node where rank 0 did not run: no summary)."""
    check_auto_settings(cfg)  # dist.plan auto's budgets: a named error here, not N rank errors under torchrun
    if Path(cfg.dist.plan).exists():  # a saved plan: a damaged one fails here, not on every rank under torchrun
        Plan.load(cfg.dist.plan, mmap=True)
    rd = Path(run_dir) if run_dir else new_run_dir(cfg)
    args = ["train", *user_args, "--run-dir", str(rd), "--set", f"dist.nproc={cfg.dist.nproc}"]
    with RunLock(rd):  # before anything is written there: a second run into rd fails here
        code = launch_ranks(cfg.dist.nproc, args, max_restarts=max_restarts, run_dir=rd, env=rank_env(cfg.dist.nproc),
                            nodes=nodes, join_timeout_s=rdzv_timeout)
    if code != 0:
        raise EmbedscaleError(f"distributed training failed (torchrun exit code {code}); see the rank errors above")
    if nodes is not None and nodes.multi and not (rd / "summary.json").exists():
        return None
    return read_json(rd / "summary.json", "run summary")


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--data", "data_dir", type=click.Path(file_okay=False), default=None,
              help="Shard directory to evaluate on (default: the eval split of the checkpoint's config).")
@click.option("--split", "split_name", type=click.Choice(["eval", "train", "test"]), default="eval", show_default=True,
              help="Which split of the checkpoint's data to score (train only when asked: it is what the model saw; "
                   "test: the test files or the dataset's test/).")
@click.option("--batch-size", type=int, default=8192)
@click.option("--json", "as_json", is_flag=True)
def evaluate(checkpoint, data_dir, split_name, batch_size, as_json):
    """Evaluate a checkpoint (a run's checkpoints/step-N, its checkpoints/best, or a run directory: its best
    evaluation's checkpoint, else its latest; the output names it) of any world size in one process: exact
    logloss, AUC, normalised entropy (logloss over the entropy of the observed CTR) and calibration (predicted
    over observed CTR) on the run's eval split (``--split train``: its training split; ``--data``: another shard
    directory). A run without an eval split (data.eval_fraction 0) is an error unless
    ``--split train`` or ``--data`` says what to score."""
    import yaml

    import torch

    try:
        apply_threads()
        ck, chosen = _checkpoint_to_score(Path(checkpoint))
        manifest = read_manifest(ck)
        cfg = from_dict(RunConfig, yaml.safe_load(manifest.get("config_yaml") or "") or {})
        if data_dir:
            data = workflow.split_existing(Path(data_dir), 0.0)
            split = data.train
        else:
            data = workflow.prepare_data(cfg)
            split = {"eval": data.eval, "train": data.train, "test": data.test}[split_name]
            if split is None and split_name == "test":
                raise EmbedscaleError(f"{ck}: the run's data has no test split (data.test_path, or a dataset "
                                      "written with --test FILES); pass --data DIR to score another dataset")
            if split is None:
                raise EmbedscaleError(f"{ck}: the run has no eval split (data.eval_fraction "
                                      f"{cfg.data.eval_fraction}, data.eval_samples {cfg.data.eval_samples}); "
                                      "pass --split train to score its training data, or --data DIR")
        device = torch.device(cfg.train.device)
        assignment = None
        if manifest.get("kind") == "dmt":  # all towers in this process, the checkpoint's
            assignment = checkpoint_towers(ck)
        tables = workflow.tables_for(cfg, data.manifest)
        apart = set(manifest.get("tt_tables", [])) | set(manifest.get("host_tables", []))  # not stored by row
        check_fits(ck, manifest, {t.name: t.num_rows for t in tables if t.name not in apart}, split.directory)
        model, _ = workflow.build(cfg, tables, data.manifest.num_dense, device, assignment=assignment,
                                  validate=False,  # the ShardLoader checks the ids
                                  reordering=checkpoint_reordering(ck, tables))  # the TT tables' (EL-Rec IV)
        load_model_state(model, ck)
        loader = ShardLoader(split.directory, batch_size, start=split.start, stop=split.stop, device=device,
                             raw_ids=workflow.raw_id_features(cfg, tables))  # managed tables' raw ids
        m = eval_model(model, loader, progress=True)
    except EmbedscaleError as e:
        _fail(e)
    m["checkpoint"] = str(ck)
    m["chosen"] = chosen
    m["step"] = manifest["step"]
    if as_json:
        click.echo(json.dumps(m))
    else:
        which = {"best": "the best evaluation's checkpoint", "latest": "the latest checkpoint (no best kept)"}
        click.echo(f"{ck}" + (f" ({which[chosen]})" if chosen in which else ""))
        click.echo(f"step {m['step']}: logloss {m['logloss']:.5f}  AUC {m['auc']:.5f}  NE {m['ne']:.5f}  "
                   f"calibration {m['calibration']:.5f}  on {m['samples']:,} samples")


def _checkpoint_to_score(path: Path) -> tuple[Path, str]:
    """``evaluate``'s checkpoint and how it was chosen: a checkpoint as given (``"given"``); of a run directory its
    best evaluation's (``checkpoints/best``: ``"best"``), else its latest (``"latest"``)."""
    if not path.is_dir() or is_checkpoint(path):
        return resolve_checkpoint(path), "given"
    best = best_checkpoint(path)
    if best is None and is_checkpoint(best_pointer(path)):  # a copy where the file system has no symbolic links
        best = best_pointer(path)
    return (best, "best") if best is not None else (resolve_checkpoint(path), "latest")


def _infer_fn(cfg):
    """The serving entry of the checkpoint's arch: DMT models through the tower transform (``infer_dmt``,
    DMT 3.1), the others under an inference plan (``infer_distributed``)."""
    if is_dmt_arch(cfg.model.arch):
        return infer_dmt
    return infer_distributed


@main.command()
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True, help="Local ranks.")
@click.option("--plan", "plan", default="oper", show_default=True,
              help="Inference plan: a strategy (oper replicates hot rows by OPER Algorithm 1) or a saved plan.")
@click.option("--design", type=click.Choice(["retrieve", "send"]), default="retrieve", show_default=True)
@click.option("--run-dir", type=click.Path(file_okay=False), default=None)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a key of the run's config.")
@node_options
@click.option("--no-progress", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def infer(checkpoint, nproc, plan, design, run_dir, overrides, nnodes, node_rank, rdzv_endpoint, rdzv_id,
          rdzv_timeout, no_progress, as_json):
    """Sharded inference: score the eval split with a checkpoint (a run's checkpoints/step-N of any world size, or a
    run directory: its best evaluation's checkpoint, else its latest) under an inference plan; writes predictions.npy and inference.json. DMT models (dmt-dlrm, dmt-dcn) run
    through the tower transform with the checkpoint's towers (--plan and --design do not apply; on several
    ranks dist.topology_hosts must divide --nproc)."""
    import yaml

    state: dict = {}
    with _command(state):
        ck, _ = _checkpoint_to_score(Path(checkpoint))
        data = yaml.safe_load(read_manifest(ck).get("config_yaml") or "") or {}
        for item in overrides:
            k, _, v = item.partition("=")
            set_dotted(data, k.strip(), yaml.safe_load(v))
        set_dotted(data, "dist.plan", plan)
        set_dotted(data, "dist.design", design)
        set_dotted(data, "dist.nproc", nproc)
        set_dotted(data, "dist.mode", "inference")
        cfg = from_dict(RunConfig, data)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if "RANK" not in os.environ and any(o.strip().startswith("data.") for o in overrides):  # other data
            other = workflow.prepare_data(cfg, progress=not no_progress)
            check_fits(ck, read_manifest(ck), {t.name: t.num_rows for t in workflow.tables_for(cfg, other.manifest)},
                       other.train.directory)
        infer_fn = _infer_fn(cfg)
        nodes = _nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, f"{cfg.name}-infer")
        if "RANK" in os.environ and world > 1:
            out = infer_fn(cfg, str(ck.resolve()), run_dir, progress=not no_progress)
            if out is None or os.environ.get("EMBEDSCALE_LAUNCHED"):
                return
        else:
            workflow.check_one_process(cfg)  # before the run directory is made
            rd = state["run_dir"] = Path(run_dir) if run_dir else new_run_dir(cfg)
            with RunLock(rd):  # one run per directory, for as long as it runs
                if nproc > 1 or nodes.multi:
                    args = ["infer", str(ck.resolve()), "--plan", plan, "--design", design,
                            "--run-dir", str(rd), *[a for o in overrides for a in ("--set", o)],
                            *(["--no-progress"] if no_progress else [])]
                    code = launch_ranks(nproc, args, run_dir=rd, env=rank_env(nproc), nodes=nodes,
                                        join_timeout_s=rdzv_timeout)
                    if code != 0:
                        raise EmbedscaleError(f"distributed inference failed (torchrun exit code {code})")
                    if nodes.multi and not (rd / "inference.json").exists():
                        click.echo(f"node {nodes.node_rank}: its ranks finished; the figures are on the node of "
                                   "rank 0")
                        return
                    out = read_json(rd / "inference.json", "inference result")
                else:
                    out = infer_fn(cfg, str(ck.resolve()), str(rd), progress=not no_progress)
    if as_json:
        click.echo(json.dumps(out))
    else:
        click.echo(f"{out['samples']:,} samples on {out['world_size']} rank(s), plan {out['plan']}: "
                   f"logloss {out['logloss']:.5f}  AUC {out['auc']:.5f}  {out['samples_per_s']:,.0f} samples/s")


doctor_mod = _Lazy("embedscale.doctor")
DOCTOR_REPORT = "doctor-ranks.json"  # rank 0's part of the report, in its node's run directory


def _without(argv: list[str], command: str, drop: tuple[str, ...], flags: tuple[str, ...] = ("--json",)) -> list[str]:
    """``command``'s arguments in ``argv`` without the options ``drop`` (each with its value) and ``flags``."""
    out, skip = [], False
    for a in argv[argv.index(command) + 1:] if command in argv else []:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif not a.startswith(tuple(f"{d}=" for d in drop)) and a not in flags:
            out.append(a)
    return out


@main.command()
@config_options
@node_options
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True, help="Local ranks (as the run's).")
@click.option("--run-dir", type=click.Path(file_okay=False), default="runs/doctor", show_default=True,
              help="The directory to test for sharing with rank 0's node (the run's, or its parent).")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="The measured topology (default RUN_DIR/topology.json on rank 0's node).")
@click.option("--reach-timeout", type=click.FloatRange(min=0.5), default=8.0, show_default=True,
              help="Seconds a node tries to reach the rendezvous endpoint.")
@click.option("--json", "as_json", is_flag=True)
def doctor(config_path, overrides, nnodes, node_rank, rdzv_endpoint, rdzv_id, rdzv_timeout, nproc, run_dir,
           out_path, reach_timeout, as_json, **kwargs):
    """Check a run over several machines before it starts: the rendezvous endpoint, the network interface, the
    clocks, a shared run directory or not, every rank's batches per epoch (with the run's config) and the links
    between every pair of ranks, written as the planner's topology (embedscale plan --topology). Run it on every
    node with the run's --nnodes/--node-rank/--rdzv-endpoint/--nproc."""
    state: dict = {}
    with _command(state):
        given = config_path is not None or overrides or any(v is not None for v in kwargs.values())
        rd = Path(run_dir)
        out = Path(out_path) if out_path else rd / "topology.json"
        if "RANK" in os.environ:  # a rank under torchrun
            cfg = resolve_config(config_path, overrides, kwargs) if given else None
            rep = doctor_mod.rank_checks(rd, out, cfg)
            if rep is not None:
                atomic_write_json(rd / DOCTOR_REPORT, rep)
            return
        nodes = _nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, "embedscale-doctor")
        node_rep, lis = ({"endpoint": "(one node)", "role": "standalone", "interface": None, "address": "",
                          "hint": "", "problems": []}, None)
        if nodes.multi:
            node_rep, lis = doctor_mod.node_checks(nodes.endpoint, nodes.node_rank, reach_timeout)
        (rd / DOCTOR_REPORT).unlink(missing_ok=True)
        args = ["doctor", *_without(sys.argv, "doctor", (*NODE_FLAGS, "--nproc", "--run-dir", "--out",
                                                          "--reach-timeout")), "--run-dir", str(rd), "--out", str(out)]
        if lis is not None:
            lis.close()  # the rendezvous takes the port now
        code = launch_ranks(nproc, args, env=rank_env(nproc), nodes=nodes, join_timeout_s=rdzv_timeout)
        if code != 0:
            raise EmbedscaleError(f"doctor: the ranks' checks failed (torchrun exit code {code}); see above")
        ranks = read_json(rd / DOCTOR_REPORT, "doctor report") if (rd / DOCTOR_REPORT).exists() else None
        problems = node_rep["problems"] + (ranks["problems"] if ranks else [])
        click.echo(json.dumps({"node": node_rep, "ranks": ranks}) if as_json else doctor_mod.format_report(
            node_rep, ranks))
        if problems:
            sys.exit(1)


@main.group()
def data():
    """Make datasets: your click logs (CSV/TSV, Parquet, JSON lines, libFM/libSVM; Criteo and Avazu presets) or
    synthetic data into columnar shards. Train, eval and test files stay separate (--train/--eval/--test); eval
    and test are encoded with the training data's vocabulary, a later file with an existing dataset's
    (--vocab-from)."""


def _common_convert_options(fn):
    opts = [
        click.argument("paths", nargs=-1, type=click.Path(exists=True)),
        click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
                     help="The dataset directory (the training split; eval and test in its eval/ and test/)."),
        click.option("--train", "train_files", multiple=True, type=click.Path(exists=True),
                     help="Training file (repeat for several; PATHS are training files too)."),
        click.option("--eval", "eval_files", multiple=True, type=click.Path(exists=True),
                     help="Eval file, encoded with the training vocabulary (repeatable): OUT/eval."),
        click.option("--test", "test_files", multiple=True, type=click.Path(exists=True),
                     help="Test file, encoded with the training vocabulary (repeatable): OUT/test."),
        click.option("--split-column", default=None, help="A column of train/eval/test naming each row's split."),
        click.option("--time-column", default=None, help="A time column: rows from --eval-from on are eval."),
        click.option("--eval-from", default=None, help="With --time-column: the first time of the eval split."),
        click.option("--test-from", default=None, help="With --time-column: the first time of the test split."),
        click.option("--vocab-from", type=click.Path(exists=True, file_okay=False), default=None,
                     help="Encode with this dataset's vocabulary and table sizes (unseen values: row 0)."),
        click.option("--categorical", type=click.Choice(["auto", "hash", "vocab"]), default="auto", show_default=True,
                     help="auto: vocab when every feature's vocabulary fits in --max-table-rows, else hash."),
        click.option("--table-rows", multiple=True, metavar="N|FEATURE=N",
                     help="hash mode: rows per table, for all or one feature (repeatable); default: sized from "
                          "the data (distinct values / --load-factor, at most --max-table-rows)."),
        click.option("--load-factor", type=float, default=0.5, show_default=True,
                     help="hash mode, tables sized from the data: distinct values per row."),
        click.option("--max-table-rows", type=int, default=1_000_000, show_default=True,
                     help="hash mode, tables sized from the data: the cap."),
        click.option("--min-frequency", type=int, default=1, show_default=True,
                     help="vocab mode: values seen fewer times map to the shared out-of-vocabulary row."),
        click.option("--skip-malformed", is_flag=True,
                     help="Skip malformed lines (counted and reported) instead of stopping at the first."),
        click.option("--shard-rows", type=int, default=1_000_000, show_default=True),
        click.option("--no-progress", is_flag=True),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _report_manifest(m, out_dir):
    skipped = m.extra.get("skipped", {})
    click.echo(f"{out_dir}: {m.rows:,} rows ({m.positives:,} positive), {len(m.shards)} shard(s), "
               f"{len(m.sparse)} sparse features" + (f", {skipped.get('count', 0)} malformed lines skipped"
                                                     if skipped.get("count") else ""))
    if m.sparse:
        click.echo("table rows: " + ", ".join(f"{s.name} {s.num_rows:,}" for s in m.sparse[:12])
                   + (f", ... ({sum(s.num_rows for s in m.sparse):,} in all)" if len(m.sparse) > 12 else ""))
    for name, sub in m.extra.get("splits", {}).items():
        sm = type(m).load(Path(out_dir) / sub)
        click.echo(f"{Path(out_dir) / sub}: {sm.rows:,} {name} rows ({sm.positives:,} positive)")


def _table_rows(items) -> int | dict:
    """--table-rows N | FEATURE=N (repeatable) -> one number or {feature: rows} (0 = from the data)."""
    rows: dict = {}
    default = 0
    for item in items:
        name, eq, n = item.rpartition("=")
        try:
            value = int(n)
        except ValueError:
            raise EmbedscaleError(f"--table-rows {item!r}: expected N or FEATURE=N") from None
        if eq:
            rows[name] = value
        else:
            default = value
    return {"__default__": default, **rows} if rows else default


def _run_convert(schema, paths, out_dir, train_files, eval_files, test_files, split_column, time_column, eval_from,
                 test_from, vocab_from, categorical, table_rows, load_factor, max_table_rows, min_frequency,
                 skip_malformed, shard_rows, no_progress):
    import importlib

    tabular = importlib.import_module("embedscale.data.tabular")
    sources = {"train": list(paths) + list(train_files), "eval": list(eval_files), "test": list(test_files)}
    rows = _table_rows(table_rows)
    if isinstance(rows, dict):
        default = rows.pop("__default__")
        rows = {c.name: rows.get(c.name, c.rows or default) for c in schema.sparse} | {
            k: v for k, v in rows.items() if k not in schema.sparse_names}
    m = tabular.convert(schema, sources, out_dir, categorical=categorical, table_rows=rows,
                        min_frequency=min_frequency, load_factor=load_factor, max_table_rows=max_table_rows,
                        shard_rows=shard_rows, skip_malformed=skip_malformed, progress=not no_progress,
                        vocab_from=vocab_from, split_column=split_column, time_column=time_column,
                        eval_from=eval_from, test_from=test_from)
    _report_manifest(m, out_dir)


def _convert_command(fmt: str, doc: str, *options):
    @_common_convert_options
    def command(**kw):
        import importlib

        try:
            extra = {k: kw.pop(k) for k in ("header",) if k in kw}
            _run_convert(importlib.import_module(f"embedscale.data.{fmt}").schema(**extra), **kw)
        except EmbedscaleError as e:
            _fail(e)

    command.__doc__ = doc
    for opt in options:
        command = opt(command)
    return data.command(fmt)(command)


_convert_command("criteo", "Convert raw Criteo Kaggle/Terabyte TSV (label, I1-I13, C1-C26) into shards.")
_convert_command("avazu", "Convert Avazu CSV (24 columns) into shards.",
                 click.option("--header", type=click.Choice(["present", "none", "auto"]), default="present",
                              show_default=True, help="Every file starts with Avazu's header line (present), "
                              "none does (columns in Avazu's order), or either (auto)."))


@data.command("table")
@_common_convert_options
@click.option("--schema", "schema_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A YAML schema (format, label, dense, sparse, weight, ...); or the flags below.")
@click.option("--format", "fmt", type=click.Choice(["csv", "tsv", "parquet", "jsonl", "libfm", "libsvm", "libffm"]),
              default=None, help="The format (default: from the file name); with --schema: instead of its format.")
@click.option("--label", default="label", show_default=True, help="The label column (name or 0-based position).")
@click.option("--label-values", type=click.Choice(["01", "-1/1", "bool"]), default="01", show_default=True)
@click.option("--dense", default="", help="Dense columns, comma-separated (names or positions).")
@click.option("--sparse", default="", help="Categorical columns, comma-separated (names or positions).")
@click.option("--multi-hot", multiple=True, metavar="COLUMN:SEP", help="A multi-hot column and its separator.")
@click.option("--weight", default=None, help="A sample-weight column.")
@click.option("--header", type=click.Choice(["true", "false", "auto"]), default="true", show_default=True)
@click.option("--delimiter", default="", help="csv: ',' and tsv: a tab unless given.")
@click.option("--transform", type=click.Choice(["none", "log1p", "standardise"]), default="none", show_default=True,
              help="The dense columns' transform (log1p: DLRM's log(1 + max(x, 0))).")
def data_table(schema_path, fmt, label, label_values, dense, sparse, multi_hot, weight, header, delimiter, transform,
               **kw):
    """Read your own click logs, described by a schema (--schema FILE.yaml) or by flags, into shards."""
    import importlib

    try:
        Schema = importlib.import_module("embedscale.data.schema").Schema
        if schema_path:
            schema = Schema.load(schema_path)
            if fmt and fmt != schema.format:  # the same columns in another format
                schema = Schema.from_dict({**schema.to_dict(), "format": fmt, "name": fmt}, f"{schema_path} as {fmt}")
        else:
            if fmt is None:
                first = next(iter(kw["paths"] + kw["train_files"]), "")
                fmt = _guess_format(first)
            schema = Schema.from_flags(fmt, label, dense, sparse, multi_hot, weight, header, delimiter, transform,
                                       label_values)
        _run_convert(schema, **kw)
    except EmbedscaleError as e:
        _fail(e)


def _guess_format(path: str) -> str:
    name = str(path).lower().removesuffix(".gz")
    for ext, fmt in ((".tsv", "tsv"), (".csv", "csv"), (".parquet", "parquet"), (".jsonl", "jsonl"),
                     (".json", "jsonl"), (".libfm", "libfm"), (".ffm", "libffm"), (".libsvm", "libsvm"),
                     (".svm", "libsvm")):
        if name.endswith(ext):
            return fmt
    if Path(path).is_dir():
        return "parquet"
    raise EmbedscaleError(f"{path}: cannot tell the format from the name; pass --format or --schema")


@data.command("synthetic")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True)
@click.option("--preset", default="criteo-kaggle", show_default=True,
              help="criteo-kaggle, criteo-terabyte (or a scaled-down variant)")
@click.option("--samples", type=int, default=1_000_000, show_default=True)
@click.option("--first-sample", type=int, default=0, show_default=True,
              help="Start of the sample stream (e.g. the train size, to make an eval set).")
@click.option("--max-rows", type=int, default=0, show_default=True, help="Cap every table's rows (0 = none).")
@click.option("--alpha", type=float, default=1.1, show_default=True, help="Power-law exponent of row access.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shard-rows", type=int, default=1_000_000, show_default=True)
@click.option("--no-progress", is_flag=True)
def data_synthetic(out_dir, preset, samples, first_sample, max_rows, alpha, seed, shard_rows, no_progress):
    """Generate synthetic Criteo-shaped data with power-law access and a planted teacher."""
    try:
        cfg = SyntheticConfig(preset=preset, max_rows=max_rows, alpha=alpha)
        m = generate_dataset(cfg, out_dir, samples, seed=seed, first_sample=first_sample, shard_rows=shard_rows,
                             progress=not no_progress)
    except EmbedscaleError as e:
        _fail(e)
    _report_manifest(m, out_dir)
    t = m.extra.get("teacher_auc")
    if t is not None:
        click.echo(f"teacher AUC (ceiling): {t:.5f}")


def _plan_tables(tables_path, preset, max_rows, dim, profile_path):
    """``(tables, requests)``: tables from a YAML list (its entries, ``TableConfig``, are also the requests:
    ``compression: tt``, ``placement: host``), a synthetic preset, or the saved profile's: for a profile of the
    data (``embedscale profile DIR``, per feature) the tables training builds by default (``t_<feature>``,
    ``plan.forms.default_tables``)."""
    import yaml

    if tables_path:
        data = yaml.safe_load(Path(tables_path).read_text())
        data = data.get("tables", data) if isinstance(data, dict) else data
        if not isinstance(data, list):
            raise EmbedscaleError(f"{tables_path}: expected a list of tables (or a mapping with 'tables')")
        requests = [from_dict(TableConfig, {"dim": dim, **t}, f"{tables_path}: tables[{i}]")
                    for i, t in enumerate(data)]
        return [r.spec for r in requests], requests
    if preset:
        return SyntheticGenerator(SyntheticConfig(preset=preset, max_rows=max_rows), seed=0).table_specs(dim), []
    if profile_path:
        return tables_from_profile(AccessProfile.load(profile_path), dim), []
    raise EmbedscaleError("name the tables: --tables FILE.yaml, --preset NAME or --profile DIR")


def _attach_reordering(plan_dir, tables, profile_path, method, hot_ratio, shards) -> None:
    """``embedscale plan --tt-reorder`` (or row groups of an auto plan): the plan in ``plan_dir`` carries its TT
    tables' reordering (EL-Rec IV)."""
    if not profile_path:  # (--tt-reorder needs --profile; without one auto weighs no row groups)
        return
    prof = table_profile(AccessProfile.load(profile_path), tables)
    attach_to_plan(plan_dir, tables, prof, method=method, hot_ratio=hot_ratio, shards=shards)


def _plan_topology(topology_path, hosts, ranks_per_host):
    return topology_path if topology_path else Topology(num_hosts=hosts, ranks_per_host=ranks_per_host)


@main.command()
@click.option("--tables", "tables_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="YAML list of tables (name, num_rows, dim, ...).")
@click.option("--preset", default=None, help="Tables of a synthetic preset (criteo-kaggle, criteo-terabyte, ...).")
@click.option("--max-rows", type=int, default=0, show_default=True, help="With --preset: cap every table's rows.")
@click.option("--dim", type=int, default=16, show_default=True)
@click.option("--profile", "profile_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="Saved AccessProfile (embedscale profile); default: a synthetic power-law profile (--zipf).")
@click.option("--zipf", type=float, default=1.1, show_default=True, help="Exponent of the synthetic profile.")
@click.option("--topology", "topology_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Topology file (embedscale topology); default: --hosts x --ranks-per-host with default links.")
@click.option("--hosts", type=int, default=1, show_default=True)
@click.option("--ranks-per-host", type=int, default=2, show_default=True)
@click.option("--strategy", "strategies", multiple=True, default=["oper"], show_default=True,
              help="oper, table_wise, row_wise, memory_greedy, access_greedy, torchrec, milp, auto; repeat to compare.")
@click.option("--mode", type=click.Choice(["training", "inference"]), default="training", show_default=True)
@click.option("--extra-memory", type=float, default=0.05, show_default=True, help="Replication budget (OPER: 5%).")
@click.option("--batch-size", type=int, default=2048, show_default=True, help="Samples per rank per iteration.")
@click.option("--traffic", type=click.Choice(["distinct", "access"]), default="distinct", show_default=True,
              help="What the cost model (and oper) charges: distinct, what the executor moves (a remote row once "
                   "per batch, replicas synced by a sparse AllReduce over all ranks); access, OPER's eqs. 3 and 5 "
                   "(every access; a replica's rows all-reduced among its holders).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="plans", show_default=True)
@click.option("--tt-min-rows", type=int, default=0, show_default=True,
              help="Store tables of at least this many rows as TT tables (EL-Rec: 1000000): replicated on every "
                   "rank, not in the plan. 0 = off (tables saying compression: tt in --tables are TT anyway).")
@click.option("--tt-rank", type=int, default=32, show_default=True, help="TT rank of the tables --tt-min-rows selects.")
@click.option("--host-min-rows", type=int, default=0, show_default=True,
              help="Place tables of at least this many rows in the host parameter server (EL-Rec V): not in the "
                   "plan. 0 = off.")
@click.option("--device-memory", default="256MiB", show_default=True,
              help="--strategy auto: device memory per rank (e.g. 256MiB, 2GiB).")
@click.option("--host-memory", default="512MiB", show_default=True,
              help="--strategy auto: host memory per rank for host-placed tables.")
@click.option("--costs", "costs_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="--strategy auto: per-row costs from embedscale calibrate (default: documented assumptions).")
@click.option("--tt-ranks", default="8,16,32,64", show_default=True, help="--strategy auto: TT ranks to consider.")
@click.option("--host-depth", type=int, default=1, show_default=True,
              help="--strategy auto: pipeline depth of host tables (sizes their device cache; training runs "
                   "--train-pipeline-depth: give it the same).")
@click.option("--hot-touch", type=float, default=0.01, show_default=True,
              help="--strategy auto: a table the global batch reads this many times per row (lookups / rows) stays exact.")
@click.option("--auto-search", type=click.Choice(["greedy", "milp"]), default="greedy", show_default=True,
              help="--strategy auto: greedy search, or the exact MILP (HiGHS; small cases).")
@click.option("--tt-reorder", type=click.Choice(["none", "frequency", "leiden", "louvain"]), default="none",
              show_default=True,
              help="Give every TT table of the plans an index reordering (EL-Rec IV) that the plan carries "
                   "(OUT/<strategy>/reorder/) and training applies: frequency (from --profile), leiden or louvain "
                   "(also co-accessed rows together, from the batches of --reorder-data).")
@click.option("--tt-reorder-hot-ratio", type=float, default=0.01, show_default=True,
              help="--tt-reorder: share of rows, hottest first, that keep the first ids.")
@click.option("--reorder-data", type=click.Path(exists=True, file_okay=False), default=None,
              help="--tt-reorder leiden/louvain: the shard directory whose first batches give co-access.")
@click.option("--no-row-groups", is_flag=True,
              help="--strategy auto: TT tables whole (by default, with --profile, a TT table's rows that a global "
                   "batch reads at least once each stay exact: row groups, the plan carrying the reordering that "
                   "puts them first).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def plan(tables_path, preset, max_rows, dim, profile_path, zipf, topology_path, hosts, ranks_per_host, strategies,
         mode, extra_memory, batch_size, traffic, out_dir, tt_min_rows, tt_rank, host_min_rows, device_memory, host_memory,
         costs_path, tt_ranks, host_depth, hot_touch, auto_search, tt_reorder, tt_reorder_hot_ratio, reorder_data,
         no_row_groups, as_json):
    """Place every row of every table on the ranks (OPER) and compare strategies on one cost model.

    Writes OUT/<strategy>/ (the plan training and inference load), report.json, report.md and report.png.
    With --profile of the data (embedscale profile DIR) the tables are the ones training builds by default
    (t_<feature>). Every table's form is decided here and saved in the plan (training with --dist-plan builds
    it): TT-compressed tables (compression: tt, or --tt-min-rows) and host tables (placement: host, or
    --host-min-rows) are not placed; every rank holds the TT cores.

    --strategy auto decides every table's form itself (replicated, sharded, TT of a rank, host with a cache)
    for the fastest predicted step within --device-memory and --host-memory per rank; OUT/auto/ holds the
    plan and its explain report (explain.txt, explain.json, memory.png).

    --tt-reorder gives the TT tables an index reordering (EL-Rec IV) built from --profile (and --reorder-data)
    that each plan carries in OUT/<strategy>/reorder/; training with the plan renames their ids by it.
    """
    auto = "auto" in strategies
    strategies = [s for s in strategies if s != "auto"]
    try:
        if tt_reorder != "none" and not profile_path:
            raise EmbedscaleError(f"--tt-reorder {tt_reorder}: the reordering is built from the data's access "
                                  "profile: give --profile DIR (embedscale profile)")
        tables, requests = _plan_tables(tables_path, preset, max_rows, dim, profile_path)
        prof = profile_path or {"kind": "zipf", "alpha": zipf}
        topo = _plan_topology(topology_path, hosts, ranks_per_host)
        arep = None
        if auto:
            if tt_min_rows or host_min_rows:
                raise EmbedscaleError("--strategy auto decides the forms itself: drop --tt-min-rows / --host-min-rows")
            try:
                ranks = [int(r) for r in str(tt_ranks).split(",") if r.strip()]
            except ValueError:
                raise EmbedscaleError(f"--tt-ranks: expected comma-separated integers, got {tt_ranks!r}") from None
            arep = auto_plan_command(tables, prof, topo, out_dir, device_memory=parse_bytes(device_memory, "--device-memory"),
                                     host_memory=parse_bytes(host_memory, "--host-memory"), costs=load_costs(costs_path),
                                     json_output=as_json, batch_size=batch_size, mode=mode, tt_rank_list=ranks,
                                     host_depth=host_depth, hot_touch=hot_touch, search=auto_search,
                                     requests=requests,
                                     **({"hot_row_touch": 0.0} if no_row_groups or not profile_path else {}))
            _attach_reordering(arep["plan_dir"], tables, profile_path, tt_reorder, tt_reorder_hot_ratio, reorder_data)
            if not as_json:
                click.echo(explain_text(arep), nl=False)
                click.echo(f"auto plan and explain report in {arep['plan_dir']}/")
            if not strategies:
                return
        if tt_min_rows < 0:
            raise EmbedscaleError(f"--tt-min-rows must be >= 0 (0 = off), got {tt_min_rows}")
        forms = decide_forms(tables, requests=requests, tt_min_rows=tt_min_rows, tt_rank=tt_rank,
                             host_min_rows=host_min_rows)
        rep = plan_command(tables, prof, topo, list(strategies), out_dir, mode, extra_memory, json_output=as_json,
                           batch_size=batch_size, forms=forms, traffic=traffic)
        for name, e in rep["strategies"].items():
            if "error" not in e and (Path(out_dir) / name / "plan.json").exists():
                _attach_reordering(Path(out_dir) / name, tables, profile_path, tt_reorder, tt_reorder_hot_ratio,
                                   reorder_data)
    except EmbedscaleError as e:
        _fail(e)
    if not as_json:
        click.echo(f"{'strategy':<14} {'plan s':>8} {'DoB mem':>8} {'DoB lookup':>10} {'DoB comm':>9} "
                   f"{'comm MB/link':>13} {'max rank cost':>14}")
        for name, e in rep["strategies"].items():
            if "error" in e:
                click.echo(f"{name:<14} error: {e['error']}")
                continue
            click.echo(f"{name:<14} {e['plan_seconds']:>8.2f} {e['dob_memory']:>8.3f} {e['dob_lookup']:>10.3f} "
                       f"{e['dob_comm']:>9.3f} {e['comm_mean'] / 1e6:>13.4f} {e['max_rank_cost']:>14.1f}")
        tt = rep["config"].get("replicated_tables")
        if tt:
            click.echo(f"TT tables, replicated on every rank ({rep['config']['replicated_bytes_per_rank'] / 2**20:,.2f} "
                       f"MiB of cores per rank): " + ", ".join(f"{m['name']} ({m['num_rows']:,} rows)" for m in tt))
        click.echo(f"plans and report in {out_dir}/")


@main.command()
@click.option("--out", "out_path", type=click.Path(dir_okay=False), required=True, help="Costs JSON to write.")
@click.option("--device", default=None, help="Device to measure (default: torch's default device).")
@click.option("--rows", type=int, default=1 << 20, show_default=True)
@click.option("--dim", type=int, default=16, show_default=True)
@click.option("--batch", type=int, default=4096, show_default=True)
@click.option("--tt-ranks", default="8,16,32,64", show_default=True)
@click.option("--repeats", type=int, default=7, show_default=True)
@click.option("--links", is_flag=True, help="Also measure link bandwidth and latency on 2 local ranks.")
@click.option("--ranks", type=int, default=0, show_default=True,
              help="Also time real training steps on this many local ranks (embedscale train --nproc N; --batch "
                   "per rank) under a sharded, a TT and a host plan, and fit the distributed executor's overhead "
                   "per table of each form (a few minutes). 0 = off.")
@click.option("--rank-steps", type=int, default=60, show_default=True,
              help="--ranks: steps per timed run (the first 10 are its warm-up, not timed).")
@click.option("--rank-repeats", type=int, default=3, show_default=True,
              help="--ranks: rounds of the timed plans (a plan's spread over them bounds what counts as overhead).")
@click.option("--host-depth", type=int, default=2, show_default=True, help="--ranks: pipeline depth of host tables.")
@click.option("--work", "work_dir", type=click.Path(file_okay=False), default=None,
              help="--ranks: keep the data, plans and runs here (default: a temporary directory).")
@node_options
def calibrate(out_path, device, rows, dim, batch, tt_ranks, repeats, links, ranks, rank_steps, rank_repeats,
              host_depth, work_dir, nnodes, node_rank, rdzv_endpoint, rdzv_id, rdzv_timeout):
    """Measure the per-row costs plan --strategy auto reads (--costs): exact, TT and host-table steps; with
    --ranks N also the distributed executor's own work per table form, from real N-rank steps."""
    try:
        tt = [int(r) for r in tt_ranks.split(",") if r.strip()]
    except ValueError:
        _fail(EmbedscaleError(f"--tt-ranks: expected comma-separated integers, got {tt_ranks!r}"))
    try:
        if ranks < 0 or ranks == 1:
            raise EmbedscaleError(f"--ranks: 0 (off) or at least 2, got {ranks}")
        costs = calibrate_costs(device=device, rows=rows, dim=dim, batch=batch, tt_ranks=tt, repeats=repeats,
                                links=links)
        nodes = _nodes(nnodes, node_rank, rdzv_endpoint, rdzv_id, "calibrate")
        if nodes.multi and not ranks:
            raise EmbedscaleError("--nnodes: only calibrate --ranks N runs on several nodes")
        if ranks:
            costs = calibrate_ranks(costs, ranks=ranks, batch=batch, rows=rows, dim=dim, steps=rank_steps,
                                    repeats=rank_repeats, host_depth=host_depth, device=costs.notes["device"],
                                    work=work_dir, nodes=nodes)
            if costs is None:
                return
        costs.save(out_path)
    except EmbedscaleError as e:
        _fail(e)
    click.echo(f"exact {costs.exact_lookup_s * 1e9:.1f} ns/lookup; TT " + ", ".join(
        f"rank {r}: {s * 1e9:.1f}" for r, s in costs.tt_lookup_s.items()) + f" ns/lookup; host "
        f"{costs.host_row_s * 1e9:.1f} ns/row"
        + (f"; executor on {costs.executor_world} ranks, "
           + executor_overheads_text(costs.executor_overhead_s, lambda s: f"{s * 1e6:.0f} us")
           if costs.executor_overhead_s else "")
        + f"; costs written to {out_path}")


@main.command()
@click.argument("plan_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--profile", "profile_path", type=click.Path(exists=True, file_okay=False), required=True,
              help="The new access profile.")
@click.option("--old-profile", "old_profile_path", type=click.Path(exists=True, file_okay=False), default=None,
              help="The profile the plan was made from (default: the per-partition counts an oper plan stores).")
@click.option("--topology", "topology_path", type=click.Path(exists=True, dir_okay=False), default=None)
@click.option("--hosts", type=int, default=1, show_default=True)
@click.option("--ranks-per-host", type=int, default=2, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def drift(plan_dir, profile_path, old_profile_path, topology_path, hosts, ranks_per_host, as_json):
    """Evaluate a saved plan on a new profile (OPER section 8): how far its balance fell, whether to re-plan,
    and how many rows a re-plan would move; costed with the traffic model the plan was made with (plan --traffic)."""
    try:
        rep = drift_command(plan_dir, profile_path, _plan_topology(topology_path, hosts, ranks_per_host),
                            json_output=as_json, old_profile=old_profile_path)
    except EmbedscaleError as e:
        _fail(e)
    if not as_json:
        click.echo(json.dumps(rep, indent=1, default=float))


@main.command()
@click.option("--hosts", type=int, default=1, show_default=True)
@click.option("--ranks-per-host", type=int, default=2, show_default=True)
@click.option("--measure", is_flag=True, help="Fill bandwidths and latencies from a micro-benchmark on local ranks.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), required=True)
def topology(hosts, ranks_per_host, measure, out_path):
    """Write a topology file (hosts x ranks, link bandwidths and latencies, the cost matrix L of OPER 3.2)."""
    try:
        d = topology_command(out_path, num_hosts=hosts, ranks_per_host=ranks_per_host, measure=measure)
    except EmbedscaleError as e:
        _fail(e)
    click.echo(f"topology ({d.get('source', 'spec')}) written to {out_path}")


@main.command()
@click.argument("run", type=click.Path(exists=True))
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="Assignment JSON (default RUN/learned-towers.json); a .report.json and a .png go beside it.")
@click.option("--towers", type=int, default=0, show_default=True,
              help="Number of towers T (0: the run's model.towers, else one per host of dist.topology_hosts).")
@click.option("--strategy", type=click.Choice(["coherent", "diverse"]), default="coherent", show_default=True,
              help="coherent: similar features share a tower; diverse: dissimilar ones do (DMT 3.3).")
@click.option("--max-ratio", type=float, default=1.0, show_default=True,
              help="K: largest allowed max/min tower size ratio (raised to the smallest feasible one).")
@click.option("--samples", type=int, default=65536, show_default=True,
              help="Samples of the run's eval split (train split if none) for the interaction matrix.")
@click.option("--coord-dim", type=int, default=2, show_default=True, help="Dimension of the feature coordinates.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--no-center", is_flag=True,
              help="DMT's uncentred |cos| (default: every feature's mean embedding subtracted first).")
@click.option("--no-png", is_flag=True, help="Do not draw the interaction matrix.")
@click.option("--no-progress", is_flag=True)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def towers(run, out_path, towers, strategy, max_ratio, samples, coord_dim, seed, no_center, no_png, no_progress,
           as_json):
    """Learn a balanced, meaningful feature-to-tower assignment from a trained run (DMT 3.3 tower partitioner).

    RUN is a run directory (its best evaluation's checkpoint, else its latest; any arch) or a checkpoint. A DMT run trains with the result:
    --model-arch dmt-dlrm --model-tower-assignment OUT.
    """
    try:
        s = towers_command(run, out_path, towers=towers, strategy=strategy, max_ratio=max_ratio, samples=samples,
                           coord_dim=coord_dim, seed=seed, center=not no_center, png=not no_png,
                           progress=not no_progress)
    except EmbedscaleError as e:
        _fail(e)
    click.echo(json.dumps(s, default=float) if as_json else format_towers_summary(s))


@main.command()
@click.argument("shards", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True,
              help="Where the index bijection goes (JSON + one .npy per table).")
@click.option("--hot-ratio", type=float, default=0.01, show_default=True,
              help="Share of rows, hottest first, kept in front (EL-Rec IV).")
@click.option("--method", type=click.Choice(["leiden", "louvain"]), default="leiden", show_default=True)
def reorder(shards, out_dir, hot_ratio, method):
    """Index reordering (EL-Rec IV): hot rows first, then communities of co-accessed rows get consecutive ids.
    Writes the bijection; a model applies it to its ids (MixedEmbedding(reordering=...), Reordering.apply)."""
    try:
        out = reorder_shards(shards, out_dir, hot_ratio=hot_ratio, method=method)
    except EmbedscaleError as e:
        _fail(e)
    click.echo(f"index bijection written to {out['out_dir']}")


@main.command()
@click.argument("shards", type=click.Path(exists=True, file_okay=False))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True)
@click.option("--no-progress", is_flag=True)
@click.option("--json", "as_json", is_flag=True)
def profile(shards, out_dir, no_progress, as_json):
    """Count how often every row of every table is read (the planner's input)."""
    try:
        prof = AccessProfile.from_shards(shards, progress=not no_progress)
        prof.save(out_dir)
    except EmbedscaleError as e:
        _fail(e)
    s = prof.summary()
    if as_json:
        click.echo(json.dumps(s, default=float))
    else:
        click.echo(f"profile of {shards} written to {out_dir}")
        click.echo(_format_profile_summary(s))


def _format_profile_summary(s) -> str:
    if isinstance(s, str):
        return s
    return json.dumps(s, indent=1, default=float)


# -- serving: export, predict, serve (embedscale.serve) ---------------------------------------------
export_model = _Lazy("embedscale.serve.export:export")
follow_export = _Lazy("embedscale.serve.export:follow_run")
predict_file = _Lazy("embedscale.serve.predict:predict_file")
serve_export = _Lazy("embedscale.serve.server:serve")
ServeConfig = _Lazy("embedscale.serve.server:ServeConfig")


@main.command("export")
@click.argument("source", type=click.Path(exists=True))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True, help="The export directory.")
@click.option("--quantize", type=click.Choice(["fp32", "fp16", "int8", "int4", "auto"]), default="fp32",
              show_default=True,
              help="The tables' served form (row-wise INT8/INT4: FBGEMM's fused rows, a scale and bias per row); "
                   "auto: each table at the narrowest form whose eval AUC stays within --tolerance of FP32.")
@click.option("--tolerance", type=click.FloatRange(min=0), default=0.001, show_default=True,
              help="auto: the largest eval AUC drop from FP32 the export may take.")
@click.option("--table-budget", default=None, metavar="BYTES",
              help="auto: the tables' bytes must fit this (e.g. 2GiB); the largest tables are narrowed to INT4 "
                   "until they do.")
@click.option("--auto-samples", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="auto: eval rows scored per trial.")
@click.option("--data", "data_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="The training dataset (default: the run config's, from its data cache).")
@click.option("--follow", is_flag=True,
              help="Keep exporting the run's latest checkpoint as new ones appear (for serve --follow OUT), until "
                   "SIGTERM/Ctrl-C, --max-exports or --idle-s.")
@click.option("--poll-s", type=click.FloatRange(min=0.05), default=2.0, show_default=True, help="--follow: poll period.")
@click.option("--max-exports", type=click.IntRange(min=0), default=0, help="--follow: stop after N exports (0: never).")
@click.option("--idle-s", type=click.FloatRange(min=0), default=0.0,
              help="--follow: stop after this many seconds without a new checkpoint (0: never).")
@click.option("--json", "as_json", is_flag=True)
def export_command(source, out_dir, quantize, tolerance, table_budget, auto_samples, data_dir, follow, poll_s,
                   max_exports, idle_s, as_json):
    """Export a checkpoint (a run directory: its checkpoints/best, else its latest) into one self-contained
    directory (safetensors weights + export.json) that predict and serve load without the run. --follow: keep
    OUT the export of the run's latest checkpoint while it trains."""
    if follow:
        if quantize == "auto":
            _fail(EmbedscaleError("--follow takes a fixed form (fp32, fp16, int8, int4), not auto"))
        stopping: list[int] = []  # SIGTERM / Ctrl-C: end after the export in progress (never a half-written one)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda num, frame: stopping.append(num))
        try:
            n = follow_export(source, out_dir, quantize, poll_s=poll_s, max_exports=max_exports, idle_s=idle_s,
                              data_dir=data_dir, log=lambda m: click.echo(m, err=True), stop=lambda: bool(stopping))
        except EmbedscaleError as e:
            _fail(e)
        click.echo(json.dumps({"exports": n}) if as_json else f"{n} export(s) of {source} written to {out_dir}")
        return
    try:
        budget = parse_bytes(table_budget, "--table-budget") if table_budget else None
        m = export_model(source, out_dir, quantize, data_dir, tolerance=tolerance, table_budget=budget,
                         auto_samples=auto_samples, progress=not as_json)
    except EmbedscaleError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(m))
    else:
        click.echo(f"{out_dir}: {m['model_version']} ({len(m['tables'])} tables, {m['table_bytes']:,} bytes of "
                   f"table rows, step {m['source']['step']} of {m['source']['run']})")


@main.command("predict")
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("data_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", "out_path", type=click.Path(dir_okay=False), required=True, help="Predictions (Parquet).")
@click.option("--json", "as_json", is_flag=True)
def predict_command(export_dir, data_file, out_path, as_json):
    """Score every row of a file of the export's schema (labeled or not) into OUT (Parquet: probability,
    logit, label); prints AUC and logloss when the file is labeled."""
    r = predict_file(export_dir, data_file, out_path)
    if as_json:
        click.echo(json.dumps(r))
    elif r["labeled"]:
        click.echo(f"{r['rows']:,} rows scored by {r['model_version']} into {out_path}: logloss {r['logloss']:.5f}  "
                   f"AUC {r['auc']:.5f}  calibration {r['calibration']:.5f}")
    else:
        click.echo(f"{r['rows']:,} rows scored by {r['model_version']} into {out_path} (unlabeled)")


@main.command("serve")
@click.argument("export_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=256, show_default=True, help="Rows per forward pass.")
@click.option("--max-wait-ms", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="How long a request waits for others to share its batch.")
@click.option("--queue-rows", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Rows waiting at most; a request beyond is answered 503.")
@click.option("--max-rows", type=click.IntRange(min=1), default=1024, show_default=True, help="Rows per request.")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=1 << 20, show_default=True)
@click.option("--follow", "follow_dir", type=click.Path(file_okay=False), default=None,
              help="An export directory to watch (usually EXPORT_DIR): a new export written there is swapped in "
                   "between batches.")
@click.option("--follow-poll-s", type=click.FloatRange(min=0.01), default=1.0, show_default=True)
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True,
              help="Server processes on the port; the tables are memory-mapped, one copy for all.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="Compute threads per worker (one core each; add --workers to use more cores).")
@click.option("--dense", type=click.Choice(["fp32", "bf16", "int8"]), default="fp32", show_default=True,
              help="The dense model's precision (bf16: autocast; int8: dynamic quantization of its Linear layers).")
@click.option("--compute-nice", type=click.IntRange(0, 19), default=10, show_default=True,
              help="How much lower the compute thread's priority is than the thread reading requests (Linux): "
                   "under overload requests are read, and refused when the queue is full, first.")
@click.option("--switch-interval-ms", type=click.FloatRange(min=0), default=0.5, show_default=True,
              help="The interpreter's GIL switch interval while serving (0: Python's own, 5 ms).")
@click.option("--expand-ranking", is_flag=True, hidden=True, help="Score ranking calls as expanded rows (benchmarks).")
@click.option("--refuse-in-handler", is_flag=True, hidden=True, help="A full queue refused after routing (benchmarks).")
@click.option("--timing-headers", is_flag=True, hidden=True, help="x-embedscale-clock on answers (benchmarks).")
@click.option("--encode-thread/--no-encode-thread", default=True, show_default=True,
              help="Encode requests in a thread beside the event loop (which then reads and refuses sooner).")
@click.option("--gc-freeze/--no-gc-freeze", default=True, show_default=True,
              help="Leave the objects alive after loading out of Python's full garbage collections (gc.freeze): "
                   "no stall of the server while one walks the model's objects.")
@click.option("--gc-young", type=click.IntRange(min=0), default=10_000, show_default=True,
              help="Python's young-generation collection threshold while serving (net allocations between "
                   "collections; 0: Python's own, 700).")
@click.option("--test-delay-ms", type=click.FloatRange(min=0), default=0.0, hidden=True)
def serve_command(export_dir, host, port, max_batch, max_wait_ms, queue_rows, max_rows, max_body_bytes,
                  follow_dir, follow_poll_s, workers, threads, dense, compute_nice, switch_interval_ms,
                  expand_ranking, refuse_in_handler, timing_headers, encode_thread, gc_freeze, gc_young,
                  test_delay_ms):
    """Serve an export over HTTP: POST /v1/predict {"rows": [...]}, /v1/model, /healthz, /readyz, /metrics.
    SIGTERM answers what is in flight, then exits 0."""
    cfg = ServeConfig(max_batch=max_batch, max_wait_ms=max_wait_ms, queue_rows=queue_rows, max_rows=max_rows,
                      max_body=max_body_bytes, delay_ms=test_delay_ms, follow=follow_dir,
                      follow_poll_s=follow_poll_s, threads=threads, dense=dense,
                      by_context=not expand_ranking, compute_nice=compute_nice,
                      switch_interval_ms=switch_interval_ms, refuse_in_handler=refuse_in_handler,
                      timing_headers=timing_headers, encode_thread=encode_thread, gc_freeze=gc_freeze,
                      gc_young=gc_young)
    sys.exit(serve_export(export_dir, host, port, cfg, workers=workers))


if __name__ == "__main__":  # pragma: no cover
    main()
