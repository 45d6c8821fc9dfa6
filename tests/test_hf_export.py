"""tools/convert_to_hf.py and tools/convert_from_hf.py: an exported directory loads with transformers'
AutoModelForCausalLM (trust_remote_code, offline) and computes this framework's logits for every Θ, τ and
architecture variant, a tensor-parallel checkpoint, a grown one (√n of the old count) and the official release
file; its generate() with the KV cache chooses generate.py's tokens; HF -> framework -> HF gives back every
tensor; lm-evaluation-harness's own `hf` backend scores it as eval.py's adapter does."""

from __future__ import annotations

import ast
import importlib.util
import json
import operator
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from megatron.config import load_config
from megatron.formats.consolidated import record_weights, write_weights
from megatron.formats.huggingface import CODE_FILES
from megatron.formats.huggingface import REMOTE_CODE as HF_PACKAGE
from megatron.inference import load_model
from megatron.inference.generation import generate
from megatron.inference.sampling import SamplingParams
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.tokenizer import build_tokenizer
from megatron.tokenizer.fast_conversion import from_sentencepiece
from megatron.tokenizer.train import train_byte_level_bpe, train_sentencepiece
from megatron.training.pretrain import Trainer
from tests.distributed import run_on_ranks
from tests.inference_fixtures import PROBE, TINY
from tests.test_official_checkpoint import RELEASED, VARIANT, VOCAB, official_state_dict, reference_logits, write_config
from tools import convert_from_hf, convert_to_hf
from tools.grow_checkpoint import grow_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread", "offline")
TOLERANCE = 1e-5  # relative to the largest logit
SMALL = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "qkv_slot_num": 16, "proj_slot_num": 16,
         "ffn_slot_num": 48, "seq_length": 128, "rotary_pct": 0.5, "init_method_std": 0.5, "seed": 3,
         "tokenizer_type": "CharLevelTokenizer"}
# Θ, τ and the other architecture keys the exported model must follow. init std 0.5: every token's output
# depends on the tokens before it.
VARIANTS = {
    "l2_norm_gelu-rotary-tied": {"norm_activation_type": "l2_norm_gelu", "pattention_tau": 1.0},
    "gelu_l2_norm-learned-untied-affine-norms-tau": {"norm_activation_type": "gelu_l2_norm", "pos_emb": "learned",
                                                      "no_weight_tying": True, "norm": "layernorm",
                                                      "pattention_tau": 0.6},
    "softmax-full-rotary-tau": {"norm_activation_type": "softmax", "rotary_pct": 1.0, "pattention_tau": 1.7},
}
PADDED_VOCAB = 384  # CharLevelTokenizer: 257 tokens, so rows 257..383 are padding
GROWN_COUNTS = {"query": 9, "key": 11, "value": 16, "proj": 13, "mlp": 40}


