"""The towers of a DMT run (``model.arch: dmt-dlrm | dmt-dcn``): its tower layout over the hosts (DMT 3.1.1,
3.1.3) and its feature-to-tower assignment, resolved once by rank 0 and kept in ``<run dir>/towers.json``
(a resume must use the same towers). Below both the flat and the DMT run (``train.distributed``,
``train.dmt_run``), which read it.
"""

from __future__ import annotations

from pathlib import Path

from embedscale.errors import ConfigError
from embedscale.specs import RunConfig, TableSpec
from embedscale.plan.tower_placement import TowerLayout
from embedscale.embedding.towers import tower_groups_of
from embedscale.models.dmt import DMTConfig, resolve_assignment
from embedscale.plan.towers import TowerAssignment

TOWERS_FILE = "towers.json"


def dmt_layout(cfg: RunConfig, world: int):
    """The ``TowerLayout`` of a run: ``dist.topology_hosts`` hosts of ``world / hosts`` ranks, towers of
    ``model.hosts_per_tower`` hosts (DMT 3.1.1, 3.1.3)."""
    hosts = cfg.dist.topology_hosts
    if isinstance(hosts, bool) or not isinstance(hosts, int) or hosts <= 0 or world % hosts:
        raise ConfigError(f"dist.topology_hosts {hosts!r} does not divide the {world} ranks into hosts")
    K = cfg.model.hosts_per_tower
    if isinstance(K, bool) or not isinstance(K, int) or K <= 0 or hosts % K:
        raise ConfigError(f"model.hosts_per_tower {K!r} does not divide dist.topology_hosts {hosts} "
                          "(DMT 3.1.3: every tower group spans the same number of hosts)")
    return TowerLayout(world, world // hosts, K)


def resolve_run_towers(cfg: RunConfig, tables: list[TableSpec]):
    """The run's ``TowerAssignment`` from its config (checked against the tables and the topology)."""
    dmt = DMTConfig.from_model(cfg.model)
    hosts = cfg.dist.topology_hosts
    if hosts % dmt.hosts_per_tower:
        raise ConfigError(f"model.hosts_per_tower {dmt.hosts_per_tower} does not divide dist.topology_hosts {hosts}")
    groups = hosts // dmt.hosts_per_tower
    features = [f for t in tables for f in t.features]
    assignment = resolve_assignment(dmt, features, groups)
    tower_groups_of(assignment.num_towers, groups)  # every tower group needs a tower
    return assignment


def prepare_towers(cfg: RunConfig, tables: list[TableSpec], run_dir: Path):
    """Rank 0: resolve the towers and write ``<run dir>/towers.json``; a run directory that already
    holds different towers (a resume under another assignment) is a ``ConfigError``."""
    assignment = resolve_run_towers(cfg, tables)
    path = Path(run_dir) / TOWERS_FILE
    if path.exists():
        old = TowerAssignment.load(path)
        if old.towers != assignment.towers:
            raise ConfigError(f"{path}: this run directory was trained with towers {old.towers}; the config now "
                              f"gives {assignment.towers} (model.towers / model.tower_assignment). Use a new run "
                              "directory or the same towers")
        return old
    assignment.save(path)
    return assignment
