"""Build the offline demo dataset from English text that every Python install ships.

    python data_prep/demo_corpus.py --out data/demo

Documents are the reference-manual topics of ``pydoc_data.topics`` plus the
docstrings of standard-library modules, classes and functions (~1.3 MB). The
steps write ``corpus.jsonl``, a byte-level BPE ``tokenizer.json`` trained on
it (``<|endoftext|>`` and ``<|padding|>`` specials, GPT-NeoX-20B style) and the
tokenized ``demo_text_document.bin/.idx``. Everything is deterministic for a
given Python, needs no network, and a step whose outputs exist is skipped
unless ``--force`` (or an earlier step was redone). Nothing is held out: the
train/valid/test split comes from the ``split`` config key.
"""

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import pkgutil
import sys
import time
import warnings
from collections.abc import Iterator

# Run as `python data_prep/demo_corpus.py` from anywhere: make the repository's `megatron` importable.
from megatron.cli import one_line_errors
from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path
from megatron.data.preprocess import output_prefix_for, preprocess_corpus
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.train import minimum_vocab_size, train_byte_level_bpe

MIN_DOCSTRING_CHARS = 200
# Never imported: side effects on import (this prints, antigravity opens a browser, lib2to3 writes grammar
# caches, readline may write terminal escapes), GUI toolkits, the test suite, text that depends on the
# install rather than on Python (distutils is replaced by setuptools), or near-identical codec modules.
EXCLUDED_MODULES = {
    "this", "antigravity", "lib2to3", "readline", "tkinter", "idlelib", "turtle", "turtledemo",
    "test", "distutils", "ensurepip", "encodings", "pydoc_data",
}


def _excluded(module_name: str) -> bool:
    parts = module_name.split(".")
    return parts[0] in EXCLUDED_MODULES or any(p.startswith("_") or p in ("test", "tests") for p in parts)


def _quiet_import(module_name: str):
    """The module, or None when it cannot be imported here (platform-specific, missing C extension...)."""
    silenced = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(silenced), contextlib.redirect_stderr(silenced):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(module_name)
        except (Exception, SystemExit):  # any failure just means: not part of the corpus
            return None


def _stdlib_modules() -> Iterator[object]:
    """Importable public standard-library modules and their submodules, in sorted order."""
    pending = sorted(name for name in sys.stdlib_module_names if not _excluded(name))
    while pending:
        module = _quiet_import(pending.pop(0))
        if module is None:
            continue
        yield module
        if hasattr(module, "__path__"):
            children = (f"{module.__name__}.{info.name}" for info in pkgutil.iter_modules(module.__path__))
            pending = sorted([name for name in children if not _excluded(name)] + pending)


def _docstring_documents(module) -> Iterator[str]:
    """The module's docstring, then those of its own public classes, functions and methods."""
    name = module.__name__
    yield f"{name}\n\n{inspect.getdoc(module) or ''}"
    for attribute, value in sorted(vars(module).items()):
        if attribute.startswith("_") or getattr(value, "__module__", None) != name:
            continue
        if not (inspect.isclass(value) or inspect.isfunction(value) or inspect.isbuiltin(value)):
            continue
        yield f"{name}.{attribute}\n\n{inspect.getdoc(value) or ''}"
        if inspect.isclass(value):
            for method_name, method in sorted(vars(value).items()):
                is_method = inspect.isfunction(method) or inspect.ismethoddescriptor(method)
                if is_method and not method_name.startswith("_"):
                    yield f"{name}.{attribute}.{method_name}\n\n{inspect.getdoc(method) or ''}"


def collect_documents(max_docs: int | None = None) -> list[str]:
    """Reference-manual topics, then standard-library docstrings of at least MIN_DOCSTRING_CHARS; deduplicated."""
    from pydoc_data.topics import topics

    documents = [topics[key].strip() for key in sorted(topics)]
    seen = set(documents)
    for module in _stdlib_modules():
        for document in _docstring_documents(module):
            body = document.split("\n\n", 1)[1]
            if len(body) >= MIN_DOCSTRING_CHARS and body not in seen:
                seen.add(body)
                documents.append(document)
    return documents[:max_docs]


def _write_atomically(path: str, text_lines: Iterator[str]) -> None:
    temporary = path + ".partial"
    with open(temporary, "w", encoding="utf-8") as stream:
        stream.writelines(text_lines)
    os.replace(temporary, path)


def write_corpus(documents: list[str], path: str) -> None:
    _write_atomically(path, (json.dumps({"text": document}, ensure_ascii=False) + "\n" for document in documents))


def corpus_texts(path: str) -> Iterator[str]:
    """The documents of a corpus write_corpus wrote, one at a time."""
    with open(path, encoding="utf-8") as stream:
        for line in stream:
            yield json.loads(line)["text"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/demo", help="output directory")
    parser.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size, special tokens included")
    parser.add_argument("--max-docs", type=int, help="keep only the first N documents (quick tests)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the outputs exist")
    args = parser.parse_args(argv)
    minimum_vocab = minimum_vocab_size("bpe")
    if args.vocab_size < minimum_vocab:
        parser.error(f"--vocab-size must be at least {minimum_vocab} (256 bytes + 2 special tokens)")
    if args.max_docs is not None and args.max_docs < 1:
        parser.error("--max-docs must be at least 1")
    return args


@one_line_errors("demo_corpus.py")
def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    os.makedirs(args.out, exist_ok=True)
    corpus_path = os.path.join(args.out, "corpus.jsonl")
    tokenizer_path = os.path.join(args.out, "tokenizer.json")
    data_prefix = output_prefix_for(os.path.join(args.out, "demo"), "text")
    redo = args.force
    if redo or not os.path.isfile(corpus_path):
        write_corpus(collect_documents(args.max_docs), corpus_path)
        redo = True
    if redo or not os.path.isfile(tokenizer_path):
        train_byte_level_bpe(corpus_texts(corpus_path), args.vocab_size, tokenizer_path)
        redo = True
    if redo or not (os.path.isfile(data_file_path(data_prefix)) and os.path.isfile(index_file_path(data_prefix))):
        tokenizer = HFTokenizer(tokenizer_path)
        preprocess_corpus(
            [corpus_path], os.path.join(args.out, "demo"), tokenizer, append_eod=True, show_progress=False
        )
        redo = True
    dataset = MMapIndexedDataset(data_prefix)
    print(
        f"demo corpus {data_prefix}: {len(dataset)} documents, {int(dataset.sizes.sum(dtype='int64'))} tokens, "
        f"{os.path.getsize(corpus_path) / 1e6:.2f} MB of text, {time.time() - start:.1f} s"
        + ("" if redo else " (up to date; --force rebuilds)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
