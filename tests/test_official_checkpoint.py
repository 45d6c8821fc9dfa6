"""tools/convert_official_checkpoint.py on a synthetic state dict in the official release's key layout: the
import (at 1 and 2 tensor-parallel ranks) computes the official architecture's logits, written out here from
the formulas, and the export gives back every tensor exactly."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
import yaml

from megatron.inference import load_model
from tests.inference_fixtures import TINY
from tools import convert_official_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, LAYERS, HIDDEN, HEADS = 128, 2, 32, 4
RELEASED = dict(pos_emb="rotary", rotary_pct=0.25, norm_activation_type="l2_norm_gelu", no_weight_tying=False)
VARIANT = dict(pos_emb="learned", rotary_pct=1.0, norm_activation_type="gelu_l2_norm", no_weight_tying=True)


def write_config(directory, architecture: dict) -> dict:
    values = yaml.safe_load(TINY.read_text())
    values.update(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, qkv_slot_num=16,
                  proj_slot_num=24, ffn_slot_num=48, seq_length=32, norm="layernorm_nonparam", final_norm="layernorm",
                  tokenizer_type="CharLevelTokenizer", **architecture)
    (directory / "official.yml").write_text(yaml.safe_dump(values))
    return values


def official_state_dict(cfg: dict) -> dict[str, torch.Tensor]:
    """Random weights under the official keys (sequential.N.<name>), as the release stores them."""
    generator = torch.Generator().manual_seed(0)

    def normal(*shape, std=0.3):
        return torch.randn(*shape, generator=generator) * std

    state = {"sequential.0.word_embeddings.weight": normal(VOCAB, HIDDEN, std=1.0)}
    if cfg["pos_emb"] == "learned":
        state["sequential.0.position_embeddings.weight"] = normal(cfg["seq_length"], HIDDEN)
    for i in range(LAYERS):
        slots = {"query": cfg["qkv_slot_num"], "key": cfg["qkv_slot_num"], "value": cfg["qkv_slot_num"],
                 "proj": cfg["proj_slot_num"]}
        for name, tokens in slots.items():
            state[f"sequential.{i + 2}.attention.{name}.key_param_tokens"] = normal(tokens, HIDDEN)
            state[f"sequential.{i + 2}.attention.{name}.value_param_tokens"] = normal(tokens, HIDDEN)
        state[f"sequential.{i + 2}.mlp.key_param_tokens"] = normal(cfg["ffn_slot_num"], HIDDEN)
        state[f"sequential.{i + 2}.mlp.value_param_tokens"] = normal(cfg["ffn_slot_num"], HIDDEN)
    state[f"sequential.{LAYERS + 3}.norm.weight"] = 1 + normal(HIDDEN, std=0.1)
    state[f"sequential.{LAYERS + 3}.norm.bias"] = normal(HIDDEN, std=0.1)
    if cfg["no_weight_tying"]:
        state[f"sequential.{LAYERS + 4}.final_linear.weight"] = normal(VOCAB, HIDDEN, std=1.0)
    return state


def reference_logits(state: dict[str, torch.Tensor], cfg: dict, tokens: torch.Tensor) -> torch.Tensor:
    """The official TokenFormer's forward pass from its formulas, in float64."""
    w = {key: value.double() for key, value in state.items()}
    head_dim = HIDDEN // HEADS
    seq = tokens.shape[1]

    def theta(scores):  # τ = 1, n = the layer's token count
        n = scores.shape[-1]
        if cfg["norm_activation_type"] == "l2_norm_gelu":
            return F.gelu(scores / scores.norm(dim=-1, keepdim=True) * math.sqrt(n))
        activated = F.gelu(scores)
        return activated / activated.norm(dim=-1, keepdim=True) * math.sqrt(n)

    def pattention(x, prefix):
        return theta(x @ w[prefix + "key_param_tokens"].T) @ w[prefix + "value_param_tokens"]

    def layer_norm(x):
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)

    def rotary(x):  # GPT-NeoX rotate-half on the first rotary_pct of each head
        dims = int(head_dim * cfg["rotary_pct"])
        inverse_frequencies = 1.0 / 10000 ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
        angles = torch.arange(seq, dtype=torch.float64)[:, None] * inverse_frequencies[None]
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        rotated, passed = x[..., :dims], x[..., dims:]
        first, second = rotated[..., :dims // 2], rotated[..., dims // 2:]
        return torch.cat((rotated * cos + torch.cat((-second, first), -1) * sin, passed), -1)

    h = w["sequential.0.word_embeddings.weight"][tokens]
    if cfg["pos_emb"] == "learned":
        h = h + w["sequential.0.position_embeddings.weight"][:seq]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    for i in range(LAYERS):
        prefix = f"sequential.{i + 2}."
        x = layer_norm(h)
        q, k, v = (pattention(x, f"{prefix}attention.{n}.").view(*tokens.shape, HEADS, head_dim).transpose(1, 2)
                   for n in ("query", "key", "value"))
        if cfg["pos_emb"] == "rotary":
            q, k = rotary(q), rotary(k)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(~causal, float("-inf"))
        context = (scores.softmax(-1) @ v).transpose(1, 2).reshape(*tokens.shape, HIDDEN)
        h = h + pattention(context, f"{prefix}attention.proj.")
        h = h + pattention(layer_norm(h), f"{prefix}mlp.")
    h = layer_norm(h) * w[f"sequential.{LAYERS + 3}.norm.weight"] + w[f"sequential.{LAYERS + 3}.norm.bias"]
    tied = not cfg["no_weight_tying"]
    return h @ w["sequential.0.word_embeddings.weight" if tied else f"sequential.{LAYERS + 4}.final_linear.weight"].T


@pytest.mark.parametrize("architecture", [RELEASED, VARIANT], ids=["released", "untied-learned-gelu_l2_norm"])
def test_import_reproduces_the_official_logits_and_export_gives_back_every_tensor(architecture, tmp_path):
    cfg = write_config(tmp_path, architecture)
    official = official_state_dict(cfg)
    torch.save(official, tmp_path / "pytorch_model.bin")
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))

    imports = {}
    for ranks in (1, 2):
        convert_official_checkpoint.main(["--input", str(tmp_path / "pytorch_model.bin"), "--config",
                                          str(tmp_path / "official.yml"), "--save", str(tmp_path / f"tp{ranks}"),
                                          "--model-parallel-size", str(ranks)])
        assert len(list((tmp_path / f"tp{ranks}" / "global_step0").glob("mp_rank_*_model_states.pt"))) == ranks
        imports[ranks] = load_model(tmp_path / f"tp{ranks}")(tokens)
    torch.testing.assert_close(imports[1].double(), reference_logits(official, cfg, tokens), rtol=1e-4, atol=1e-4)
    assert torch.equal(imports[2], imports[1])
    direct = load_model(tmp_path / "pytorch_model.bin", config=tmp_path / "official.yml")(tokens)
    assert torch.equal(direct, imports[1])

    convert_official_checkpoint.main(["--export", "--input", str(tmp_path / "tp2"), "--save",
                                      str(tmp_path / "exported" / "pytorch_model.bin")])
    exported = torch.load(tmp_path / "exported" / "pytorch_model.bin", weights_only=True)
    assert exported.keys() == official.keys()
    assert all(torch.equal(exported[key], official[key]) for key in official)


