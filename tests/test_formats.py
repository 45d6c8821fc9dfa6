"""megatron/formats/registry.py: every format is recognised by its own reader only, and each reads back the
canonical state (the whole model under TokenFormerModel's names) it was written from."""

from __future__ import annotations

import pytest
import torch

from megatron.config import load_config
from megatron.formats import consolidated, huggingface, official, registry
from megatron.formats.consolidated import write_weights
from megatron.formats.deepspeed import weights as checkpoint
from megatron.formats.deepspeed.files import write_checkpoint
from megatron.formats.huggingface import write_hf_directory
from megatron.formats.official import to_official
from megatron.formats.tensor_parallel import split_dimensions, split_state
from megatron.model import TokenFormerArgs, TokenFormerModel
from tests.conftest import REPO

TINY = REPO / "tests" / "tiny.yml"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One model written in every format: {format module: path}, and its state and config."""
    root = tmp_path_factory.mktemp("formats")
    cfg = load_config([TINY], ["padded_vocab_size=256", "tokenizer_type=CharLevelTokenizer"])
    args = TokenFormerArgs.from_config(cfg)
    state = TokenFormerModel(args).state_dict()
    write_weights(state, cfg, root / "consolidated", safetensors=True)
    torch.save(to_official(state, args.num_layers, args.pattention_tau), root / "pytorch_model.bin")
    (root / "official").mkdir()
    (root / "pytorch_model.bin").rename(root / "official" / "pytorch_model.bin")
    (root / "official" / "config.json").write_text(cfg.to_json(), encoding="utf-8")
    write_hf_directory(state, cfg, root / "hf", max_shard_bytes=10**9)
    tp2 = load_config([TINY], ["padded_vocab_size=256", "model_parallel_size=2"])
    write_checkpoint(split_state(state, split_dimensions(args), 2), tp2, root / "checkpoint")
    paths = {consolidated: root / "consolidated", official: root / "official", huggingface: root / "hf",
             checkpoint: root / "checkpoint"}
    return paths, state, cfg


def test_weights_under_names_of_no_format_are_recognised_by_none(tmp_path):
    from safetensors.torch import save_file

    save_file({"transformer.wte.weight": torch.zeros(4, 4)}, tmp_path / "model.safetensors")
    assert not [fmt.NAME for fmt in registry.FORMATS if fmt.recognises(tmp_path)]
    with pytest.raises(KeyError, match="has no word_embeddings.weight: it is not a TokenFormer state dict"):
        registry.read_state(tmp_path)


@pytest.mark.parametrize("name", ["consolidated", "official", "huggingface", "checkpoint"])
def test_each_format_is_read_back_into_the_canonical_state_by_its_own_reader(saved, name):
    paths, state, cfg = saved
    fmt = next(module for module in paths if module.NAME == name)
    assert [other.NAME for other in registry.FORMATS if other.recognises(paths[fmt])] == [name]
    if name == "huggingface":
        with pytest.raises(ValueError, match="holds no run config: pass config="):
            registry.read_state(paths[fmt])
    read, read_cfg = registry.read_state(paths[fmt], TINY if name == "huggingface" else None)
    assert set(read) == set(state)
    assert all(torch.equal(read[key], state[key].float() if state[key].is_floating_point() else state[key])
               for key in state)
    assert all(getattr(read_cfg, key) == getattr(cfg, key) for key in ("num_layers", "hidden_size", "ffn_slot_num"))
