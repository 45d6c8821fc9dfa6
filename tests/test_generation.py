"""Generation: the KV cache gives the tokens and logits of recomputing the whole sequence (one process and
two tensor-parallel ranks), the sampling rules, and generate.py's three modes, once launched by deepy.py."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from megatron import mpu
from megatron.config import Config, load_config
from megatron.inference import build_model, load_model
from megatron.inference.generation import generate
from megatron.inference.sampling import SamplingParams, filter_logits, next_tokens
from megatron.inference.text_generation import generate_samples
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.model.kv_cache import KVCache
from megatron.tokenizer import build_tokenizer
from tests.conftest import run_deepy
from tests.distributed import run_on_ranks
from tests.inference_fixtures import TINY

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
PROMPT = torch.tensor([[5, 17, 3, 99, 42], [7, 7, 1, 0, 64]])


# Weights large enough (init std 0.5) that every token's output depends on the tokens before it.
ARCHITECTURE = ("num_layers=2", "hidden_size=32", "num_attention_heads=4", "qkv_slot_num=16", "proj_slot_num=16",
                "ffn_slot_num=48", "seq_length=40", "rotary_pct=0.5", "init_method_std=0.5", "seed=3")


def random_model(pos_emb: str = "rotary") -> tuple[TokenFormerModel, Config]:
    cfg = load_config([TINY], [*ARCHITECTURE, f"pos_emb={pos_emb}"])
    return TokenFormerModel(TokenFormerArgs.from_config(cfg, padded_vocab_size=128)).eval(), cfg


def run_generation(model, sampling, use_cache, prompt=PROMPT, tokens=25):
    generator = torch.Generator().manual_seed(11)
    return [g.tokens for g in generate(model, prompt, tokens, sampling, use_cache=use_cache, generator=generator)]


@pytest.mark.parametrize("pos_emb", ["rotary", "learned"])
def test_cached_logits_equal_the_full_forward_pass(pos_emb):
    model, _ = random_model(pos_emb)
    sequence = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(sequence)
        cache = KVCache(len(model.layers))
        steps = [model(sequence[:, :7], cache)]  # a prompt, then one token at a time
        steps += [model(sequence[:, i:i + 1], cache) for i in range(7, 30)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 30


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("pos_emb", ["rotary", "learned"])
def test_cached_generation_equals_recomputation(pos_emb, sampling):
    model, _ = random_model(pos_emb)
    cached = run_generation(model, sampling, use_cache=True)
    assert cached == run_generation(model, sampling, use_cache=False)
    assert all(len(tokens) == 25 for tokens in cached) and cached[0] != cached[1]


def test_generation_stops_at_the_end_of_document_token_and_the_position_limit():
    model, _ = random_model()
    greedy = run_generation(model, SamplingParams(), use_cache=True, prompt=PROMPT[:1])[0]
    eod = greedy[3]
    [stopped] = generate(model, PROMPT[:1], 25, SamplingParams(), eod=eod)
    assert stopped.tokens == greedy[:greedy.index(eod)] and stopped.finished
    [capped] = generate(model, PROMPT[:1], 100, SamplingParams())
    assert len(capped.tokens) == 40 - 5 and not capped.finished  # max_position_embeddings = seq_length = 40


def test_sampling_follows_gpt_neox_rules():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2, top_p=0.0)[0, 2:]).all()
    probabilities = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, ...: 0.7 needs the first two tokens
    assert probabilities[0] < 0.7 < probabilities[:2].sum()
    kept = filter_logits(logits, top_k=0, top_p=0.7)
    assert torch.isfinite(kept[0, :2]).all() and torch.isinf(kept[0, 2:]).all()
    assert next_tokens(torch.tensor([[0.0, 5.0, 1.0]]), SamplingParams()).item() == 1
    draws = {next_tokens(logits, SamplingParams(top_k=2), torch.Generator().manual_seed(s)).item() for s in range(40)}
    assert draws == {0, 1}  # temperature 0 with top_k samples (at temperature 1), as in GPT-NeoX


def _generate_on_tensor_ranks(state, cfg, sampling) -> list[list[list[int]]]:
    mpu.initialize_model_parallel(2)
    mpu.seed_model_parallel_rng(0)
    try:
        model = build_model(state, cfg)
        assert model.layers[0].mlp.key_param_tokens.shape[0] == 24  # this rank's half of the 48 tokens
        return [run_generation(model, sampling, use_cache) for use_cache in (True, False)]
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.slow
def test_tensor_parallel_generation_matches_one_process_with_and_without_cache():
    whole, cfg = random_model()
    for sampling in (SamplingParams(), SAMPLED):
        expected = run_generation(whole, sampling, use_cache=True)
        for per_rank in run_on_ranks(2, _generate_on_tensor_ranks, whole.state_dict(), cfg, sampling):
            assert per_rank == [expected, expected]


def _interactive_generation(cfg, typed: str) -> list[dict]:
    import generate as generate_script

    if torch.distributed.get_rank() == 0:
        sys.stdin = io.StringIO(typed)
    try:
        return generate_script.main(cfg)
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.slow
def test_interactive_mode_on_two_tensor_ranks(tensor_parallel_checkpoint, tmp_path):
    cfg = tensor_parallel_checkpoint.config(
        "model_parallel_size=2", f"load={tensor_parallel_checkpoint.save}", "text_gen_type=interactive",
        "maximum_tokens=6", f"sample_output_file={tmp_path}/typed.jsonl")
    rank_0, rank_1 = run_on_ranks(2, _interactive_generation, cfg, "def main\n\nimport os\n")
    assert [r["context"] for r in rank_0] == ["def main", "import os"]
    written = [json.loads(line) for line in (tmp_path / "typed.jsonl").read_text().splitlines()]
    assert [r["text"] for r in written] == [r["text"] for r in rank_0] == [r["text"] for r in rank_1]


@pytest.mark.slow
def test_generate_script_under_deepy_with_two_tensor_ranks(tensor_parallel_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny model: one thread per rank is fastest
    (tmp_path / "prompts.txt").write_text("def main():\n\nclass Config:\nimport\n")
    settings = [f"load={tensor_parallel_checkpoint.save}", "text_gen_type=input-file",
                f"sample_input_file={tmp_path}/prompts.txt", "maximum_tokens=8", "temperature=0.9", "top_k=50",
                "top_p=0.9"]
    launched = run_deepy("generate.py", "tests/tiny.yml", "configs/text_generation.yml",
                         *tensor_parallel_checkpoint.overrides, *settings, "num_gpus=2", "model_parallel_size=2",
                         f"sample_output_file={tmp_path}/samples.jsonl", timeout=300)
    assert "launching 2 processes" in launched.stdout
    # It says what it loaded and where it writes
    assert (f"loaded {tensor_parallel_checkpoint.save / 'global_step2'} (iteration 2); generating input-file "
            f"samples into {tmp_path}/samples.jsonl") in launched.stdout
    assert f"wrote 3 samples to {tmp_path}/samples.jsonl" in launched.stdout
    written = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["context"] for r in written] == ["def main():", "class Config:", "import"]
    assert all(r["length"] == 8 or r["finished"] for r in written)

    cfg = tensor_parallel_checkpoint.config(*settings, "recompute=true", f"sample_output_file={tmp_path}/one.jsonl")
    tokenizer = build_tokenizer(cfg.tokenizer_type, cfg.vocab_file)
    one_process = generate_samples(cfg, load_model(cfg.load), tokenizer, torch.device("cpu"))
    assert [r["text"] for r in one_process] == [r["text"] for r in written]