def test_fp16_release_weights_are_kept_exactly(tmp_path):
    cfg = write_config(tmp_path, RELEASED)
    official = {key: value.half() for key, value in official_state_dict(cfg).items()}
    torch.save(official, tmp_path / "pytorch_model.bin")
    convert_official_checkpoint.main(["--input", str(tmp_path / "pytorch_model.bin"), "--config",
                                      str(tmp_path / "official.yml"), "--save", str(tmp_path / "imported")])
    convert_official_checkpoint.main(["--export", "--input", str(tmp_path / "imported"), "--save",
                                      str(tmp_path / "back.bin")])
    exported = torch.load(tmp_path / "back.bin", weights_only=True)
    assert all(exported[key].dtype == torch.float32 and torch.equal(exported[key], official[key].float())
               for key in official)


def test_saved_rotary_frequencies_are_checked_and_dropped(tmp_path):
    cfg = write_config(tmp_path, RELEASED)
    official = official_state_dict(cfg)
    frequencies = 1.0 / 10000 ** (torch.arange(0, 2, 2, dtype=torch.float32) / 2)
    official["sequential.2.attention.rotary_emb.inv_freq"] = frequencies
    torch.save(official, tmp_path / "with_frequencies.bin")
    assert load_model(tmp_path / "with_frequencies.bin", config=tmp_path / "official.yml") is not None
    official["sequential.2.attention.rotary_emb.inv_freq"] = frequencies * 2
    torch.save(official, tmp_path / "wrong_frequencies.bin")
    with pytest.raises(ValueError, match="rotary_emb.inv_freq does not match rotary_pct=0.25"):
        load_model(tmp_path / "wrong_frequencies.bin", config=tmp_path / "official.yml")


