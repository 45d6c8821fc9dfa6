"""A tokenizer and a training corpus made on the spot, for benchmarks that run the framework's own data path on
a machine without data or network (benchmarks/gpu_check.py, benchmarks/framework_step.py)."""

from __future__ import annotations

from pathlib import Path

GPT_NEOX_VOCAB = 50277  # GPT-NeoX-20B's token count, which the paper configs' vocabulary is padded from


def write_training_data(folder: Path, vocab: int = GPT_NEOX_VOCAB, documents: int = 400) -> tuple[Path, Path]:
    """(dataset prefix, tokenizer.json) in `folder`: a word-level tokenizer of `vocab` tokens and `documents`
    documents of 1,024-8,191 tokens that follow a learnable rule (each token a document-specific step from the
    last, mostly), so the loss falls. Written once: a folder that holds them already is reused."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatron.data.indexed_dataset import (MMapIndexedDatasetBuilder, best_fitting_dtype, data_file_path,
                                               index_file_path)

    prefix = str(folder / "synthetic_text_document")
    if (folder / "tokenizer.json").exists():
        return Path(prefix), folder / "tokenizer.json"
    folder.mkdir(parents=True, exist_ok=True)
    words = {f"w{i}": i for i in range(vocab - 1)} | {"<|endoftext|>": vocab - 1}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    rng = np.random.default_rng(0)
    builder = MMapIndexedDatasetBuilder(data_file_path(prefix), dtype=best_fitting_dtype(vocab))
    for length in rng.integers(1024, 8192, size=documents):
        steps = np.where(rng.random(length) < 0.9, rng.integers(1, 64), rng.integers(0, vocab - 1, size=length))
        builder.add_item((rng.integers(0, vocab - 1) + np.cumsum(steps)) % (vocab - 1))
        builder.end_document()
    builder.finalize(index_file_path(prefix))
    tokenizer.save(str(folder / "tokenizer.json"))  # last: its presence says the folder is complete
    return Path(prefix), folder / "tokenizer.json"