@pytest.fixture
def offline(monkeypatch):
    """Nothing here may download: the hub's and datasets' offline modes, whose variables those libraries read
    once, when first imported (possibly by another test module), hence also their constants. datasets comes with
    lm-eval (requirements-eval.txt), which the CPU image leaves out."""
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    if importlib.util.find_spec("datasets") is not None:
        import datasets.config

        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def load_hf(directory: Path):
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, local_files_only=True)


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def write_run_config(directory: Path, values: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "run.yml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(TINY.read_text()), **values}), encoding="utf-8")
    return path


def random_export(directory: Path, variant: dict, grown: bool = False) -> tuple[TokenFormerModel, Path]:
    """A model with random weights, exported as this framework exports (safetensors + config.json); `grown`
    sets each Pattention's norm_token_count below its token count, as preserve growth leaves it."""
    cfg = load_config([write_run_config(directory, {**SMALL, **variant})])
    cfg.padded_vocab_size = PADDED_VOCAB
    model = TokenFormerModel(TokenFormerArgs.for_inference(cfg, PADDED_VOCAB)).eval()
    if grown:
        for layer in model.layers:
            for name, pattention in [(n, getattr(layer.attention, n)) for n in ("query", "key", "value", "proj")] + [
                    ("mlp", layer.mlp)]:
                pattention.norm_token_count.fill_(GROWN_COUNTS[name])
    write_weights(model.state_dict(), cfg, directory / "export", safetensors=True)
    return model, directory / "export"


def hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(directory)(tokens).logits


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_variant_computes_the_frameworks_logits(variant, tmp_path):
    model, export = random_export(tmp_path, variant, grown=True)
    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    config = AutoConfig.from_pretrained(tmp_path / "hf", trust_remote_code=True, local_files_only=True)
    assert (config.model_type, config.vocab_size, config.tokenizer_vocab_size) == ("tokenformer", PADDED_VOCAB, 257)
    assert config.norm_token_counts == [GROWN_COUNTS] * 2 and config.qkv_slot_num == 16
    assert (config.norm_activation_type, config.pattention_tau) == (variant["norm_activation_type"],
                                                                     variant["pattention_tau"])
    assert config.tie_word_embeddings == (not variant.get("no_weight_tying", False))
    tokens = torch.randint(0, 257, (3, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens)
    assert relative_difference(hf_logits(tmp_path / "hf", tokens), expected) <= TOLERANCE


def greedy(hf, prompts: torch.Tensor, tokens: int, **options) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy generate() without stopping at eos (as the framework runs below): the new tokens,
    and the logits of every step [batch, tokens, vocabulary]."""
    out = hf.generate(prompts, max_new_tokens=tokens, do_sample=False, eos_token_id=None, output_logits=True,
                      return_dict_in_generate=True, **options)
    return out.sequences[:, prompts.shape[1]:].tolist(), torch.stack(out.logits, dim=1)


def assert_every_step_is_the_forward_pass(model, prompts: torch.Tensor, new_tokens: list[list[int]],
                                          step_logits: torch.Tensor) -> None:
    """Each step's logits (cached keys and values, positions after the cache) are those of the framework's
    forward pass over the whole sequence: token choices aside, the cache computes the model."""
    with torch.no_grad():
        full = model(torch.cat((prompts, torch.tensor(new_tokens)), dim=1))[:, prompts.shape[1] - 1:-1]
    assert relative_difference(step_logits, full) <= TOLERANCE


def test_kv_cache_generation_matches_the_framework_greedy_sampled_and_beams(tmp_path):
    model, export = random_export(tmp_path, VARIANTS["l2_norm_gelu-rotary-tied"])
    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    hf = load_hf(tmp_path / "hf")
    prompts = torch.randint(0, 257, (2, 7), generator=torch.Generator().manual_seed(4))
    ours = [g.tokens for g in generate(model, prompts, 64, SamplingParams(), vocab_size=257)]
    assert all(len(tokens) == 64 for tokens in ours) and ours[0] != ours[1]
    for use_cache in (True, False):
        tokens, step_logits = greedy(hf, prompts, 64, use_cache=use_cache)
        assert tokens == ours
        assert_every_step_is_the_forward_pass(model, prompts, tokens, step_logits)
    sequence = torch.cat((prompts, torch.tensor(ours)), dim=1)
    with torch.no_grad():  # the cache by hand, as a user's loop drives it: a prompt, then one token at a time
        first = hf(sequence[:, :7], use_cache=True)
        assert isinstance(first.past_key_values, DynamicCache)
        steps = [first.logits] + [hf(sequence[:, i:i + 1], past_key_values=first.past_key_values).logits
                                  for i in range(7, sequence.shape[1])]
        assert relative_difference(torch.cat(steps, dim=1), model(sequence)) <= TOLERANCE

    # A shorter prompt left-padded in a batch (attention_mask, positions) continues as it does alone.
    short = prompts[1, 3:]
    batch = torch.stack((prompts[0], torch.cat((torch.zeros(3, dtype=torch.long), short))))
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    padded, padded_logits = greedy(hf, batch, 20, attention_mask=mask)
    alone, alone_logits = greedy(hf, short[None], 20)
    assert padded[1] == alone[0] and padded[0] == ours[0][:20]
    assert relative_difference(padded_logits[1], alone_logits[0]) <= TOLERANCE

    for options in ({"do_sample": True, "top_k": 40, "top_p": 0.95, "temperature": 0.9}, {"num_beams": 3}):
        runs = []
        for use_cache in (True, False):
            torch.manual_seed(7)
            runs.append(hf.generate(prompts, max_new_tokens=24, eos_token_id=None, use_cache=use_cache, **options))
        assert torch.equal(runs[0], runs[1]) and runs[0].shape == (2, 7 + 24)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["suppress_tokens"] == list(range(257, PADDED_VOCAB))  # padded rows, as generate.py


def learned_position_model_and_left_padded_batch(tmp_path):
    """A learned-position model and its Hugging Face export; two prompts of 9 tokens, the second 5 tokens
    left-padded by 4 (its attention mask 0 there), and that second prompt alone."""
    model, export = random_export(tmp_path, VARIANTS["gelu_l2_norm-learned-untied-affine-norms-tau"])
    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    prompts = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(5))
    short = prompts[1, 4:]
    batch = torch.stack((prompts[0], torch.cat((torch.zeros(4, dtype=torch.long), short))))
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    return model, load_hf(tmp_path / "hf"), batch, mask, short


def test_left_padded_rows_of_a_learned_position_model_compute_as_alone(tmp_path):
    """Positions come from the attention mask: with learned positions, arange would shift a
    left-padded row's positions and change its logits."""
    model, hf, batch, mask, short = learned_position_model_and_left_padded_batch(tmp_path)
    with torch.no_grad():
        assert relative_difference(hf(batch, attention_mask=mask).logits[1, 4:], model(short[None])[0]) <= TOLERANCE
    for use_cache in (True, False):
        padded, padded_logits = greedy(hf, batch, 12, attention_mask=mask, use_cache=use_cache)
        alone, alone_logits = greedy(hf, short[None], 12, use_cache=use_cache)
        assert padded[1] == alone[0]
        assert relative_difference(padded_logits[1], alone_logits[0]) <= TOLERANCE


class HostReads(torch.Tensor):
    """A tensor (and every tensor computed from it) that counts the reads of its values by the host: on a GPU
    each is a device synchronisation. Python's conversions (bool, int, float, an index), .item() and .tolist(),
    a copy to the CPU (.cpu(), .to("cpu")) and NumPy's views (.numpy(), np.asarray)."""

    reads = 0
    READS = (torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
             torch.Tensor.__complex__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
             torch.Tensor.__array__)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        targets = (*args[1:], kwargs.get("device"))
        to_cpu = func is torch.Tensor.to and any(str(target) == "cpu" for target in targets
                                                 if isinstance(target, (str, torch.device)))
        if func in cls.READS or to_cpu:
            HostReads.reads += 1
        return super().__torch_function__(func, types, args, kwargs)


@pytest.mark.parametrize("read", [bool, int, float, operator.index, torch.Tensor.item, torch.Tensor.tolist,
                                  torch.Tensor.cpu, lambda t: t.to("cpu"), lambda t: t.to(device=torch.device("cpu")),
                                  torch.Tensor.numpy, np.asarray],
                         ids=["bool", "int", "float", "index", "item", "tolist", "cpu", "to-cpu", "to-device-cpu",
                              "numpy", "asarray"])
def test_host_reads_counts_every_way_the_host_reads_a_value(read):
    """Every way of reading a value counts (int(), float(), .cpu(), .numpy() among them), so a test bounding the
    reads can fail for any of them. Computing on the tensor is no read."""
    value = torch.ones((), dtype=torch.long).as_subclass(HostReads)
    HostReads.reads = 0
    (value * 2 + 1).sum()
    assert HostReads.reads == 0
    read(value * 2)
    assert HostReads.reads == 1


def test_the_mask_is_read_by_the_host_once_per_forward_not_once_per_layer(tmp_path):
    """Whether the mask pads is read once per forward, not in every layer for every generated token: on a GPU each
    read is a synchronisation."""
    _, export = random_export(tmp_path, VARIANTS["l2_norm_gelu-rotary-tied"])
    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    hf = load_hf(tmp_path / "hf")
    assert hf.config.num_hidden_layers == 2
    tokens = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(tokens)
    mask[1, :3] = 0
    with torch.no_grad():
        HostReads.reads = 0
        prompt = hf(tokens, attention_mask=mask.as_subclass(HostReads), use_cache=True)
        assert HostReads.reads <= 1
        HostReads.reads = 0
        step_mask = torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), dim=1)
        hf(tokens[:, -1:], attention_mask=step_mask.as_subclass(HostReads), past_key_values=prompt.past_key_values)
        assert HostReads.reads <= 1


