"""The LR schedule: GPT-NeoX warmup fraction, decay styles, floor at min_lr."""

import math

import pytest

from megatron.learning_rates import LRSchedule


def schedule(style: str) -> LRSchedule:
    return LRSchedule(max_lr=1e-3, min_lr=1e-4, warmup_iters=10, decay_iters=110, style=style)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_is_linear_to_max(style):
    s = schedule(style)
    assert s.lr_at(0) == pytest.approx(1e-4)
    assert s.lr_at(4) == pytest.approx(5e-4)
    assert s.lr_at(9) == pytest.approx(1e-3)


def test_decay_styles_reach_min_lr_and_stay():
    for style in ("linear", "cosine"):
        s = schedule(style)
        assert s.lr_at(10) == pytest.approx(1e-3)
        assert s.lr_at(110) == pytest.approx(1e-4)
        assert s.lr_at(500) == pytest.approx(1e-4)
    assert schedule("constant").lr_at(500) == pytest.approx(1e-3)


def test_midpoints():
    assert schedule("linear").lr_at(60) == pytest.approx(1e-4 + 0.5 * 9e-4)
    expected = 1e-4 + 9e-4 * 0.5 * (math.cos(math.pi * 0.25) + 1)
    assert schedule("cosine").lr_at(35) == pytest.approx(expected)


def test_from_config_uses_warmup_fraction_of_decay_iters():
    class Cfg:
        lr, min_lr, warmup, lr_decay_iters, train_iters, lr_decay_style = 1e-3, 0.0, 0.1, 200, 300, "cosine"

    s = LRSchedule.from_config(Cfg)
    assert (s.warmup_iters, s.decay_iters) == (20, 200)
