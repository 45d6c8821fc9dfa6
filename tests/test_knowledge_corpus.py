"""data_prep/knowledge_corpus.py: every sentence states a fact of the world it describes, in one of its attribute's
templates; the documents are whole sentences ending with <|endoftext|>; the same arguments write the same bytes;
the trainer's tokenizer and dataset read it."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from tests.conftest import REPO

_SPEC = importlib.util.spec_from_file_location("knowledge_corpus", REPO / "data_prep" / "knowledge_corpus.py")
knowledge_corpus = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(knowledge_corpus)

ARGS = ("--people", "30", "--values", "7", "--tokens", "60000", "--seed", "4")


def build(out):
    return subprocess.run([sys.executable, "data_prep/knowledge_corpus.py", "--out", str(out), *ARGS], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("knowledge")
    result = build(out)
    assert result.returncode == 0, result.stderr
    return out


def parse(words: list[str], people: dict[str, int]) -> list[tuple[int, str, str, int]]:
    """Each sentence of `words` as (person, attribute, value, template index); AssertionError if one fits none."""
    templates = [(attribute, index, template.split()) for attribute, options in knowledge_corpus.ATTRIBUTES.items()
                 for index, template in enumerate(options)]
    found, position = [], 0
    while position < len(words):
        for attribute, index, template in templates:
            length = len(template)
            candidate = words[position:position + length]
            if len(candidate) == length and all(e in ("NAME", "VALUE") or e == w for e, w in zip(template, candidate)):
                person = people.get(candidate[template.index("NAME")])
                if person is not None:
                    found.append((person, attribute, candidate[template.index("VALUE")], index))
                    position += length
                    break
        else:
            raise AssertionError(f"no template fits {words[position:position + 8]}")
    return found


def test_every_sentence_states_its_persons_fact_in_a_template_of_the_attribute(corpus):
    names, values, facts = knowledge_corpus.world(30, 7, 4)
    people = {name: index for index, name in enumerate(names)}
    tokenizer = HFTokenizer(str(corpus / "tokenizer.json"))
    dataset = MMapIndexedDataset(str(corpus / "knowledge_text_document"))
    seen_templates, seen_people, total = set(), set(), 0
    for index in range(len(dataset)):
        ids = dataset[index].astype(np.int64).tolist()
        assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
        assert len(ids) <= knowledge_corpus.DOCUMENT_TOKENS + 16
        words = tokenizer.detokenize(ids[:-1]).split()
        assert tokenizer.tokenize(" ".join(words)) == ids[:-1]  # the tokenizer reads back what was written
        for person, attribute, value, template in parse(words, people):
            column = list(knowledge_corpus.ATTRIBUTES).index(attribute)
            assert value == values[attribute][facts[person, column]]
            seen_templates.add((attribute, template))
            seen_people.add(person)
        total += len(ids)
    templates = sum(len(options) for options in knowledge_corpus.ATTRIBUTES.values())
    assert total >= 60000 and len(seen_templates) == templates and len(seen_people) == 30


def test_the_description_and_the_same_arguments_give_the_same_bytes(corpus, tmp_path):
    described = json.loads((corpus / "knowledge_source.json").read_text())
    assert (described["people"], described["facts"], described["values_per_attribute"]) == (30, 120, 7)
    assert described["no_facts_nats"] > described["floor_nats"] > 0
    assert build(tmp_path).returncode == 0
    for name in ("knowledge_text_document.bin", "knowledge_text_document.idx", "tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (corpus / name).read_bytes()


def test_bad_arguments_are_one_line_each():
    result = subprocess.run([sys.executable, "data_prep/knowledge_corpus.py", "--out", "/nonexistent/x",
                             "--values", "1"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--values 1: give 2 to 4096" in result.stderr


UNEVEN = {"birthplace": ("NAME born VALUE .", "NAME hails from VALUE ."), "job": ("NAME works VALUE .",
                                                                                   "NAME is a VALUE by trade ."),
          "colour": ("NAME likes VALUE .",), "pet": ("NAME owns VALUE .",)}


def generated(monkeypatch, templates: dict, sentences: int) -> tuple[list[list[str]], dict, tuple]:
    """`sentences` sentences of the world (30 people, 7 values, seed 4) under `templates`, as word lists."""
    monkeypatch.setattr(knowledge_corpus, "ATTRIBUTES", templates)
    names, values, facts = knowledge_corpus.world(30, 7, 4)
    words = knowledge_corpus.vocabulary(names, values)
    flat, starts = knowledge_corpus.stream(sentences, facts, {word: i for i, word in enumerate(words)}, names, values,
                                           np.random.default_rng(0))
    text = [words[i] for i in flat]
    bounds = [*starts.tolist(), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])], words, (names, values, facts)


def test_an_attribute_with_more_templates_states_its_own_facts(monkeypatch):
    """Templates per attribute 2, 2, 1, 1 of unequal lengths: every sentence states the fact of its template's
    attribute, each template is used, and templates (not attributes) are picked uniformly."""
    sentences, _, (names, values, facts) = generated(monkeypatch, UNEVEN, 6000)
    people = {name: index for index, name in enumerate(names)}
    used: dict[tuple[str, int], int] = {}
    for sentence in sentences:
        ((person, attribute, value, template),) = parse(sentence, people)
        assert value == values[attribute][facts[person, list(UNEVEN).index(attribute)]], sentence
        used[(attribute, template)] = used.get((attribute, template), 0) + 1
    assert len(used) == 6 and all(abs(count / 6000 - 1 / 6) < 0.02 for count in used.values()), used


def test_the_entropy_formulas_match_the_generated_text(monkeypatch):
    """floor_nats: the entropy of a sentence (which template, which person: the rest follows from the facts) over
    its mean length, measured on the text itself; no_facts_nats adds ln(values) per value word."""
    sentences, words, _ = generated(monkeypatch, UNEVEN, 40000)
    expected = knowledge_corpus.entropies(30, 7, {word: i for i, word in enumerate(words)})
    counts: dict[tuple[str, ...], int] = {}
    for sentence in sentences:
        counts[tuple(sentence)] = counts.get(tuple(sentence), 0) + 1
    frequencies = np.array(list(counts.values())) / len(sentences)
    measured_entropy = -(frequencies * np.log(frequencies)).sum()
    tokens = sum(map(len, sentences))
    assert len(counts) == 6 * 30  # distinct sentences: nothing else is random
    assert expected["mean_sentence_tokens"] == pytest.approx(tokens / len(sentences), rel=0.01)
    assert expected["floor_nats"] == pytest.approx(measured_entropy / (tokens / len(sentences)), rel=0.01)
    value_words_per_token = len(sentences) / tokens  # one value word a sentence
    assert expected["no_facts_nats"] - expected["floor_nats"] == pytest.approx(np.log(7) * value_words_per_token,
                                                                                rel=0.01)
