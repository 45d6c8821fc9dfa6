"""Token sequences made from a seed, the same on every machine: the data of the sections that train.

Why not the run's own data: the numerics and throughput sections need the same samples in every layout and no
index build over a corpus of terabytes, and the golden curve must not depend on files. A fixed random Markov
chain (each token followed by one of `successors` tokens) is learnable, so a loss curve drops in a few steps
and a wrong gradient shows. Built with NumPy's PCG64 from the seed and the sample's index: the same ids on any
platform, for any order of access.
"""

from __future__ import annotations

import numpy as np
from torch.utils.data import Dataset


class MarkovTokens(Dataset):
    """`length` samples of `seq_length + 1` token ids below `vocab_size`, as megatron/training/data.py's batch
    iterator reads them ({"text": ids})."""

    def __init__(self, length: int, seq_length: int, vocab_size: int, seed: int, successors: int = 4):
        self.length, self.seq_length, self.vocab_size, self.seed = length, seq_length, vocab_size, seed
        table = np.random.Generator(np.random.PCG64(seed))
        self.successors = table.integers(0, vocab_size, size=(vocab_size, successors), dtype=np.int64)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        draw = np.random.Generator(np.random.PCG64([self.seed, index]))
        choices = draw.integers(0, self.successors.shape[1], size=self.seq_length)
        ids = np.empty(self.seq_length + 1, dtype=np.int64)
        ids[0] = draw.integers(0, self.vocab_size)
        for position, choice in enumerate(choices):
            ids[position + 1] = self.successors[ids[position], choice]
        return {"text": ids}
