"""The tensor-parallel RNG tracker on 4 real processes (2 data-parallel × 2 tensor-parallel): replicated
dropout masks agree, split ones differ, and activation checkpointing replays the split stream."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron import mpu
from megatron.model import TokenFormerArgs, TokenFormerModel
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

SEED = 5


def mask(x: torch.Tensor) -> torch.Tensor:
    return F.dropout(x, 0.5) != 0


def split_dropout_block(x: torch.Tensor) -> torch.Tensor:
    """A stand-in for attention on local heads: dropout on split activations, then some arithmetic."""
    with mpu.split_region_rng():
        return F.dropout(torch.sin(x), 0.5) * x


def gradient(with_checkpoint: bool, context_fn=None) -> torch.Tensor:
    x = torch.linspace(-2, 2, 64).requires_grad_()
    y = (checkpoint(split_dropout_block, x, use_reentrant=False, **({"context_fn": context_fn} if context_fn else {}))
         if with_checkpoint else split_dropout_block(x))
    y.sum().backward()
    return x.grad


def model_loss_and_grads(checkpoint_activations: bool) -> tuple[torch.Tensor, dict]:
    args = TokenFormerArgs(padded_vocab_size=32, hidden_size=16, num_layers=3, num_attention_heads=4, qkv_slot_num=8,
                           proj_slot_num=8, ffn_slot_num=16, seq_length=8, rotary_pct=0.5, attention_dropout=0.3,
                           hidden_dropout=0.2, checkpoint_activations=checkpoint_activations, checkpoint_num_layers=2)
    model = TokenFormerModel(args).train()
    torch.manual_seed(SEED)
    mpu.seed_model_parallel_rng(SEED)
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    loss = mpu.vocab_parallel_cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def draw_masks() -> dict:
    mpu.initialize_model_parallel(tensor_size=2)
    ones = torch.ones(256)
    torch.manual_seed(SEED)
    mpu.seed_model_parallel_rng(SEED)
    replicated = mask(ones)
    with mpu.split_region_rng():
        split = mask(ones)
    default_after_fork = mask(ones)
    torch.manual_seed(SEED)
    mask(ones)
    default_without_fork = mask(ones)

    saved = mpu.get_rng_tracker().get_states()
    with mpu.split_region_rng():
        first = mask(ones)
    mpu.get_rng_tracker().set_states(saved)
    with mpu.split_region_rng():
        replayed = mask(ones)

    torch.manual_seed(SEED)
    mpu.seed_model_parallel_rng(SEED)
    plain = gradient(with_checkpoint=False)
    for_each = {}
    for name, context_fn in (("tracker", mpu.checkpoint_context_fn), ("default", None)):
        torch.manual_seed(SEED)
        mpu.seed_model_parallel_rng(SEED)
        for_each[name] = gradient(with_checkpoint=True, context_fn=context_fn)
    return {
        "rank": dist.get_rank(), "replicated": replicated, "split": split,
        "default_after_fork": default_after_fork, "default_without_fork": default_without_fork,
        "first": first, "replayed": replayed,
        "plain_grad": plain, "checkpointed_grad": for_each["tracker"], "untracked_checkpoint_grad": for_each["default"],
        "model_plain": model_loss_and_grads(False), "model_checkpointed": model_loss_and_grads(True),
    }


@pytest.fixture(scope="module")
def ranks():
    model_loss_and_grads(checkpoint_activations=True)  # warm the kernels once, before forking the ranks
    return run_on_ranks(4, draw_masks)


def test_replicated_regions_draw_the_same_mask_on_every_rank(ranks):
    assert all(torch.equal(r["replicated"], ranks[0]["replicated"]) for r in ranks)


def test_split_regions_differ_across_tensor_ranks_and_agree_across_data_parallel_replicas(ranks):
    # ranks 0, 1 form one tensor-parallel group and 2, 3 the other; 0 and 2 are tensor rank 0
    assert not torch.equal(ranks[0]["split"], ranks[1]["split"])
    assert torch.equal(ranks[0]["split"], ranks[2]["split"]) and torch.equal(ranks[1]["split"], ranks[3]["split"])
    assert not torch.equal(ranks[0]["split"], ranks[0]["replicated"])


def test_forking_leaves_the_default_stream_where_it_was(ranks):
    for r in ranks:
        assert torch.equal(r["default_after_fork"], r["default_without_fork"])


def test_restoring_tracker_states_replays_the_split_stream(ranks):
    for r in ranks:
        assert torch.equal(r["first"], r["replayed"])


def test_activation_checkpointing_replays_split_dropout_masks(ranks):
    for r in ranks:
        torch.testing.assert_close(r["checkpointed_grad"], r["plain_grad"], rtol=0, atol=0)
        # without the tracker's context the recomputation draws new masks: what the context prevents
        assert not torch.equal(r["untracked_checkpoint_grad"], r["plain_grad"])


def test_checkpointed_tensor_parallel_model_with_dropout_gives_the_same_loss_and_gradients(ranks):
    for r in ranks:
        (plain_loss, plain_grads), (loss, grads) = r["model_plain"], r["model_checkpointed"]
        torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
        for name, grad in plain_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_forking_an_unseeded_tracker_names_the_fix():
    tracker = mpu.random.RNGStatesTracker()
    with pytest.raises(RuntimeError, match="seed_model_parallel_rng"):
        with tracker.fork():
            pass
