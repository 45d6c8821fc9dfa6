"""deepy.py's checks before launch (megatron/launch/preflight.py), called directly: what they refuse and what they
note, on files made here, without a launch."""

from __future__ import annotations

from megatron.config import load_config
from megatron.launch.preflight import preflight_notes
from tests.conftest import REPO
from tests.test_dataset_check import write_dataset

TINY = REPO / "tests" / "tiny.yml"


def test_a_train_split_that_training_reads_many_times_gets_a_note(tmp_path):
    """Issue 42: split=1,49,50 and 300 iterations read the train split 62 times, and the run started without a
    word. 100 documents of 100 tokens, half of them train's: 5,000 tokens; a global batch is 16 x 64 tokens."""
    prefix = write_dataset(str(tmp_path / "corpus_text_document"), [[7] * 100] * 100)
    cfg = load_config([TINY], [f"data_path={prefix}", "split='50,25,25'", "train_iters=300"], world_size=2)
    assert preflight_notes(cfg) == [
        f"data_path = {prefix!r} with split = '50,25,25' gives the train split 50 documents of 5,000 tokens, which "
        "train_iters = 300 reads 62 times (300 x 16 sequences of 64 tokens); if that is not intended, give train a "
        "larger share of split or use more text"]
    few = load_config([TINY], [f"data_path={prefix}", "split='50,25,25'", "train_iters=10"], world_size=2)
    assert preflight_notes(few) == []  # 3 epochs