def test_a_4d_mask_needs_position_ids_and_computes_as_the_2d_mask_with_them(tmp_path):
    """Positions cannot be read from a 4-D mask (it says which keys each query sees), and arange positions would give
    a left-padded row of a learned-position model other logits than alone: such a mask is refused without
    position_ids, and with them computes what the 2-D mask does."""
    model, hf, batch, mask, short = learned_position_model_and_left_padded_batch(tmp_path)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    mask_4d = (causal & mask[:, None, None, :].bool()) | torch.eye(9, dtype=torch.bool)  # padded rows: themselves
    with torch.no_grad(), pytest.raises(ValueError, match=r"a 4-D attention_mask \[batch, 1, queries, keys\] says "
                                                         r"which keys each query sees, not where each token is: "
                                                         r"pass position_ids with it"):
        hf(batch, attention_mask=mask_4d)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = hf(batch, attention_mask=mask_4d, position_ids=positions).logits
        assert relative_difference(logits[1, 4:], model(short[None])[0]) <= TOLERANCE
        assert relative_difference(logits, hf(batch, attention_mask=mask).logits) <= TOLERANCE


TOKENIZER_TEXTS = ["The quick brown fox jumps over the lazy dog.", "  two  spaces,\ttabs\nand lines\n\n",
                   "Ünïcödé ✓, Ελληνικά and emoji 🙂", "def add(a, b):\n    return a + b  # 42\n", "3.14159 in 2026"]


