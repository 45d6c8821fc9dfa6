"""A synthetic knowledge corpus: made-up people, each with a few attributes, written as sentences from templates.

    python data_prep/knowledge_corpus.py --out data/knowledge [--people 256] [--values 32] [--tokens 12000000]
        [--seed 0]

Every person (a made-up name, one word) has one value of each attribute of ATTRIBUTES (a birthplace, a job, a
colour, a pet), drawn at random from `--values` made-up words per attribute. A document is a run of sentences,
each a uniform pick of a person and of a template among all the attributes' templates (an attribute with more
templates is stated more often), stating that attribute of that person ("ruvotasel born kemara ."). Nothing about
a person can be inferred from anything else, so a model lowers its loss on the value words only by storing the
facts: the growth study's second task, closer to text than the Markov source
(data_prep/markov_corpus.py). Whether it measures capacity depends on its size: with fewer fact bits
(`fact_bits` in OUT/knowledge_source.json) than the smallest model can hold, every model can store every fact,
and a loss after a fixed number of steps measures how fast facts are stored, not how many fit (docs/growth.md
says which the study's setting measures).

The templates are telegraphic, the value right after the name and the attribute's word, because the study
measures storing facts: retrieving a name a few words back ("the birthplace of ruvotasel is kemara .") is
learned late, so small models trained briefly show no fact learned at all (benchmarks/RESULTS.md, "Growth
ablation").

The loss of a model that knows every fact is the entropy of what stays random (which sentence, which person:
`floor_nats`, per token, written to OUT/knowledge_source.json); one that knows none pays ln(values) more on each
value word (`no_facts_nats`). Writes OUT/tokenizer.json (word level, `<|endoftext|>` included),
OUT/knowledge_text_document.bin/.idx and OUT/knowledge_source.json. The same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, data_file_path, index_file_path
from megatron.data.preprocess import output_prefix_for
from megatron.tokenizer.hf_tokenizer import EOD_TOKEN

NAME = "knowledge"
# attribute -> its templates; NAME stands for the person's name, VALUE for the attribute's value. One each,
# short (above); a template of more words can be added to a tuple.
ATTRIBUTES = {
    "birthplace": ("NAME born VALUE .",),
    "job": ("NAME works VALUE .",),
    "colour": ("NAME likes VALUE .",),
    "pet": ("NAME owns VALUE .",),
}
DOCUMENT_TOKENS = 2048  # about: whole sentences up to this many tokens
SENTENCES_AT_ONCE = 65536
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def made_up_words(count: int, rng: np.random.Generator, taken: set[str]) -> list[str]:
    """`count` distinct pronounceable words of two or three syllables, none in `taken` (which gains them)."""
    words: list[str] = []
    while len(words) < count:
        word = "".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 4))))
        if word not in taken:
            taken.add(word)
            words.append(word)
    return words


def template_words() -> list[str]:
    return sorted({word for templates in ATTRIBUTES.values() for template in templates for word in template.split()
                   if word not in ("NAME", "VALUE")})


def vocabulary(names: list[str], values: dict[str, list[str]]) -> list[str]:
    words = [*template_words(), *names, *(word for attribute in ATTRIBUTES for word in values[attribute])]
    if len(set(words)) != len(words):
        raise ValueError("a made-up word collides with a template word; choose another --seed")
    return words


def world(people: int, values: int, seed: int):
    """The people's names, each attribute's values, and the facts: [people, attributes] value indices."""
    rng = np.random.default_rng([seed, 0])
    taken = set(template_words())
    names = made_up_words(people, rng, taken)
    attribute_values = {attribute: made_up_words(values, rng, taken) for attribute in ATTRIBUTES}
    facts = rng.integers(0, values, (people, len(ATTRIBUTES)))
    return names, attribute_values, facts


def templates_as_ids(ids: dict[str, int]) -> list[tuple[int, np.ndarray]]:
    """Each (attribute, template), in ATTRIBUTES' order: the attribute's index and the template as token ids (-1
    for the name, -3 the value). An attribute may have any number of templates."""
    slots = {"NAME": [-1], "VALUE": [-3]}
    return [(attribute, np.array([i for word in template.split() for i in slots.get(word, [ids.get(word)])]))
            for attribute, options in enumerate(ATTRIBUTES.values()) for template in options]


def stream(count: int, facts: np.ndarray, ids: dict[str, int], names: list[str], values: dict[str, list[str]],
           rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`count` sentences, each about a uniform person in a uniform (attribute, template), one after the other:
    (token ids, each sentence's start). Built template by template, without a loop over sentences."""
    templates = templates_as_ids(ids)
    people, chosen = rng.integers(0, len(facts), count), rng.integers(0, len(templates), count)
    lengths = np.array([len(t) for _, t in templates])[chosen]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = np.empty(int(lengths.sum()), dtype=np.int64)
    name_ids = np.array([ids[word] for word in names])
    value_ids = np.array([[ids[word] for word in values[attribute]] for attribute in ATTRIBUTES])
    for index, (attribute, template) in enumerate(templates):
        which = np.flatnonzero(chosen == index)
        who = people[which]
        fill = {-1: name_ids[who], -3: value_ids[attribute, facts[who, attribute]]}
        block = np.repeat(template[None, :], len(which), axis=0)
        for slot, column in fill.items():
            block[:, template == slot] = column[:, None]
        out[starts[which, None] + np.arange(len(template))] = block
    return out, starts


