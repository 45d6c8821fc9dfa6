"""Vocabulary-parallel embedding, output layer (tied and untied) and cross-entropy on tensor-parallel
groups of 2 and 4 real gloo processes, against the same computations on the full [V, d] matrices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron import mpu
from tests.distributed import run_on_ranks

pytestmark = pytest.mark.slow

VOCAB, HIDDEN = 16, 6
TOKENS = torch.tensor([[0, 3, 4, 7, 8], [11, 12, 15, 1, 9]])  # ids in every rank's block, both ends included
LABELS = torch.tensor([[15, 0, 5, 12, 3], [8, 4, 11, 7, 15]])


def full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def language_model_ends(embedding: torch.nn.Module, output=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Embed, mix, project back to the vocabulary (tied unless `output`), cross-entropy: the model's ends."""
    hidden = torch.tanh(embedding(TOKENS)) * 1.5
    if output is None:
        logits = mpu.vocab_parallel_logits(hidden, embedding.weight)
    else:
        logits = output(hidden)
    return mpu.vocab_parallel_cross_entropy(logits, LABELS).mean(), logits


def run_layers(tensor_size: int) -> dict:
    mpu.initialize_model_parallel(tensor_size)
    embedding = mpu.VocabParallelEmbedding(VOCAB, HIDDEN)
    output = mpu.VocabParallelOutput(HIDDEN, VOCAB)
    with torch.no_grad():
        embedding.weight.copy_(mpu.local_block(full(1, VOCAB, HIDDEN), embedding.weight))
        output.weight.copy_(mpu.local_block(full(2, VOCAB, HIDDEN), output.weight))
    embedded = embedding(TOKENS)
    embedded.backward(full(3, *embedded.shape))  # a replicated output gets the same gradient on every rank
    results = {"embedding": (embedded.detach(), embedding.weight.grad.clone())}
    for name, head in (("tied", None), ("untied", output)):
        embedding.weight.grad = None
        loss, logits = language_model_ends(embedding, head)
        loss.backward()
        head_grad = None if head is None else head.weight.grad
        results[name] = (loss.detach(), mpu.gather_from_region(logits.detach(), -1), embedding.weight.grad, head_grad)
    try:
        mpu.VocabParallelEmbedding(VOCAB + 1, HIDDEN)
    except ValueError as error:
        results["uneven"] = str(error)
    return results


def reference() -> dict:
    embedding = torch.nn.Embedding(VOCAB, HIDDEN, _weight=full(1, VOCAB, HIDDEN))
    output = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    with torch.no_grad():
        output.weight.copy_(full(2, VOCAB, HIDDEN))
    embedded = embedding(TOKENS)
    embedded.backward(full(3, *embedded.shape))
    results = {"embedding": (embedded.detach(), embedding.weight.grad.clone())}
    for name, head in (("tied", None), ("untied", output)):
        embedding.weight.grad = None
        hidden = torch.tanh(embedding(TOKENS)) * 1.5
        logits = hidden @ embedding.weight.T if head is None else head(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1), LABELS.flatten())
        loss.backward()
        head_grad = None if head is None else head.weight.grad
        results[name] = (loss.detach(), logits.detach(), embedding.weight.grad, head_grad)
    return results


def block(tensor: torch.Tensor, rank: int, tensor_size: int) -> torch.Tensor:
    return tensor.chunk(tensor_size, dim=0)[rank]


@pytest.fixture(scope="module")
def expected():
    return reference()


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def ranks(request, expected):
    return request.param, run_on_ranks(request.param, run_layers, request.param)


def test_vocab_parallel_embedding_matches_a_full_embedding(ranks, expected):
    tensor_size, results = ranks
    want_output, want_grad = expected["embedding"]
    for rank, result in enumerate(results):
        output, grad = result["embedding"]
        torch.testing.assert_close(output, want_output)
        torch.testing.assert_close(grad, block(want_grad, rank, tensor_size))


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_parallel_output_layer_and_cross_entropy_match_the_full_vocabulary(ranks, expected, head):
    tensor_size, results = ranks
    want_loss, want_logits, want_embedding_grad, want_head_grad = expected[head]
    for rank, result in enumerate(results):
        loss, logits, embedding_grad, head_grad = result[head]
        torch.testing.assert_close(loss, want_loss)
        torch.testing.assert_close(logits, want_logits)
        torch.testing.assert_close(embedding_grad, block(want_embedding_grad, rank, tensor_size))
        if want_head_grad is not None:
            torch.testing.assert_close(head_grad, block(want_head_grad, rank, tensor_size))


def test_vocabulary_that_does_not_split_evenly_is_refused(ranks):
    tensor_size, results = ranks
    for result in results:
        assert f"padded vocabulary size = {VOCAB + 1} cannot be split evenly" in result["uneven"]
        assert f"model_parallel_size = {tensor_size}" in result["uneven"]


def test_cross_entropy_is_computed_in_fp32_for_bf16_logits():
    logits = full(4, 2, 5, VOCAB)
    loss = mpu.vocab_parallel_cross_entropy(logits.bfloat16(), LABELS)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.bfloat16().float().flatten(0, 1), LABELS.flatten(),
                                                     reduction="none").view(2, 5))