@pytest.fixture(scope="module")
def tokenizer_runs(tmp_path_factory) -> dict[str, dict]:
    """Config keys of runs whose tokenizers are GPT-2 BPE files and SentencePiece models (unigram, BPE), each
    trained here on the texts above, small enough for the test model's 384 embedding rows."""
    directory = tmp_path_factory.mktemp("tokenizers")
    documents = TOKENIZER_TEXTS * 20
    train_byte_level_bpe(documents, 300, str(directory / "bpe.json"))
    vocab, merges = Tokenizer.from_file(str(directory / "bpe.json")).model.save(str(directory))
    runs = {"GPT2BPETokenizer": {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges}}
    for model_type in ("unigram", "bpe"):
        path = directory / f"spm_{model_type}.model"
        train_sentencepiece(documents, 320, model_type, str(path))
        runs[f"SPMTokenizer-{model_type}"] = {"tokenizer_type": "SPMTokenizer", "vocab_file": str(path)}
    return runs


def test_a_tokenizer_named_relative_to_the_runs_directory_is_found_from_elsewhere(tmp_path, monkeypatch, capsys):
    """A run's config names vocab_file relative to where it started; exporting from another directory finds it
    above the checkpoint, or fails naming it, rather than skipping the tokenizer."""
    run_dir = tmp_path / "run"
    (run_dir / "data").mkdir(parents=True)
    train_byte_level_bpe(TOKENIZER_TEXTS * 20, 300, str(run_dir / "data" / "tokenizer.json"))
    random_export(run_dir, {"tokenizer_type": "HFTokenizer", "vocab_file": "data/tokenizer.json"})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    convert_to_hf.main([str(run_dir / "export"), str(tmp_path / "hf")])
    assert f"tokenizer: HFTokenizer {run_dir / 'data' / 'tokenizer.json'} (copied" in capsys.readouterr().out
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (run_dir / "data" / "tokenizer.json").read_bytes()
    (run_dir / "data" / "tokenizer.json").rename(tmp_path / "moved.json")
    with pytest.raises(SystemExit) as exit_:
        convert_to_hf.main([str(run_dir / "export"), str(tmp_path / "hf2")])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and "the checkpoint's vocab_file 'data/tokenizer.json' is relative to the " in error
    assert "run this from the run's directory" in error and not (tmp_path / "hf2").exists()


@pytest.mark.parametrize("kind", ["GPT2BPETokenizer", "SPMTokenizer-unigram", "SPMTokenizer-bpe"])
def test_gpt2_bpe_and_sentencepiece_runs_export_a_tokenizer_encoding_as_theirs(kind, tokenizer_runs, tmp_path, capsys):
    settings = tokenizer_runs[kind]
    _, export = random_export(tmp_path, {**VARIANTS["l2_norm_gelu-rotary-tied"], **settings})
    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    assert "converted to tokenizer.json" in capsys.readouterr().out
    ours = build_tokenizer(settings["tokenizer_type"], settings["vocab_file"], settings.get("merge_file"))
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True, local_files_only=True)
    assert theirs.eos_token_id == ours.eod and theirs.pad_token_id == ours.pad
    for text in [*TOKENIZER_TEXTS, "unseen: ß∂ƒ, русский, 日本語 🚀\n"]:
        ids = ours.tokenize(text)
        assert theirs(text)["input_ids"] == ids
        assert theirs.decode(ids) == ours.detokenize(ids)


def test_a_converted_tokenizer_that_encodes_otherwise_is_not_written(tokenizer_runs, tmp_path, capsys, monkeypatch):
    """The check, not the converter, decides: a unigram run given the BPE model's conversion writes no tokenizer
    and says where the two differ."""
    import megatron.formats.huggingface as export_module

    other = tokenizer_runs["SPMTokenizer-bpe"]["vocab_file"]
    monkeypatch.setattr(export_module, "fast_tokenizer", lambda tokenizer: from_sentencepiece(other))
    _, export = random_export(tmp_path, {**VARIANTS["l2_norm_gelu-rotary-tied"],
                                         **tokenizer_runs["SPMTokenizer-unigram"]})
    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    output = capsys.readouterr().out
    assert "no tokenizer files written: encoding" in output and "differs at token" in output
    assert not (tmp_path / "hf" / "tokenizer.json").exists() and (tmp_path / "hf" / "config.json").is_file()