def entropies(people: int, values: int, words: dict[str, int]) -> dict[str, float]:
    """Nats per token: `floor_nats` (every fact known: which template, which person), `no_facts_nats` (none)."""
    templates = [template.split() for options in ATTRIBUTES.values() for template in options]
    mean_tokens = sum(len(t) for t in templates) / len(templates)
    # which template and which person: an upper bound on what stays random
    random_per_sentence = math.log(len(templates)) + math.log(people)
    floor = random_per_sentence / mean_tokens
    return {"floor_nats": floor, "no_facts_nats": floor + math.log(values) / mean_tokens,
            "mean_sentence_tokens": mean_tokens, "vocabulary": len(words) + 1}


def build(out: Path, people: int, values: int, tokens: int, seed: int) -> str:
    """Write the tokenizer, the dataset and the world's description; returns the dataset prefix."""
    out.mkdir(parents=True, exist_ok=True)
    names, attribute_values, facts = world(people, values, seed)
    words = vocabulary(names, attribute_values)
    ids = {word: i for i, word in enumerate(words)}
    eod = len(words)
    prefix = output_prefix_for(str(out / NAME), "text")
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype=np.uint16)
    rng, written = np.random.default_rng([seed, 1]), 0
    while written < tokens:  # documents of whole sentences, cut where a sentence starts past DOCUMENT_TOKENS
        flat, starts = stream(SENTENCES_AT_ONCE, facts, ids, names, attribute_values, rng)
        cuts = np.flatnonzero(np.diff(starts // DOCUMENT_TOKENS)) + 1
        for document in np.split(flat, starts[cuts]):
            with_eod = np.append(document, eod).astype(np.uint16)
            builder.add_documents(with_eod, np.array([len(with_eod)]))
            written += len(with_eod)
            if written >= tokens:
                break
    builder.finalize(index_file_path(prefix))
    tokenizer = Tokenizer(WordLevel({**ids, EOD_TOKEN: eod}, unk_token=EOD_TOKEN))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    description = {"people": people, "attributes": list(ATTRIBUTES), "values_per_attribute": values, "seed": seed,
                   "facts": int(facts.size), "fact_bits": facts.size * math.log2(values),
                   **entropies(people, values, ids)}
    (out / f"{NAME}_source.json").write_text(json.dumps(description, indent=1) + "\n", encoding="utf-8")
    return prefix


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--people", type=int, default=256)
    parser.add_argument("--values", type=int, default=32, help="made-up words per attribute")
    parser.add_argument("--tokens", type=int, default=12_000_000, help="about this many tokens in all")
    parser.add_argument("--seed", type=int, default=0, help="picks the words, the facts and the sentences")
    args = parser.parse_args(argv)
    for name in ("people", "values"):
        if not 2 <= getattr(args, name) <= 4096:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give 2 to 4096")
    if args.tokens < DOCUMENT_TOKENS:
        parser.error(f"--tokens {args.tokens}: give at least one document, {DOCUMENT_TOKENS} tokens")
    prefix = build(args.out, args.people, args.values, args.tokens, args.seed)
    facts = json.loads((args.out / f"{NAME}_source.json").read_text(encoding="utf-8"))
    print(f"{prefix}: {facts['facts']:,} facts ({facts['fact_bits']:,.0f} bits); loss knowing every fact "
          f"<= {facts['floor_nats']:.4f} nats per token, knowing none {facts['no_facts_nats']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
