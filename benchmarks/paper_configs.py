"""The paper configs (configs/150M.yml ... 1-5B.yml) as the model sees them, for the benchmarks and tests.

Each YAML file is read by the config loader (validated as a training run would be); the vocabulary is
GPT-NeoX-20B's, padded as a run pads it, because the configs leave `padded_vocab_size` for the tokenizer
to fill in when a run starts.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

from megatron.model import TokenFormerArgs

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
PAPER_CONFIGS = ("150M", "450M", "900M", "1-5B")
GPT_NEOX_20B_VOCAB = 50277  # tokens in the GPT-NeoX-20B tokenizer.json the configs name


def paper_args(name: str, **overrides: Any) -> TokenFormerArgs:
    """configs/`name`.yml as TokenFormerArgs (e.g. "1-5B"); `overrides` replace any field (num_layers=2)."""
    from megatron.config import load_config  # imports DeepSpeed: only when a config is read
    from megatron.tokenizer.build import pad_vocab_size

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed, imported by config checks, logs to stdout
        cfg = load_config(CONFIG_DIR / f"{name}.yml")
    vocab = cfg.padded_vocab_size or pad_vocab_size(GPT_NEOX_20B_VOCAB, cfg.make_vocab_size_divisible_by,
                                                    cfg.model_parallel_size)
    return TokenFormerArgs.from_config(cfg, **{"padded_vocab_size": vocab, **overrides})
