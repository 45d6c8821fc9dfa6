"""enwik8 (the first 10^8 bytes of an English Wikipedia dump), from a local copy, as the standard byte-level benchmark.

    python data_prep/enwik8.py --input /data/enwik8.zip --out data/enwik8

--input is the ``enwik8`` file or the ``enwik8.zip`` it is distributed in.
Nothing is downloaded. Every byte is one token (CharLevelTokenizer ids 0-255)
and the stream is cut, as is customary, into 90M training, 5M validation and
5M test bytes, each one document. Expect three datasets of 180/10/10 MB
(uint16). Writes enwik8_data.yml with train/valid/test_data_paths and
tokenizer_type CharLevelTokenizer.
"""

import argparse
import os
import sys
import zipfile

import numpy as np
from recipe import write_config_snippet

from megatron.data.indexed_dataset import (
    MMapIndexedDatasetBuilder,
    best_fitting_dtype,
    data_file_path,
    index_file_path,
)
from megatron.tokenizer import build_tokenizer

ENWIK8_BYTES = 100_000_000
SPLIT_BYTES = {"train": 90_000_000, "valid": 5_000_000, "test": 5_000_000}


def read_enwik8(path: str) -> bytes:
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            if "enwik8" not in archive.namelist():
                raise ValueError(f"{path} has no member named enwik8 (it has {archive.namelist()[:5]})")
            data = archive.read("enwik8")
    else:
        with open(path, "rb") as stream:
            data = stream.read()
    if len(data) != ENWIK8_BYTES:
        raise ValueError(f"{path}: enwik8 is {ENWIK8_BYTES} bytes, this is {len(data)}; is it the right file?")
    return data


def write_split(data: bytes, prefix: str) -> None:
    """One document of byte tokens, written under temporary names then renamed."""
    vocab_size = build_tokenizer("CharLevelTokenizer").vocab_size
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix) + ".partial", best_fitting_dtype(vocab_size))
    builder.add_item(np.frombuffer(data, dtype=np.uint8))
    builder.end_document()
    builder.finalize(index_file_path(prefix) + ".partial")
    for path in (data_file_path(prefix), index_file_path(prefix)):
        os.replace(path + ".partial", path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="enwik8 or enwik8.zip")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        data = read_enwik8(args.input)
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    settings, start = {}, 0
    for name, size in SPLIT_BYTES.items():
        prefix = os.path.join(args.out, f"enwik8_{name}_text_document")
        write_split(data[start : start + size], prefix)
        settings[f"{name}_data_paths"] = [prefix]
        start += size
    args.tokenizer_type = "CharLevelTokenizer"
    write_config_snippet(args.out, "enwik8", settings, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
