"""Fuzzing preprocess inputs: broken JSON, wrong types, invalid UTF-8, huge lines, empty and damaged files.

Every generated line knows what it should become (a document or a skip), so a run must produce exactly the
good documents, in order, and count every bad line as skipped; a damaged compressed file must stop the run
with an error naming it and leave no output. Nothing else (no crash, no silently different dataset) passes.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.data.preprocess import output_prefix_for, preprocess_corpus
from megatron.tokenizer import build_tokenizer

CHAR_LEVEL = build_tokenizer("CharLevelTokenizer")
texts = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)
json_values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.lists(st.integers(), max_size=2),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


def document(line: str | bytes, text: str) -> tuple[bytes, str]:
    return (line.encode() if isinstance(line, str) else line), text


def skip(line: str | bytes) -> tuple[bytes, None]:
    return (line.encode() if isinstance(line, str) else line), None


good_lines = st.builds(
    lambda text, ascii_only, extra: document(json.dumps({**extra, "text": text}, ensure_ascii=ascii_only), text),
    texts, st.booleans(), st.dictionaries(st.sampled_from(["id", "meta", "title"]), json_values, max_size=2))
huge_lines = st.integers(2**16, 2**20).map(
    lambda n: document(json.dumps({"text": "é" * n}, ensure_ascii=False), "é" * n))
broken_json = good_lines.flatmap(lambda pair: st.integers(1, len(pair[0]) - 1).map(lambda cut: skip(pair[0][:cut])))
invalid_utf8 = good_lines.flatmap(
    lambda pair: st.integers(0, len(pair[0])).map(lambda at: skip(pair[0][:at] + b"\xff" + pair[0][at:])))
bad_lines = st.one_of(
    json_values.map(lambda value: skip(json.dumps({"text": value}))),   # wrong type
    texts.map(lambda text: skip(json.dumps({"title": text}))),          # missing key
    json_values.map(lambda value: skip(json.dumps([value]))),           # not an object
    st.sampled_from(["", "   ", "\t", '{"text": ""}', '{"text": "a\\ud800b"}', '{"text": NaN}']).map(skip),
    broken_json, invalid_utf8)
lines = st.one_of(good_lines, good_lines, bad_lines, huge_lines)


@st.composite
def corpus_files(draw) -> tuple[str, bytes, list[tuple[bytes, str | None]]]:
    """(suffix, file content, its lines) for a plain or gzip-compressed JSON-lines file."""
    records = draw(st.lists(lines, max_size=6))
    newline = draw(st.sampled_from([b"\n", b"\r\n"]))
    # The last line may lack its newline, unless it is empty (it would then not be a line at all).
    last_newline = records and (records[-1][0] == b"" or draw(st.booleans()))
    content = newline.join(line for line, _ in records) + (newline if last_newline else b"")
    if draw(st.booleans()):
        return ".jsonl.gz", gzip.compress(content), records
    return ".jsonl", content, records


damaged_gzip = st.one_of(
    st.binary(min_size=1, max_size=40),
    corpus_files().filter(lambda f: f[0] == ".jsonl.gz").flatmap(
        lambda f: st.integers(1, len(f[1]) - 1).map(lambda cut: f[1][:cut])))


@settings(max_examples=80, deadline=None)
@given(st.lists(corpus_files(), min_size=1, max_size=3), st.none() | st.tuples(st.integers(0, 3), damaged_gzip),
       st.booleans(), st.integers(1, 4))
def test_only_good_documents_come_out_and_every_bad_line_is_reported(files, damage, append_eod, chunk_size):
    with tempfile.TemporaryDirectory() as directory:
        paths = []
        for index, (suffix, content, _) in enumerate(files):
            paths.append(Path(directory) / f"part{index}{suffix}")
            paths[-1].write_bytes(content)
        if damage is not None:
            damaged = Path(directory) / "damaged.jsonl.gz"
            damaged.write_bytes(damage[1])
            paths.insert(min(damage[0], len(paths)), damaged)
        prefix = str(Path(directory) / "out")
        try:
            stats = preprocess_corpus([str(p) for p in paths], prefix, CHAR_LEVEL, append_eod=append_eod,
                                      chunk_size=chunk_size, show_progress=False)
        except OSError as error:
            assert damage is not None and f"cannot read input {damaged}" in str(error), error
            assert sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("out")) == []
            return
        except ValueError as error:  # no good document anywhere: an error, and no output
            assert str(error).startswith(f"no documents in {paths[0]}"), error
            assert not any(text is not None for _, _, file_records in files for _, text in file_records)
            assert sorted(p.name for p in Path(directory).iterdir() if p.name.startswith("out")) == []
            return
        assert damage is None, "a damaged compressed file must not pass"
        records = [record for _, _, file_records in files for record in file_records]
        eod = [CHAR_LEVEL.eod] if append_eod else []
        expected = [list(text.encode()) + eod for _, text in records if text is not None]
        dataset = MMapIndexedDataset(output_prefix_for(prefix, "text"))
        assert [dataset[i].tolist() for i in range(len(dataset))] == expected
        assert (stats.documents, stats.skipped) == (len(expected), len(records) - len(expected))
