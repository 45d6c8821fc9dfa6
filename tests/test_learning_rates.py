"""The LR schedule: GPT-NeoX warmup fraction, decay styles, floor at min_lr."""

import math

import pytest

from megatron.training.learning_rates import LRSchedule


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


def test_a_resume_that_changes_the_rate_by_more_than_a_factor_is_named():
    from megatron.config import load_config
    from megatron.training.learning_rates import resume_lr_change
    from tests.conftest import REPO

    demo = [REPO / "configs" / "demo.yml"]
    saved = load_config(demo)
    assert resume_lr_change(saved, load_config(demo), 150) is None
    assert resume_lr_change(saved, load_config(demo, ["lr_decay_iters=310"]), 150) is None  # a small change
    shortened = load_config(demo, ["lr_decay_iters=160"])
    expected, used = (LRSchedule.from_config(c).lr_at(150) for c in (saved, shortened))
    assert used < expected / 2
    warning = resume_lr_change(saved, shortened, 150)
    assert warning == (f"resuming at iteration 150 with learning rate {used:.3e}, {expected / used:.3g}x lower than "
                       f"the {expected:.3e} the checkpoint's run would have used next: lr_decay_iters "
                       f"({saved.lr_decay_iters} -> 160) differ from its config.json. If that is not intended, set "
                       "them as the checkpoint's run had them")
