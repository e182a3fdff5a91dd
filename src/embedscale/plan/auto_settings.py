"""The config of ``dist.plan auto`` checked before any data is read or any rank starts (no torch: the launcher
checks it too, so a bad budget is one named error, not one per rank under torchrun)."""

from __future__ import annotations

from pathlib import Path

from embedscale.errors import ConfigError
from embedscale.specs import RunConfig
from embedscale.units import parse_bytes

AUTO = "auto"  # dist.plan: every table's form decided under dist.device_memory / dist.host_memory
AUTO_KEYS = ("device_memory", "host_memory", "costs", "plan_trial_steps")  # the DistConfig keys only dist.plan auto reads


def check_auto_settings(cfg: RunConfig) -> None:
    """``dist.plan auto`` decides every table's form itself under ``dist.device_memory`` (required) and
    ``dist.host_memory``: a form requested in the config (``model.tt_min_rows``, ``model.host_min_rows``; a
    ``model.tables`` entry's compression / placement is refused by ``make_auto_plan``) is a ``ConfigError``,
    and so are the budgets (and ``dist.costs``) under any other ``dist.plan``, which would ignore them."""
    d, m = cfg.dist, cfg.model
    if d.plan != AUTO:
        given = [f"dist.{k}" for k in AUTO_KEYS if getattr(d, k)]
        if given:
            raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} read by dist.plan auto only; "
                              f"this run's dist.plan is {d.plan!r}: drop {'it' if len(given) == 1 else 'them'} or "
                              "plan with --dist-plan auto")
        return
    asked = [f"model.{k} {getattr(m, k)}" for k in ("tt_min_rows", "host_min_rows") if getattr(m, k)]
    if asked:
        raise ConfigError(f"dist.plan auto decides every table's form itself; the config asks for forms by "
                          f"{', '.join(asked)}: drop the request or plan with another dist.plan")
    if not d.device_memory:
        raise ConfigError("dist.plan auto needs the device memory per rank: set dist.device_memory "
                          "(--dist-device-memory, e.g. 256MiB)")
    parse_bytes(d.device_memory, "dist.device_memory")
    parse_bytes(d.host_memory or 0, "dist.host_memory")
    if d.costs and not Path(d.costs).is_file():
        raise ConfigError(f"dist.costs {d.costs}: no such file (write one with embedscale calibrate --out)")