@pytest.mark.parametrize("architecture", [RELEASED, VARIANT], ids=["released", "untied-learned-gelu_l2_norm"])
def test_the_official_release_file_converts_in_one_command(architecture, tmp_path, capsys):
    cfg = write_config(tmp_path, architecture)
    official = official_state_dict(cfg)
    torch.save(official, tmp_path / "pytorch_model.bin")
    convert_to_hf.main([str(tmp_path / "pytorch_model.bin"), str(tmp_path / "hf"), "--config",
                        str(tmp_path / "official.yml")])
    assert "no tokenizer written" in capsys.readouterr().out  # 257 byte tokens do not fit 128 rows
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    logits = hf_logits(tmp_path / "hf", tokens)
    with torch.no_grad():
        ours = load_model(tmp_path / "pytorch_model.bin", config=tmp_path / "official.yml")(tokens)
    assert relative_difference(logits, ours) <= TOLERANCE
    torch.testing.assert_close(logits.double(), reference_logits(official, cfg, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["l2_norm_gelu-rotary-tied", "gelu_l2_norm-learned-untied-affine-norms-tau"])
def test_hf_to_framework_to_hf_gives_back_every_tensor(variant, tmp_path):
    model, export = random_export(tmp_path, VARIANTS[variant], grown=True)
    convert_to_hf.main([str(export), str(tmp_path / "exported")])
    # One fine-tuning step with transformers (its loss is the framework's; activation checkpointing on), saved by
    # it: its own config.json and weights, in 40 kB shards.
    hf = load_hf(tmp_path / "exported").train()
    hf.activation_checkpointing_enable()
    tokens = torch.randint(0, 257, (2, 60), generator=torch.Generator().manual_seed(2))
    loss = hf(tokens, labels=tokens).loss
    with torch.no_grad():
        expected = F.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    torch.optim.SGD(hf.parameters(), lr=0.1).step()
    hf.eval().save_pretrained(tmp_path / "finetuned", max_shard_size="40KB")
    saved = json.loads((tmp_path / "finetuned" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(saved.values())) > 1

    convert_from_hf.main([str(tmp_path / "finetuned"), str(tmp_path / "checkpoint"), "--config",
                          str(tmp_path / "run.yml"), "--model-parallel-size", "2"])
    assert len(list((tmp_path / "checkpoint" / "global_step0").glob("mp_rank_*_model_states.pt"))) == 2
    with torch.no_grad():
        finetuned = hf(tokens).logits
        assert relative_difference(finetuned, model(tokens)) > 1e-3  # the step changed the model
        assert relative_difference(load_model(tmp_path / "checkpoint")(tokens), finetuned) <= TOLERANCE

    convert_to_hf.main([str(tmp_path / "checkpoint"), str(tmp_path / "back"), "--max-shard-size", "30KB"])
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    before = {name: tensor for shard in set(saved.values()) for name, tensor in
              load_file(tmp_path / "finetuned" / shard).items()}
    after = {name: tensor for shard in set(index["weight_map"].values()) for name, tensor in
             load_file(tmp_path / "back" / shard).items()}
    assert before.keys() == after.keys() == set(index["weight_map"])
    assert all(after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]) for name in before)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["norm_token_counts"] == [GROWN_COUNTS] * 2

    # The converted checkpoint grows with the grow tool (preserve: the same function) and trains from there.
    target = write_run_config(tmp_path / "target", {**SMALL, **VARIANTS[variant], "qkv_slot_num": 32,
                                                    "proj_slot_num": 32, "ffn_slot_num": 96})
    grown_dir = grow_checkpoint(tmp_path / "checkpoint", tmp_path / "grown", [target])[0]
    with torch.no_grad():
        assert relative_difference(load_model(grown_dir)(tokens), finetuned) <= TOLERANCE


def test_a_fine_tune_saved_into_the_exported_directory_converts_and_bit_rot_is_still_refused(tmp_path, capsys):
    """save_pretrained into the directory convert_to_hf.py wrote left its manifest.json stale, and the fine-tune
    was refused as corrupted ("export the weights again": advice that throws it away). A file newer than the
    manifest is now read, and the stale manifest said; a changed file that is not newer is corruption."""
    _, export = random_export(tmp_path, VARIANTS["l2_norm_gelu-rotary-tied"])
    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    hf = load_hf(tmp_path / "hf")
    with torch.no_grad():
        hf.model.word_embeddings.weight.mul_(1.5)  # the fine-tune
    hf.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "checkpoint"), "--config", str(tmp_path / "run.yml")])
    assert capsys.readouterr().err == (
        f"warning: {tmp_path}/hf/model.safetensors was written after {tmp_path}/hf/manifest.json (by another tool, "
        "e.g. transformers' save_pretrained), so the manifest is stale: the file is read unverified\n")
    tokens = torch.randint(0, 257, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert relative_difference(load_model(tmp_path / "checkpoint")(tokens), hf(tokens).logits) <= TOLERANCE

    weights = tmp_path / "hf" / "model.safetensors"
    record_weights(tmp_path / "hf", [weights])  # the manifest made current; then bit rot, which keeps the time
    written = weights.stat()
    content = bytearray(weights.read_bytes())
    content[-4:] = bytes(byte ^ 0xFF for byte in content[-4:])
    weights.write_bytes(bytes(content))
    os.utime(weights, ns=(written.st_atime_ns, written.st_mtime_ns))
    with pytest.raises(SystemExit) as exit_:
        convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "again"), "--config", str(tmp_path / "run.yml")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"{tmp_path}/hf/model.safetensors does not match its SHA-256 in the manifest (corrupted): it changed since "
        "manifest.json was written without being rewritten (it is not newer); export the weights again\n")


