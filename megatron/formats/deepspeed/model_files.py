"""The weights in a checkpoint's DeepSpeed model files, one entry of one tensor rank at a time.

    mp_rank_XX_model_states.pt           without a pipeline: tensor rank XX's state dict under 'module';
                                         with one: no weights (XX = stage · model_parallel_size + tensor rank)
    layer_II-model_XX-model_states.pt    with a pipeline: layer II's entries (model/pipeline.py's numbering)
                                         of tensor rank XX

Every file is memory-mapped: opening it reads its pickled structure, an entry's data is read from disk when
it is used, and nothing stays in memory but what the caller keeps.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from megatron.checkpoint.safety import load_checkpoint_file
from megatron.formats.deepspeed.files import (
    LAYER_FILE,
    MODEL_FILE,
    check_ranks,
    files_by_rank,
)
from megatron.model.pipeline import model_parameter_name


class ModelFiles:
    """Where each TokenFormerModel entry of each tensor rank is, and the header (mp_rank) files."""

    def __init__(self, tag_dir: Path, num_layers: int) -> None:
        headers = files_by_rank(tag_dir, MODEL_FILE)
        if not headers:
            raise FileNotFoundError(f"{tag_dir} holds no mp_rank_XX_model_states.pt: it is not a checkpoint")
        check_ranks(tag_dir, [rank for (rank,) in headers])
        self.headers = [load_checkpoint_file(headers[(rank,)]) for rank in range(len(headers))]
        self._entries: dict[str, dict[int, Tensor]] = {}
        layer_files = files_by_rank(tag_dir, LAYER_FILE)
        if layer_files:
            self.tensor_ranks = check_ranks(tag_dir, [rank for _, rank in layer_files])
            for (layer, rank), path in sorted(layer_files.items()):
                for key, tensor in load_checkpoint_file(path).items():
                    self._entries.setdefault(model_parameter_name(layer, key, num_layers), {})[rank] = tensor
        else:
            self.tensor_ranks = len(self.headers)
            for rank, header in enumerate(self.headers):
                for name, tensor in (header.get("module") or {}).items():
                    self._entries.setdefault(name, {})[rank] = tensor

    def names(self) -> set[str]:
        return set(self._entries)

    def block(self, name: str, tensor_rank: int) -> Tensor:
        """Tensor rank `tensor_rank`'s block of entry `name` as saved (a view of the mapped file)."""
        return self._entries[name][tensor_rank]
