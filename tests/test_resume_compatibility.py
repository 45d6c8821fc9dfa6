"""Resuming refuses a model key the run changes even where no shape changes (Θ, τ, rotary, norms): the
checkpoint's weights would silently compute another function (formats/deepspeed/compatibility.py)."""

from __future__ import annotations

import pytest

from megatron.config import ConfigError, load_config
from megatron.formats.deepspeed.compatibility import architecture_problems
from megatron.formats.deepspeed.files import write_checkpoint
from megatron.formats.deepspeed.resume import load_checkpoint
from megatron.formats.tensor_parallel import split_dimensions, split_state
from megatron.model import TokenFormerArgs, TokenFormerModel
from tests.conftest import REPO

TINY = REPO / "tests" / "tiny.yml"


def config(*overrides: str):
    return load_config([TINY], ["padded_vocab_size=256", *overrides])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    save = tmp_path_factory.mktemp("resume") / "checkpoints"
    cfg = config()
    args = TokenFormerArgs.from_config(cfg)
    write_checkpoint(split_state(TokenFormerModel(args).state_dict(), split_dimensions(args), 1), cfg, save)
    return save


def test_the_same_model_keys_resume(saved):
    assert architecture_problems(saved / "global_step0", config(f"load={saved}", "train_iters=20")) == []


@pytest.mark.parametrize("changed, message", [
    ("norm_activation_type=gelu_l2_norm", "norm_activation_type (saved 'l2_norm_gelu', this run 'gelu_l2_norm')"),
    ("pattention_tau=2.0", "pattention_tau (saved 1.0, this run 2.0)"),
    ("rotary_emb_base=500", "rotary_emb_base (saved 10000, this run 500)"),
])
def test_a_model_key_changed_without_a_shape_change_is_refused_before_deepspeed_loads(saved, changed, message):
    cfg = config(f"load={saved}", changed)
    with pytest.raises(ConfigError) as error:
        load_checkpoint(engine=None, cfg=cfg, tag="global_step0")
    assert str(error.value) == (
        f"load: {saved / 'global_step0'} was trained as another model: {message}. Its weights compute a different "
        "function under these values: set them as in its config.json (to grow the slot counts, use "
        "tools/grow_checkpoint.py)")