def test_the_copied_model_files_import_only_torch_and_transformers(tmp_path):
    _, export = random_export(tmp_path, VARIANTS["l2_norm_gelu-rotary-tied"])
    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    for name in CODE_FILES:
        source = (HF_PACKAGE / name).read_text()
        assert (tmp_path / "hf" / name).read_text() == source
        imported = {alias.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module for node in ast.walk(ast.parse(source))
                     if isinstance(node, ast.ImportFrom) and not node.level}
        assert {module.split(".")[0] for module in imported} <= {"__future__", "math", "torch", "transformers"}, name


def test_errors_are_one_line_with_exit_status_2(tmp_path, capsys):
    _, export = random_export(tmp_path, VARIANTS["l2_norm_gelu-rotary-tied"])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("")
    for argv, message in [([str(export), str(tmp_path / "taken")], "OUTPUT_DIR .*taken exists and is not empty"),
                          ([str(tmp_path / "missing"), str(tmp_path / "out")], "missing does not exist"),
                          ([str(export), str(tmp_path / "out"), "--max-shard-size", "lots"], "is not a size")]:
        with pytest.raises(SystemExit) as exit_:
            convert_to_hf.main(argv)
        error = capsys.readouterr().err
        assert exit_.value.code == 2 and error.count("\n") == 1, error
        assert re.search(message, error), error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "run.yml", "taken"]  # nothing half-written

    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    other = write_run_config(tmp_path / "other", {**SMALL, "hidden_size": 64, "norm_activation_type": "softmax"})
    with pytest.raises(SystemExit) as exit_:
        convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "checkpoint"), "--config", str(other)])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and error.count("\n") == 1
    assert "hidden_size 64 (config.json: hidden_size=32)" in error and "Set those keys" in error
    assert "norm_activation_type 'softmax' (config.json: norm_activation_type='l2_norm_gelu')" in error
    assert not (tmp_path / "checkpoint").exists()

    (tmp_path / "hf" / "config.json").write_text("{'model_type': tokenformer")  # not JSON
    with pytest.raises(SystemExit) as exit_:
        convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "checkpoint"), "--config", str(other)])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and error.count("\n") == 1
    assert f"{tmp_path / 'hf' / 'config.json'} is not JSON (" in error


# --- checkpoints trained here (2 tensor-parallel ranks), grown, and scored by lm-eval ----------------------

@pytest.mark.slow
def test_tensor_parallel_checkpoint_exports_with_its_logits_tokenizer_and_generation(tensor_parallel_checkpoint,
                                                                                   tmp_path):
    # max_position_embeddings 128, so that 64 tokens follow a prompt (rotary positions: a limit, not a weight)
    (tmp_path / "run.json").write_text(tensor_parallel_checkpoint.config("max_position_embeddings=128").to_json())
    directory = tmp_path / "hf"
    convert_to_hf.main([str(tensor_parallel_checkpoint.save), str(directory), "--config", str(tmp_path / "run.json")])
    ours = load_model(tensor_parallel_checkpoint.save, config=tmp_path / "run.json")
    hf = load_hf(directory)
    with torch.no_grad():
        assert relative_difference(hf(PROBE).logits, ours(PROBE)) <= TOLERANCE
    assert relative_difference(hf_logits(directory, PROBE), tensor_parallel_checkpoint.logits) <= TOLERANCE

    cfg = tensor_parallel_checkpoint.config()
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file)
    hf_tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True, local_files_only=True)
    assert hf_tokenizer.eos_token_id == hf.generation_config.eos_token_id == tokenizer.eod
    for text in ("def main():\n    return 1\n", "import os", "The value is None."):
        assert hf_tokenizer(text)["input_ids"] == tokenizer.tokenize(text)

    prompt = torch.tensor([tokenizer.tokenize("def main():\n    return")])
    [expected] = generate(ours, prompt, 64, SamplingParams(), vocab_size=tokenizer.vocab_size)
    assert len(expected.tokens) == 64
    for use_cache in (True, False):
        tokens, step_logits = greedy(hf, prompt, 64, use_cache=use_cache)
        assert tokens == [expected.tokens]
        assert_every_step_is_the_forward_pass(ours, prompt, tokens, step_logits)


