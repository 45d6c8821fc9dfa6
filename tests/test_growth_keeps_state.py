"""A growth mode applies where something grows: a re-shard with the slot counts unchanged, and weights
loaded as they are (a weights-only warm start, pretrain_partial_init of the same size), keep the weights, the n
of √n, Adam's state, the iteration, the consumed samples and the growth record in every mode; a re-shard that
restarts the iteration restarts any ramp from the n it holds; the grown checkpoint pins its source's digest;
the tool says when the default chose the growth mode, and refuses a slot count that is no count first.

Every config here is tests/tiny.yml without its growth_mode: what users get. The source is written directly
(CheckpointWriter), as training saves one mid-ramp: nothing is trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from megatron.checkpoint.growth_record import read_growth_record
from megatron.checkpoint.manifest import content_digest
from megatron.checkpoint.parameter_state import ParameterState
from megatron.config import load_config
from megatron.formats.deepspeed.files import write_checkpoint
from megatron.formats.deepspeed.reader import open_checkpoint
from megatron.formats.deepspeed.writer import CheckpointWriter
from megatron.growth.norm_ramp import norm_counts, norm_ramp
from megatron.growth.plan import pattention_entry
from megatron.model import TokenFormerArgs, TokenFormerModel
from tests.conftest import REPO
from tests.distributed import run_on_ranks
from tools import grow_checkpoint as grow_tool
from tools.grow_checkpoint import grow_checkpoint

TINY = REPO / "tests" / "tiny.yml"
START = {"qkv_slot_num": 64, "proj_slot_num": 64, "ffn_slot_num": 256}
MID = {"qkv_slot_num": 96, "proj_slot_num": 96, "ffn_slot_num": 384}  # halfway through a ramp of 8 from START
DOUBLED = {"qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512}
VOCAB = 2048  # the demo corpus's tokenizer, padded


def without_growth_mode(directory: Path) -> Path:
    """tests/tiny.yml less its growth_mode line: a config that takes the default."""
    path = directory / "tiny_without_growth_mode.yml"
    path.write_text("".join(line for line in TINY.read_text().splitlines(keepends=True)
                            if not line.startswith("growth_mode")), encoding="utf-8")
    return path


def config_file(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values), encoding="utf-8")
    return path


def overrides(values: dict) -> list[str]:
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]


def mid_ramp_checkpoint(save: Path, base: Path, start: dict[str, int] = START, held: dict[str, int] = MID) -> Path:
    """A checkpoint as a run saves it at iteration 4 of a √n ramp of 8 after a preserve growth from START to DOUBLED:
    n of √n `held`, Adam's moments, 64 consumed samples, a growth record saying the ramp starts at `start`, iteration
    0. Its tag directory."""
    cfg = load_config([base], [f"padded_vocab_size={VOCAB}", "norm_token_count_ramp_iters=8", *overrides(DOUBLED)])
    torch.manual_seed(0)
    state = TokenFormerModel(TokenFormerArgs.from_config(cfg)).state_dict()
    record = {"format": 1, "grown_from": START, "norm_token_count": start, "iteration": 0}
    with CheckpointWriter(save, "global_step4", cfg, iteration=4, consumed_train_samples=64, optimizer_step=4,
                          growth_record=record) as writer:
        for name, tensor in state.items():
            entry = pattention_entry(name)
            if entry and entry[1] == "norm_token_count":
                writer.write(name, ParameterState(torch.tensor(held[entry[0]])))
            else:
                writer.write(name, ParameterState(tensor, torch.rand_like(tensor), torch.rand_like(tensor)))
        return writer.commit()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return without_growth_mode(tmp_path_factory.mktemp("configs"))


@pytest.fixture(scope="module")
def source(base, tmp_path_factory) -> Path:
    return mid_ramp_checkpoint(tmp_path_factory.mktemp("source") / "checkpoints", base)


def held_norms(tag_dir: Path) -> dict[str, int]:
    checkpoint = open_checkpoint(tag_dir)
    return {key: int(checkpoint.state(f"layers.1.{path}.norm_token_count").weight)
            for key, path in (("qkv_slot_num", "attention.key"), ("proj_slot_num", "attention.proj"),
                              ("ffn_slot_num", "mlp"))}


@pytest.mark.parametrize("mode", [None, "official", "preserve"])
def test_a_re_shard_keeps_everything_in_every_mode(base, source, tmp_path, mode):
    """The fix preflight prints for a layout mismatch: the tool with the slot counts unchanged."""
    target = config_file(tmp_path / "target.yml", {**DOUBLED, "padded_vocab_size": VOCAB, "model_parallel_size": 2})
    tag_dir, plan = grow_checkpoint(source.parent, tmp_path / "resharded", [base, target], growth_mode=mode)
    before, after = open_checkpoint(source), open_checkpoint(tag_dir)
    assert (tag_dir.name, after.iteration, after.consumed_train_samples, after.optimizer_step) == (
        "global_step4", 4, 64, 4)
    assert plan.keeps_function and held_norms(tag_dir) == MID
    for name in before.names():
        old, new = before.state(name), after.state(name)
        assert [torch.equal(a, b) for a, b in zip(old.tensors(), new.tensors(), strict=True)] == [True] * len(
            old.tensors()), name
    assert read_growth_record(tag_dir) == {**read_growth_record(source), "source_sha256": content_digest(source)}


def test_a_re_shard_that_restarts_the_iteration_restarts_a_ramp_from_the_n_it_holds(base, source, tmp_path):
    target = config_file(tmp_path / "target.yml", {**DOUBLED, "padded_vocab_size": VOCAB})
    tag_dir, _ = grow_checkpoint(source.parent, tmp_path / "restarted", [base, target], reset_iteration=True)
    record = read_growth_record(tag_dir)
    assert (tag_dir.name, record["iteration"], record["norm_token_count"], held_norms(tag_dir)) == (
        "global_step0", 0, MID, MID)
    ramp = norm_ramp(load_config([base, target], ["norm_token_count_ramp_iters=8"]), record)
    assert {key: ramp.count(key, 0) for key in MID} == MID  # a resume ramps on from what the checkpoint holds


def test_a_growth_pins_its_sources_digest_and_the_tool_says_when_the_default_chose_the_mode(base, source, tmp_path,
                                                                                             capsys):
    larger = config_file(tmp_path / "larger.yml", {**DOUBLED, "ffn_slot_num": 1024, "padded_vocab_size": VOCAB})
    argv = ["--load", str(source.parent), "--config", str(base), str(larger)]
    grown = grow_tool.main([*argv, "--save", str(tmp_path / "default")])
    said = capsys.readouterr().out.splitlines()
    assert said[0] == (
        "growth_mode official, the default (no config file sets growth_mode): new keys and values from the init and "
        "√n of the new token count, as the official code grows (the grown model computes another function); set "
        "growth_mode: preserve for zero new keys and the old √n (docs/growth.md)")
    assert said[1].startswith("grew ") and sum("the default" in line for line in said) == 1
    assert read_growth_record(grown)["source_sha256"] == content_digest(source)
    grow_tool.main([*argv, "--save", str(tmp_path / "flag"), "--growth-mode", "official"])
    grow_tool.main(["--load", str(source.parent), "--config", str(TINY), str(larger), "--save", str(tmp_path / "set")])
    grow_tool.main([*argv[:-1], str(config_file(tmp_path / "same.yml", {**DOUBLED, "padded_vocab_size": VOCAB})),
                    "--save", str(tmp_path / "reshard")])
    assert "the default" not in capsys.readouterr().out


def test_a_slot_count_that_is_no_count_is_refused_first(base, source, tmp_path, capsys):
    target = config_file(tmp_path / "target.yml", {**DOUBLED, "padded_vocab_size": VOCAB})
    with pytest.raises(SystemExit) as refused:
        grow_tool.main(["--load", str(source.parent), "--save", str(tmp_path / "out"), "--config", str(base),
                        str(target), "--ffn-slot-num", "-8"])
    error = capsys.readouterr().err
    assert refused.value.code == 2 and error.count("error:") == 1 and "--allow-shrink" not in error
    assert error.strip().endswith("error: ffn_slot_num -8 is not a parameter-token count: give a positive integer")
    assert not (tmp_path / "out").exists()


# --- weights loaded as they are, in training ---------------------------------------------------------------


def warm_start(values: dict, base: Path) -> dict:
    """One rank: start a Trainer; the n of √n and the weights its model holds."""
    from megatron.training.pretrain import Trainer

    trainer = Trainer(load_config([base], [*overrides(values), "num_gpus=1"], world_size=1))
    module = trainer.engine.module
    result = {"norms": norm_counts(module), "iteration": trainer.state.iteration,
              "weights": {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}}
    trainer.metrics.close()
    return result


@pytest.mark.slow
def test_a_weights_only_warm_start_keeps_the_stored_n_and_weights(base, demo_data, tmp_path):
    """A weights-only checkpoint of a preserve-grown model (as tools/convert_from_hf.py writes one, with its
    norm_token_counts) loaded through `load` or pretrain_partial_init at its own size: the model holds what eval.py
    and generate.py hold for it."""
    cfg = load_config([base], [f"padded_vocab_size={VOCAB}", *overrides(DOUBLED)])
    torch.manual_seed(0)
    state = TokenFormerModel(TokenFormerArgs.from_config(cfg)).state_dict()
    for name in state:
        if (entry := pattention_entry(name)) and entry[1] == "norm_token_count":
            state[name] = torch.tensor(START[entry[0]])
    weights = write_checkpoint([state], cfg, tmp_path / "export").parent
    values = {"data_path": f"{demo_data}/demo_text_document", "vocab_file": f"{demo_data}/tokenizer.json",
              "train_batch_size": 16, "gradient_accumulation_steps": None, "model_parallel_size": 1,
              "pipe_parallel_size": 0, **DOUBLED}
    for how in ({"load": str(weights)}, {"pretrain_partial_init": str(weights), "load": str(tmp_path / "empty")}):
        started = run_on_ranks(1, warm_start, {**values, **how}, base)[0]
        assert (started["norms"], started["iteration"]) == (START, 0), how
        assert [name for name, tensor in state.items() if not torch.equal(started["weights"][name], tensor)] == []
