"""English text from the documentation Debian packages install: a corpus for the scaling study.

    python data_prep/debian_docs.py --out data/debian_docs [--vocab-size 4096] [--max-mb 40] [--workers 2]

The demo corpus (CPython's docs, ~1.3 MB) is too small for a study whose largest run reads millions of
tokens: it would repeat it for epochs. This recipe gathers, from this machine only (nothing is downloaded):

1. manual pages of sections 1, 5, 7 and 8 (commands, file formats, overviews, administration), rendered to
   plain text by man(1) without hyphenation or justification; at most MAX_PAGES_PER_FAMILY pages per family
   (the name before the first '_'), so a tool's thousands of generated pages (gcloud's) do not dominate;
2. README, FAQ, .txt, .md and .rst files of /usr/share/doc (gzipped or not), leaving out changelogs, release
   notes and other lists of changes;
3. licence texts: /usr/share/common-licenses and the packages' copyright files.

Each document must be mostly ASCII and read as English (a share of common English words); identical
documents are kept once. Sources are read in sorted order, so a machine with the same packages builds the same
corpus. It stops at --max-mb of text. Then, as data_prep/demo_corpus.py does: a byte-level BPE tokenizer trained
on the corpus and the tokenized dataset, each step skipped when its output exists (--force redoes them).
Writes OUT/corpus.jsonl, OUT/tokenizer.json, OUT/debian_docs_text_document.bin/.idx and OUT/debian_docs_data.yml.
"""

import argparse
import gzip
import hashlib
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from demo_corpus import corpus_texts, write_corpus
from recipe import tokenize_split, write_config_snippet

from megatron.data.indexed_dataset import MMapIndexedDataset, data_file_path, index_file_path
from megatron.data.preprocess import output_prefix_for
from megatron.tokenizer.hf_tokenizer import HFTokenizer
from megatron.tokenizer.train import minimum_vocab_size, train_byte_level_bpe

MAN_SECTIONS = ("1", "5", "7", "8")
MAX_PAGES_PER_FAMILY = 20
DOC_NAME = re.compile(r"^(readme|faq).*|.*\.(txt|md|rst)$")
NOT_PROSE = re.compile(r"change|news|history|release|status|thanks|authors|todo", re.IGNORECASE)
ENGLISH_WORDS = frozenset("the of and to a in is for that it be as with are this by or on not from you can an if "
                          "when which file will used use".split())
MIN_ENGLISH_SHARE = 0.12
MIN_CHARS = 300
MAX_DOCUMENT_CHARS = 200_000  # a few data-like files (font tables, protocol dumps) would otherwise weigh in
NAME = "debian_docs"


def _man_pages(root: Path) -> list[Path]:
    """English manual pages of MAN_SECTIONS, sorted, at most MAX_PAGES_PER_FAMILY per family."""
    pages = sorted(path for section in MAN_SECTIONS for path in (root / f"man{section}").glob("*")
                   if path.is_file() and not path.is_symlink())
    families: Counter[str] = Counter()
    kept = []
    for page in pages:
        family = page.name.split("_")[0]
        families[family] += 1
        if families[family] <= MAX_PAGES_PER_FAMILY:
            kept.append(page)
    return kept


def _render(page: Path) -> str:
    """A manual page as plain text (man's own renderer: no formatting, hyphenation or justification)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8", "MANWIDTH": "80"}
    result = subprocess.run(["man", "--nh", "--nj", "-l", str(page)], capture_output=True, env=env, timeout=60)
    return result.stdout.decode("utf-8", errors="replace") if result.returncode == 0 else ""


def _read_text(path: Path) -> str:
    """The file's text (gunzipped), or '' when it is binary or not UTF-8."""
    try:
        data = gzip.open(path).read() if path.name.endswith(".gz") else path.read_bytes()
        return "" if b"\0" in data else data.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        return ""


def _doc_files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*")):
        name = path.name.lower().removesuffix(".gz")
        if path.is_file() and not path.is_symlink() and DOC_NAME.match(name) and not NOT_PROSE.search(name):
            yield path


def _licence_files(doc_root: Path, licences: Path) -> Iterator[Path]:
    yield from sorted(path for path in licences.glob("*") if path.is_file())
    yield from sorted(path for path in doc_root.glob("*/copyright") if path.is_file())