@pytest.mark.slow
def test_grown_checkpoint_keeps_the_old_norm_token_counts(tensor_parallel_checkpoint, tmp_path):
    values = {key: yaml.safe_load(value)
              for key, value in (override.split("=", 1) for override in tensor_parallel_checkpoint.overrides)}
    target = tmp_path / "target.yml"
    target.write_text(yaml.safe_dump({**values, "qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512,
                                      "model_parallel_size": 1, "growth_mode": "preserve"}))
    grown = grow_checkpoint(tensor_parallel_checkpoint.save, tmp_path / "grown", [TINY, target])[0]
    convert_to_hf.main([str(grown.parent), str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["ffn_slot_num"] == 512
    assert config["norm_token_counts"] == [{"query": 64, "key": 64, "value": 64, "proj": 64, "mlp": 256}] * 2
    with torch.no_grad():
        expected = load_model(grown)(PROBE)
    logits = hf_logits(tmp_path / "hf", PROBE)
    assert relative_difference(logits, expected) <= TOLERANCE
    assert relative_difference(logits, tensor_parallel_checkpoint.logits) <= TOLERANCE  # growth kept the function


def _train_from_checkpoint(values: dict) -> tuple[int, int, float]:
    """One rank: a run of tests/tiny.yml with `values` (its `load` the checkpoint); (the iteration it starts at, the
    one it ends at, its first training loss)."""
    trainer = Trainer(load_config([TINY], [f"{key}={json.dumps(value)}" for key, value in values.items()],
                                  world_size=1))
    start = trainer.state.iteration
    trainer.train()
    trainer.metrics.close()
    first_loss = json.loads((Path(values["log_dir"]) / "metrics.jsonl").read_text().splitlines()[0])["lm_loss"]
    return start, trainer.state.iteration, first_loss


@pytest.mark.slow
def test_a_model_fine_tuned_with_transformers_grows_and_trains_here(tensor_parallel_checkpoint, tmp_path):
    convert_to_hf.main([str(tensor_parallel_checkpoint.save), str(tmp_path / "hf")])
    hf = load_hf(tmp_path / "hf").train()
    hf(PROBE, labels=PROBE).loss.backward()
    torch.optim.SGD(hf.parameters(), lr=0.5).step()
    hf.eval().save_pretrained(tmp_path / "finetuned")
    values = {key: yaml.safe_load(value)
              for key, value in (override.split("=", 1) for override in tensor_parallel_checkpoint.overrides)}
    run = tmp_path / "run.yml"
    run.write_text(yaml.safe_dump(values))
    convert_from_hf.main([str(tmp_path / "finetuned"), str(tmp_path / "checkpoint"), "--config", str(TINY), str(run),
                          "--model-parallel-size", "2"])
    target = tmp_path / "target.yml"
    target.write_text(yaml.safe_dump({**values, "qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512,
                                      "model_parallel_size": 1}))
    grown = grow_checkpoint(tmp_path / "checkpoint", tmp_path / "grown", [TINY, target])[0]
    with torch.no_grad():
        finetuned = hf(PROBE).logits
        assert relative_difference(finetuned, tensor_parallel_checkpoint.logits) > 1e-3  # the step changed it
        assert relative_difference(load_model(grown)(PROBE), finetuned) <= TOLERANCE

    training = {**values, "qkv_slot_num": 128, "proj_slot_num": 128, "ffn_slot_num": 512, "model_parallel_size": 1,
                "num_gpus": 1, "load": str(grown.parent), "save": str(tmp_path / "trained"),
                "log_dir": str(tmp_path / "logs"), "train_iters": 2, "lr_decay_iters": 2}
    start, end, first_loss = run_on_ranks(1, _train_from_checkpoint, training)[0]
    assert (start, end) == (0, 2) and 0 < first_loss < 10  # ln(2048) = 7.6: the fine-tuned model, not NaN
    assert (tmp_path / "trained" / "latest").read_text().strip() == "global_step2"


@pytest.mark.slow
def test_lm_eval_hf_backend_agrees_with_the_frameworks_adapter(tensor_parallel_checkpoint, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from megatron.inference.lm_eval_adapter import TokenFormerLM
    from tests.test_lm_eval_adapter import TASKS, write_local_tasks

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    write_local_tasks(tmp_path)
    convert_to_hf.main([str(tensor_parallel_checkpoint.save), str(tmp_path / "hf")])
    cfg = tensor_parallel_checkpoint.config()
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file)

    def evaluate(model, **options) -> dict:
        tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
        return lm_eval.simple_evaluate(
            model=model, tasks=list(TASKS), task_manager=tasks, log_samples=True, random_seed=0, numpy_random_seed=0,
            torch_random_seed=0, **options)

    def answers(evaluation: dict, task: str) -> list:
        """Each document's responses (log-likelihoods and greedy flags, rolling sums, generated text)."""
        return [sample["filtered_resps"] for sample in sorted(evaluation["samples"][task], key=lambda s: s["doc_id"])]

    ours = evaluate(TokenFormerLM(load_model(tensor_parallel_checkpoint.save), tokenizer, batch_size=2))
    theirs = evaluate("hf", model_args=f"pretrained={tmp_path / 'hf'},trust_remote_code=True,dtype=float32,"
                      "backend=causal", batch_size=2, device="cpu")
    choices, hf_choices = ([choice for doc in answers(run, "local_choice") for choice in doc] for run in (ours, theirs))
    assert [is_greedy for _, is_greedy in hf_choices] == [is_greedy for _, is_greedy in choices]
    assert [score for score, _ in hf_choices] == pytest.approx([score for score, _ in choices], rel=1e-5)
    rolling, hf_rolling = ([total for [total] in answers(run, "local_rolling")] for run in (ours, theirs))
    assert hf_rolling == pytest.approx(rolling, rel=1e-5)
    assert answers(theirs, "local_generation") == answers(ours, "local_generation")
    assert any(text for [text] in answers(ours, "local_generation"))  # something was generated
    for task, metric in (("local_choice", "acc,none"), ("local_rolling", "bits_per_byte,none"),
                         ("local_generation", "exact_match,none")):
        assert theirs["results"][task][metric] == pytest.approx(ours["results"][task][metric], rel=1e-5)


@pytest.mark.slow
def test_a_converted_checkpoint_loads_directly_into_another_layout(tensor_parallel_checkpoint, tmp_path):
    """tools/convert_from_hf.py's output (weights only, 2 tensor ranks) given as `load` to runs of other layouts (1
    tensor rank with the pipeline engine; 2 data-parallel ranks with ZeRO) is loaded, said so, scores as the
    original and trains, rather than failing inside the ranks (it has no DeepSpeed layout)."""
    from tests.conftest import run_deepy

    convert_to_hf.main([str(tensor_parallel_checkpoint.save), str(tmp_path / "hf")])
    values = dict(override.split("=", 1) for override in tensor_parallel_checkpoint.overrides)
    run = tmp_path / "run.yml"
    run.write_text(yaml.safe_dump({key: yaml.safe_load(value) for key, value in values.items()}))
    convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "converted"), "--config", str(TINY), str(run)])
    data = [f"data_path={values['data_path']}", f"vocab_file={values['vocab_file']}", "eval_iters=2",
            "eval_only=true", f"log_dir={tmp_path}/logs"]
    original = run_deepy("train.py", str(TINY), *data, f"load={tensor_parallel_checkpoint.save}",
                         "model_parallel_size=2")
    converted = run_deepy("train.py", str(TINY), *data, f"load={tmp_path / 'converted'}", "pipe_parallel_size=1",
                          "model_parallel_size=1", "num_gpus=1")  # data-parallel size 1 as there: the same batches
    assert (f"loaded the weights of {tmp_path / 'converted' / 'global_step0'} (it holds no optimizer state or "
            "iteration: a warm start at iteration 0)") in converted.stdout
    assert "older version" not in converted.stderr

    def validation_loss(result) -> float:
        return float(re.search(r"validation at iteration \d+ \| lm_loss (\S+)", result.stdout)[1])

    assert abs(validation_loss(converted) - validation_loss(original)) < 1e-4
    trained = run_deepy("train.py", str(TINY), *data[:2], f"load={tmp_path / 'converted'}", "train_iters=2",
                        f"save={tmp_path / 'trained'}", f"log_dir={tmp_path}/trained-logs", "eval_iters=0")
    assert (tmp_path / "trained" / "latest").read_text().strip() == "global_step2"
    assert "loaded the weights of" in trained.stdout


