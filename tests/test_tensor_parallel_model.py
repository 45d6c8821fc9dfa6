"""TokenFormer at tensor-parallel sizes 2 and 4 against the single-rank model: same logits, loss and
gradients (gathered over the ranks) within 1e-5 relative in fp32, for every Θ, and the dense Transformer
baseline; real gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from megatron.model import TokenFormerArgs, TokenFormerModel
from megatron.mpu import collectives
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

VOCAB, SEQ, BATCH = 64, 8, 2
TOLERANCE = 1e-5

CASES = {
    "l2_norm_gelu": dict(norm_activation_type="l2_norm_gelu"),
    "gelu_l2_norm": dict(norm_activation_type="gelu_l2_norm"),
    "softmax": dict(norm_activation_type="softmax"),
    "untied_learned_affine": dict(no_weight_tying=True, pos_emb="learned", norm="layernorm"),
    "checkpointed": dict(checkpoint_activations=True, output_layer_init_method="normal"),
    "dense_transformer": dict(model_type="transformer"),  # column/row-parallel linear layers (model/dense.py)
}


def tiny_args(**overrides) -> TokenFormerArgs:
    # init_method_std 0.2 rather than 0.02: with tiny scores, softmax-Θ Q/K/V outputs are nearly the same at
    # every position, attention is then almost shift-invariant in them and some gradients shrink to ~1e-12,
    # where fp32 rounding alone exceeds 1e-5 relative. Larger weights keep every gradient meaningful.
    values = dict(padded_vocab_size=VOCAB, hidden_size=16, num_layers=2, num_attention_heads=4, qkv_slot_num=8,
                  proj_slot_num=8, ffn_slot_num=16, seq_length=SEQ, rotary_pct=0.5, seed=11, pattention_tau=0.7,
                  init_method_std=0.2)
    values.update(overrides)
    return TokenFormerArgs(**values)


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))


def gathered(tensor: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """The full tensor of a split parameter's block (or the tensor itself when replicated)."""
    return collectives.all_gather(tensor, parameter.partition_dim) if mpu.is_split(parameter) else tensor


def one_step(tensor_size: int) -> dict[str, dict]:
    """Per case: loss, full logits and full gradients of one forward/backward at this tensor-parallel size."""
    mpu.initialize_model_parallel(tensor_size)
    mpu.seed_model_parallel_rng(0)
    results = {}
    for name, overrides in CASES.items():
        model = TokenFormerModel(tiny_args(**overrides)).train()
        initial = {n: gathered(p.detach(), p) for n, p in model.named_parameters()}
        tokens = batch()
        logits = model(tokens[:, :-1])
        loss = mpu.vocab_parallel_cross_entropy(logits, tokens[:, 1:]).mean()
        loss.backward()
        results[name] = {
            "loss": loss.detach(),
            "logits": mpu.gather_from_region(logits.detach(), dim=-1),
            "grads": {n: gathered(p.grad, p) for n, p in model.named_parameters()},
            "initial_parameters": initial,
            "norm_token_counts": {n: b.item() for n, b in model.named_buffers() if n.endswith("norm_token_count")},
        }
    return results


def single_rank_reference(name: str) -> dict:
    model = TokenFormerModel(tiny_args(**CASES[name])).train()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = batch()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return {"loss": loss.detach(), "logits": logits.detach(), "initial_parameters": initial,
            "grads": {n: p.grad for n, p in model.named_parameters()},
            "norm_token_counts": {n: b.item() for n, b in model.named_buffers() if n.endswith("norm_token_count")}}


def assert_relatively_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    error = (actual - expected).norm() / expected.norm()
    assert error < TOLERANCE, f"{what}: relative error {error:.2e}"


@pytest.fixture(scope="module")
def references():
    return {case: single_rank_reference(case) for case in CASES}


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def parallel_run(request, references):
    # after `references`: the ranks are forked from a process whose torch kernels are already warm
    return request.param, run_on_ranks(request.param, one_step, request.param)


@pytest.mark.parametrize("case", list(CASES))
def test_parameters_are_blocks_of_the_single_rank_models_initial_tensors(references, parallel_run, case):
    _, ranks = parallel_run
    expected = references[case]["initial_parameters"]
    for results in ranks:
        got = results[case]["initial_parameters"]
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[name], value) for name, value in expected.items())


@pytest.mark.parametrize("case", list(CASES))
def test_logits_loss_and_gradients_match_the_single_rank_model(references, parallel_run, case):
    tensor_size, ranks = parallel_run
    expected = references[case]
    for rank, results in enumerate(ranks):
        got = results[case]
        where = f"tp={tensor_size} rank {rank} {case}"
        assert_relatively_close(got["loss"], expected["loss"], f"{where} loss")
        assert_relatively_close(got["logits"], expected["logits"], f"{where} logits")
        assert got["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            assert_relatively_close(got["grads"][name], grad, f"{where} grad of {name}")
        assert got["norm_token_counts"] == expected["norm_token_counts"], "each block normalises by the global n"