def _clean(text: str) -> str:
    """Trailing spaces and runs of blank lines and spaces removed (man's indentation kept as one level)."""
    lines = [re.sub(r"(?<=\S) {2,}", " ", line.rstrip()) for line in text.replace("\r\n", "\n").splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def is_english(text: str) -> bool:
    """Mostly ASCII, and common English words make up a fair share of its words."""
    if sum(char.isascii() for char in text) < 0.97 * len(text):
        return False
    words = re.findall(r"[a-z]+", text.lower())
    return bool(words) and sum(word in ENGLISH_WORDS for word in words) >= MIN_ENGLISH_SHARE * len(words)


def collect_documents(max_chars: int, workers: int, man_root: Path = Path("/usr/share/man"),
                      doc_root: Path = Path("/usr/share/doc"),
                      licences: Path = Path("/usr/share/common-licenses")) -> tuple[list[str], Counter]:
    """The corpus's documents in order, and how many came from each source."""
    documents, seen, counts, total = [], set(), Counter(), 0

    def add(source: str, text: str) -> bool:
        nonlocal total
        text = _clean(text)
        digest = hashlib.sha256(text.encode()).digest()
        if len(text) < MIN_CHARS or len(text) > MAX_DOCUMENT_CHARS or digest in seen or not is_english(text):
            return total < max_chars
        seen.add(digest)
        documents.append(text)
        counts[source] += 1
        total += len(text)
        return total < max_chars

    with ThreadPoolExecutor(max(1, workers)) as pool:
        for text in pool.map(_render, _man_pages(man_root)):
            if not add("manual pages", text):
                return documents, counts
    for path in _doc_files(doc_root):
        if not add("/usr/share/doc", _read_text(path)):
            return documents, counts
    for path in _licence_files(doc_root, licences):
        if not add("licences", _read_text(path)):
            break
    return documents, counts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=f"data/{NAME}", help="output directory (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary, special tokens included")
    parser.add_argument("--max-mb", type=float, default=40.0, help="stop collecting at this much text (MB)")
    parser.add_argument("--workers", type=int, default=max(1, os.cpu_count() or 1), help="man renderers, tokenizers")
    parser.add_argument("--force", action="store_true", help="rebuild even when the outputs exist")
    args = parser.parse_args(argv)
    if args.vocab_size < minimum_vocab_size("bpe"):
        parser.error(f"--vocab-size must be at least {minimum_vocab_size('bpe')} (256 bytes + 2 special tokens)")
    args.no_progress = True  # for recipe.tokenize_split
    args.tokenizer_type, args.merge_file = "HFTokenizer", None
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start, out = time.time(), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus, args.vocab_file = out / "corpus.jsonl", str(out / "tokenizer.json")
    prefix = output_prefix_for(str(out / NAME), "text")
    redo = args.force
    if redo or not corpus.is_file():
        documents, counts = collect_documents(int(args.max_mb * 1e6), args.workers)
        if not documents:
            print(f"{sys.argv[0]}: error: no English documentation found on this machine", file=sys.stderr)
            return 1
        write_corpus(documents, str(corpus))
        print("documents: " + ", ".join(f"{count} from {source}" for source, count in counts.items()))
        redo = True
    if redo or not os.path.isfile(args.vocab_file):
        train_byte_level_bpe(corpus_texts(corpus), args.vocab_size, args.vocab_file)
        redo = True
    if redo or not (os.path.isfile(data_file_path(prefix)) and os.path.isfile(index_file_path(prefix))):
        tokenize_split([str(corpus)], str(out), NAME, HFTokenizer(args.vocab_file), args)
        write_config_snippet(str(out), NAME, {"data_path": os.path.abspath(prefix)}, args)
        redo = True
    dataset = MMapIndexedDataset(prefix)
    print(f"{NAME} corpus {prefix}: {len(dataset)} documents, {int(dataset.sizes.sum(dtype='int64'))} tokens, "
          f"{corpus.stat().st_size / 1e6:.2f} MB of text, {time.time() - start:.1f} s"
          + ("" if redo else " (up to date; --force rebuilds)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