DENSE = {"model_type": "transformer", "qkv_slot_num": None, "proj_slot_num": None, "ffn_slot_num": None}


@pytest.mark.parametrize("variant", [{"rotary_pct": 0.25}, {"no_weight_tying": True, "norm": "layernorm"}],
                         ids=["quarter-rotary-tied", "untied-affine-norms"])
def test_a_dense_model_exports_as_gpt_neox_with_the_frameworks_logits_and_generation(variant, tmp_path):
    """The dense baseline loads as transformers' own GPTNeoXForCausalLM (no remote code, no code files written)
    and computes the framework's logits; its KV-cache generation follows the framework's forward pass."""
    model, export = random_export(tmp_path, {**DENSE, **variant})
    convert_to_hf.main([str(export), str(tmp_path / "hf")])
    assert not any((tmp_path / "hf" / name).exists() for name in CODE_FILES)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("gpt_neox", ["GPTNeoXForCausalLM"])
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    assert type(hf).__name__ == "GPTNeoXForCausalLM"
    tokens = torch.randint(0, 257, (3, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(tokens)
        assert relative_difference(hf(tokens).logits, expected) <= TOLERANCE
    new_tokens, step_logits = greedy(hf, tokens[:, :20], 8)
    assert_every_step_is_the_forward_pass(model, tokens[:, :20], new_tokens, step_logits)


def test_a_dense_model_with_learned_positions_is_refused_before_anything_is_written(tmp_path, capsys):
    _, export = random_export(tmp_path, {**DENSE, "pos_emb": "learned"})
    with pytest.raises(SystemExit) as exit_info:
        convert_to_hf.main([str(export), str(tmp_path / "hf")])
    assert exit_info.value.code == 2 and not (tmp_path / "hf").exists()
    assert "pos_emb='learned'" in capsys.readouterr().err
