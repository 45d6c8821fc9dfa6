"""The corpus recipes on tiny local copies in the real layouts and formats; nothing is downloaded."""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import yaml
import zstandard

from megatron.data.indexed_dataset import MMapIndexedDataset

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAR_LEVEL = ["--tokenizer-type", "CharLevelTokenizer", "--workers", "1", "--no-progress"]


def write_zst_jsonl(path, texts):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lines = "".join(json.dumps({"text": text, "meta": {"pile_set_name": "Pile-CC"}}) + "\n" for text in texts)
    with open(path, "wb") as stream:
        stream.write(zstandard.ZstdCompressor(level=3).compress(lines.encode()))


def run_recipe(name, *args):
    return subprocess.run(
        [sys.executable, f"data_prep/{name}.py", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def document_count(prefix):
    return len(MMapIndexedDataset(prefix))


def test_pile_all_shards_to_train_valid_test(tmp_path):
    pile = tmp_path / "pile"
    for shard in range(30):
        write_zst_jsonl(str(pile / "train" / f"{shard:02d}.jsonl.zst"), [f"shard {shard} doc {i}" for i in range(2)])
    write_zst_jsonl(str(pile / "val.jsonl.zst"), ["validation text"])
    write_zst_jsonl(str(pile / "test.jsonl.zst"), ["test text", "more test text"])
    result = run_recipe("pile", "--input", str(pile), "--out", str(tmp_path / "out"), *CHAR_LEVEL)
    assert result.returncode == 0, result.stderr
    snippet = yaml.safe_load((tmp_path / "out" / "pile_data.yml").read_text())
    assert snippet["tokenizer_type"] == "CharLevelTokenizer"
    counts = [document_count(snippet[f"{split}_data_paths"][0]) for split in ("train", "valid", "test")]
    assert counts == [60, 1, 2]
    train = MMapIndexedDataset(snippet["train_data_paths"][0])
    assert bytes(train[59][:-1].astype(np.uint8)) == b"shard 29 doc 1"


def test_pile_names_missing_shards(tmp_path):
    write_zst_jsonl(str(tmp_path / "pile" / "train" / "00.jsonl.zst"), ["only one shard"])
    result = run_recipe("pile", "--input", str(tmp_path / "pile"), "--out", str(tmp_path / "out"), *CHAR_LEVEL)
    assert result.returncode == 1
    assert "train/01.jsonl.zst" in result.stderr and "val.jsonl.zst" in result.stderr


def test_pile_deduplicated_variant(tmp_path):
    for shard in range(3):
        write_zst_jsonl(str(tmp_path / "dedup" / f"part-{shard}.jsonl.zst"), [f"dedup {shard}"])
    result = run_recipe(
        "pile", "--deduplicated", "--input", str(tmp_path / "dedup"), "--out", str(tmp_path / "out"), *CHAR_LEVEL
    )
    assert result.returncode == 0, result.stderr
    snippet = yaml.safe_load((tmp_path / "out" / "pile_data.yml").read_text())
    assert list(snippet)[:1] == ["train_data_paths"] and "valid_data_paths" not in snippet
    assert document_count(snippet["train_data_paths"][0]) == 3


def test_openwebtext2(tmp_path):
    for month in ("2019-01", "2019-02"):
        write_zst_jsonl(str(tmp_path / "owt2" / f"RS_{month}.jsonl.zst"), [f"{month} post {i}" for i in range(3)])
    result = run_recipe("openwebtext2", "--input", str(tmp_path / "owt2"), "--out", str(tmp_path / "out"), *CHAR_LEVEL)
    assert result.returncode == 0, result.stderr
    snippet = yaml.safe_load((tmp_path / "out" / "owt2_data.yml").read_text())
    assert snippet["split"] == "969, 30, 1" and document_count(snippet["data_path"]) == 6
    (tmp_path / "owt2.tar").write_bytes(b"")
    refused = run_recipe("openwebtext2", "--input", str(tmp_path / "owt2.tar"), "--out", str(tmp_path), *CHAR_LEVEL)
    assert refused.returncode == 1 and "unpack it" in refused.stderr


def test_enwik8_byte_tokens_split_90_5_5(tmp_path):
    data = (b"<page>enwik8 \xc3\xa9t\xc3\xa9</page>\n" * 4_000_000)[:100_000_000]
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("enwik8", data)
    result = run_recipe("enwik8", "--input", str(tmp_path / "enwik8.zip"), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    snippet = yaml.safe_load((tmp_path / "out" / "enwik8_data.yml").read_text())
    assert snippet["tokenizer_type"] == "CharLevelTokenizer"
    sizes = [int(MMapIndexedDataset(snippet[f"{s}_data_paths"][0]).sizes.sum()) for s in ("train", "valid", "test")]
    assert sizes == [90_000_000, 5_000_000, 5_000_000]
    valid = MMapIndexedDataset(snippet["valid_data_paths"][0])
    assert bytes(valid.get(0, 0, 40).astype(np.uint8)) == data[90_000_000:90_000_040]
    (tmp_path / "short").write_bytes(b"too short")
    refused = run_recipe("enwik8", "--input", str(tmp_path / "short"), "--out", str(tmp_path / "o"))
    assert refused.returncode == 1 and "enwik8 is 100000000 bytes, this is 9" in refused.stderr


@pytest.mark.parametrize("recipe", ["pile", "openwebtext2", "enwik8"])
def test_recipes_say_what_to_expect(recipe):
    result = run_recipe(recipe, "--help")
    assert result.returncode == 0 and "expect" in result.stdout.lower() and "downloaded" in result.stdout
