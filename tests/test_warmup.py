"""Dense learning-rate warmup (``train.lr_warmup_steps``): the schedule, and that it survives a checkpoint."""

from __future__ import annotations

import pytest
import torch

from embedscale.errors import ConfigError
from embedscale.train.trainer import warm_up_lr


def _opt(lr=0.5):
    return torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(3))], lr=lr)


def test_linear_ramp_then_the_configured_rate():
    opt = _opt()
    seen = []
    for step in range(6):
        warm_up_lr(opt, step, 4)
        seen.append(opt.param_groups[0]["lr"])
    assert seen == pytest.approx([0.125, 0.25, 0.375, 0.5, 0.5, 0.5])


def test_resume_mid_warmup_continues_the_ramp():
    opt = _opt()
    warm_up_lr(opt, 1, 4)
    state = opt.state_dict()  # saved mid-warmup: lr 0.25 in the group, the base rate kept beside it
    fresh = _opt(lr=0.5)
    fresh.load_state_dict(state)
    warm_up_lr(fresh, 2, 4)
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.375)


def test_zero_is_off_and_negative_is_an_error():
    opt = _opt()
    warm_up_lr(opt, 0, 0)
    assert opt.param_groups[0]["lr"] == 0.5
    with pytest.raises(ConfigError, match="train.lr_warmup_steps"):
        warm_up_lr(opt, 0, -1)
