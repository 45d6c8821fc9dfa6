"""The lm-eval adapter, offline: its three request types against the model computed directly, and eval.py
scoring local tasks (multiple choice, rolling log-likelihood, generation) on two tensor-parallel ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance

import eval as eval_script  # imported here, once, rather than in every forked rank
from megatron import mpu
from megatron.inference import load_model
from megatron.inference.generation import generate
from megatron.inference.lm_eval_adapter import TokenFormerLM
from megatron.inference.sampling import SamplingParams
from megatron.tokenizer import build_tokenizer
from tests.distributed import run_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

DOCS = [
    {"question": "def main", "choices": ["():", " the cat"], "answer": 0, "text": "def main():\n    return 1\n"},
    {"question": "import", "choices": [" os", " zzqx"], "answer": 1, "text": "import os\nimport sys\n"},
    {"question": "The value", "choices": [" is None.", " of the"], "answer": 0, "text": "The value is None."},
    {"question": "for item in", "choices": [" items:", " range"], "answer": 1, "text": "for item in items:\n"},
]
TASKS = {
    "local_choice": """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc}]""",
    "local_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: bits_per_byte}]""",
    "local_generation": """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{choices[0]}}"
generation_kwargs: {until: ["\\n"], max_gen_toks: 6}
metric_list: [{metric: exact_match}]""",
}


def write_local_tasks(directory) -> None:
    """Task YAML files reading a local jsonl through the `json` dataset builder (no download)."""
    data = directory / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    for name, body in TASKS.items():
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}\n")


def direct_log_likelihood(model, tokens: list[int], count: int) -> float:
    """log P(last `count` tokens | the ones before), from the model's logits over the whole vocabulary."""
    with torch.no_grad():
        log_probs = F.log_softmax(model(torch.tensor([tokens[:-1]]))[0, -count:], dim=-1)
    return log_probs.gather(-1, torch.tensor(tokens[-count:])[:, None]).sum().item()


@pytest.fixture(scope="module")
def model_and_tokenizer(tensor_parallel_checkpoint):
    cfg = tensor_parallel_checkpoint.config()
    return load_model(tensor_parallel_checkpoint.save), build_tokenizer(cfg.tokenizer_type, cfg.vocab_file)


def test_requests_match_the_model_computed_directly(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    lm = TokenFormerLM(model, tokenizer, batch_size=3)
    pairs = [(doc["question"], choice) for doc in DOCS for choice in doc["choices"]]
    scored = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    for (context, continuation), (log_likelihood, _) in zip(pairs, scored):
        context_tokens = tokenizer.tokenize(context)
        continuation_tokens = tokenizer.tokenize(context + continuation)[len(context_tokens):]
        expected = direct_log_likelihood(model, context_tokens + continuation_tokens, len(continuation_tokens))
        assert log_likelihood == pytest.approx(expected, abs=1e-4)

    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d["text"],), i)
                                        for i, d in enumerate(DOCS)])
    for doc, total in zip(DOCS, rolling):
        tokens = tokenizer.tokenize(doc["text"])
        assert total == pytest.approx(direct_log_likelihood(model, [tokenizer.eod, *tokens], len(tokens)), abs=1e-4)

    arguments = {"until": ["\n"], "max_gen_toks": 6}
    texts = lm.generate_until([Instance("generate_until", {}, (d["question"], arguments), i)
                               for i, d in enumerate(DOCS)])
    for doc, text in zip(DOCS, texts):
        [greedy] = generate(model, torch.tensor([tokenizer.tokenize(doc["question"])]), 6, SamplingParams(),
                            eod=tokenizer.eod, vocab_size=tokenizer.vocab_size)
        assert text == tokenizer.detokenize(greedy.tokens).split("\n")[0]


def _evaluate(cfg) -> dict:
    try:
        return eval_script.main(cfg)
    finally:
        mpu.destroy_model_parallel()


def test_eval_script_scores_local_tasks_on_two_tensor_ranks(tensor_parallel_checkpoint, model_and_tokenizer,
                                                            tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    write_local_tasks(tmp_path)
    cfg = tensor_parallel_checkpoint.config(
        "model_parallel_size=2", f"load={tensor_parallel_checkpoint.save}", f"eval_include_path={tmp_path}",
        f"eval_tasks=[{','.join(TASKS)}]", f"eval_results_prefix={tmp_path}/tiny")
    results = run_on_ranks(2, _evaluate, cfg)[0]["results"]
    assert json.loads((tmp_path / "tiny_eval_results.json").read_text())["results"] == results

    model, tokenizer = model_and_tokenizer

    def choice_score(doc, choice):
        context = tokenizer.tokenize(doc["question"])
        continuation = tokenizer.tokenize(doc["question"] + choice)[len(context):]
        return direct_log_likelihood(model, context + continuation, len(continuation))

    correct = [max(range(2), key=lambda c: choice_score(doc, doc["choices"][c])) == doc["answer"] for doc in DOCS]
    assert results["local_choice"]["acc,none"] == pytest.approx(sum(correct) / len(DOCS))
    total = sum(direct_log_likelihood(model, [tokenizer.eod, *tokenizer.tokenize(d["text"])],
                                      len(tokenizer.tokenize(d["text"]))) for d in DOCS)
    total_bytes = sum(len(d["text"].encode()) for d in DOCS)
    assert results["local_rolling"]["bits_per_byte,none"] == pytest.approx(-total / total_bytes / math.log(2), rel=1e-4)
    assert 0.0 <= results["local_generation"]["exact_match,none"] <= 1.0
