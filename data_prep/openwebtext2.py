"""OpenWebText2, from a local copy, into one dataset split by the `split` config key.

    tar -xf openwebtext2.jsonl.zst.tar -C /data/openwebtext2      # the released archive, unpacked once
    python data_prep/openwebtext2.py --input /data/openwebtext2 --out data/owt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

--input is the directory of the archive's monthly .jsonl.zst files (records
{"text": ..., "meta": {...}}); they are read in sorted order. Nothing is
downloaded. What to expect: about 17M documents, 65 GB of text and ~16B GPT-2
tokens, a ~32 GB owt2_text_document.bin (uint16) with a ~340 MB .idx.

Writes owt2_data.yml with data_path and split to add to the training config.
"""

import argparse
import glob
import os
import sys

from recipe import add_tokenizer_arguments, tokenize_split, tokenizer_from, write_config_snippet


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="directory of OpenWebText2's .jsonl.zst files")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--split", default="969, 30, 1", help="train, validation, test proportions")
    add_tokenizer_arguments(parser, default_type="GPT2BPETokenizer")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if os.path.isfile(args.input) and args.input.endswith(".tar"):
            raise ValueError(f"--input {args.input} is the release archive; unpack it (tar -xf) and pass the directory")
        inputs = sorted(glob.glob(os.path.join(args.input, "**", "*.jsonl.zst"), recursive=True))
        if not inputs:
            raise FileNotFoundError(f"--input {args.input} holds no .jsonl.zst files of OpenWebText2")
        prefix = tokenize_split(inputs, args.out, "owt2", tokenizer_from(args), args)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    write_config_snippet(args.out, "owt2", {"data_path": prefix, "split": f'"{args.split}"'}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