def refusal(capsys, argv: list[str]) -> str:
    """convert_official_checkpoint's one-line error for `argv` (exit status 2)."""
    with pytest.raises(SystemExit) as exited:
        convert_official_checkpoint.main(argv)
    [line] = capsys.readouterr().err.splitlines()
    assert exited.value.code == 2 and ": error: " in line  # after the program name, as argparse gives it
    return line


def test_a_file_in_another_layout_is_refused_by_name(tmp_path, capsys):
    write_config(tmp_path, RELEASED)
    torch.save({"word_embeddings.weight": torch.zeros(VOCAB, HIDDEN)}, tmp_path / "ours.bin")
    assert "has no sequential.0.word_embeddings.weight: it is not the official" in refusal(
        capsys, ["--input", str(tmp_path / "ours.bin"), "--config", str(tmp_path / "official.yml"), "--save",
                 str(tmp_path / "out")])


def test_neither_direction_overwrites_what_is_there(tmp_path, capsys):
    torch.save(official_state_dict(write_config(tmp_path, RELEASED)), tmp_path / "pytorch_model.bin")
    imported = ["--input", str(tmp_path / "pytorch_model.bin"), "--config", str(tmp_path / "official.yml")]
    run = tmp_path / "run"
    (run / "global_step300").mkdir(parents=True)
    (run / "latest").write_text("global_step300")
    assert re.search(r"--save .*run exists and is not empty; choose a new or empty",
                     refusal(capsys, [*imported, "--save", str(run)]))
    assert (run / "latest").read_text() == "global_step300" and not any((run / "global_step300").iterdir())

    convert_official_checkpoint.main([*imported, "--save", str(tmp_path / "imported")])
    (tmp_path / "mine.bin").write_bytes(b"keep me")
    assert "mine.bin exists: remove it or give another --save" in refusal(
        capsys, ["--export", "--input", str(tmp_path / "imported"), "--save", str(tmp_path / "mine.bin")])
    assert (tmp_path / "mine.bin").read_bytes() == b"keep me"


def test_a_model_with_pattention_tau_other_than_1_is_not_exported(tmp_path):
    """The official code's scores are X·K^T: a model whose scores carry another factor has no official form."""
    config = write_config(tmp_path, RELEASED)
    torch.save(official_state_dict(config), tmp_path / "pytorch_model.bin")
    (tmp_path / "tau.yml").write_text(yaml.safe_dump({**config, "pattention_tau": 2.0}))
    imported = convert_official_checkpoint.main(["--input", str(tmp_path / "pytorch_model.bin"), "--config",
                                                 str(tmp_path / "tau.yml"), "--save", str(tmp_path / "run")])
    with pytest.raises(ValueError, match=r"pattention_tau = 2.0: the official code has no such factor"):
        convert_official_checkpoint.export_official(imported, tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.bin.partial").exists()
