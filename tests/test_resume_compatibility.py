"""Resuming refuses a model key the run changes even where no shape changes (Θ, τ, rotary, norms): the
checkpoint's weights would silently compute another function (formats/deepspeed/compatibility.py). An optimizer or
data key changed is warned, one line per key, before deepy.py launches (formats/deepspeed/changed_settings.py)."""

from __future__ import annotations

import shutil

import pytest

from megatron.config import ConfigError, load_config
from megatron.formats.deepspeed.changed_settings import resume_warnings
from megatron.formats.deepspeed.compatibility import architecture_problems
from megatron.formats.deepspeed.files import write_checkpoint
from megatron.formats.deepspeed.resume import load_checkpoint
from megatron.formats.tensor_parallel import split_dimensions, split_state
from megatron.model import TokenFormerArgs, TokenFormerModel
from tests.conftest import REPO, run_deepy

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


# --- optimizer and data keys: warned, not refused (formats/deepspeed/changed_settings.py) ---

WARNING_END = " (set it as in its config.json if that is not intended)"
NEW_BETAS = "optimizer={type: Adam, params: {lr: 0.005, betas: [0.9, 0.99], eps: 1.0e-8}}"


def test_optimizer_and_data_keys_changed_on_resume_are_warned_one_line_each(zero_data_parallel_checkpoint):
    checkpoint = zero_data_parallel_checkpoint
    tag_dir = checkpoint.save / "global_step2"
    load = f"load={checkpoint.save}"
    cfg = checkpoint.config(load, NEW_BETAS, "weight_decay=0.01", "split='800,200,0'", "num_workers=1",
                            "num_layers=2")
    assert resume_warnings(cfg) == [
        f"resuming {tag_dir} with optimizer.params.betas changed: saved [0.9, 0.95], this run [0.9, 0.99]{WARNING_END}",
        f"resuming {tag_dir} with weight_decay changed: saved 0.1, this run 0.01{WARNING_END}",
        f"resuming {tag_dir} with split changed: saved '900,100,0', this run '800,200,0'{WARNING_END}",
    ]  # num_workers reads the same data; the model keys are refused elsewhere
    assert resume_warnings(checkpoint.config(load)) == []
    assert resume_warnings(checkpoint.config(load, "weight_decay=0.01", "eval_only=true")) == []


def test_a_seed_changed_on_resume_is_warned_as_another_data_order(zero_data_parallel_checkpoint):
    """The seed draws the data order and the validation samples: changed, the restored data position points at
    other text, as with seq_length."""
    checkpoint = zero_data_parallel_checkpoint
    tag_dir = checkpoint.save / "global_step2"
    assert resume_warnings(checkpoint.config(f"load={checkpoint.save}", "seed=7")) == [
        f"resuming {tag_dir} with seed changed: saved 1234, this run 7. The data order and the validation samples "
        "are drawn from the seed, so the data position it holds points at another order: from there the run reads "
        f"some text again, some never, and validates on other samples{WARNING_END}"]


def test_a_weights_only_checkpoint_is_a_warm_start_and_not_warned(saved):
    assert resume_warnings(config(f"load={saved}", "weight_decay=0.01", "split='800,200,0'")) == []


@pytest.mark.slow
def test_deepy_prints_the_warnings_before_launching(zero_data_parallel_checkpoint, tmp_path):
    checkpoint = tmp_path / "checkpoints"
    shutil.copytree(zero_data_parallel_checkpoint.save, checkpoint)
    # One iteration past the checkpoint's: at its iteration deepy.py would say there is nothing to train
    result = run_deepy("train.py", str(TINY), *zero_data_parallel_checkpoint.overrides, f"load={checkpoint}",
                       f"save={checkpoint}", "weight_decay=0.01", f"log_dir={tmp_path}/logs", "train_iters=3")
    warning = (f"warning: resuming {checkpoint / 'global_step2'} with weight_decay changed: saved 0.1, this run 0.01"
               f"{WARNING_END}\n")
    assert warning in result.stdout
    assert result.stdout.index(warning) < result.stdout.index("launching ")
