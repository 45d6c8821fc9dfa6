"""Everything about checkpoint files: writing, publishing, verifying, choosing and reading them, in every
layout this project meets. Nothing here imports training, growth or inference; they import this.

A training run's checkpoints (DeepSpeed's layout plus ours, docs/reliability.md)
    save_load.py          save_checkpoint / load_checkpoint of a live DeepSpeed engine
    commit.py             staged write, then publish with `latest` once every rank's files are complete
    manifest.py           `manifest.json`: size and SHA-256 of every file
    selection.py          which checkpoint a run resumes from, verified before DeepSpeed reads it
    safety.py             unpickling without running code; refusing a model that does not fit
    rng_state.py          every generator of a rank
    work_split.py         hashing shared over the ranks
    output_directory.py   tools write into new or empty directories only
    growth_record.py      `growth.json`: what growth made of a model, carried by every later checkpoint

Reading and writing the files, in any tensor/pipeline/ZeRO layout (the grow tool, resume, inference)
    deepspeed_files.py    model files as per-tensor-rank state dicts under TokenFormerModel's names
    model_files.py        one entry of one tensor rank at a time, memory-mapped
    deepspeed_optimizer.py, engine_optimizer.py
                          Adam's state in DeepSpeed's files, and where a live engine keeps it
    names.py              module parameter names (pipeline, frozen rows) -> TokenFormerModel names
    parameter_state.py    one parameter's weight and moments, whole
    reader.py             a checkpoint's full training state, entry by entry
    writer.py             the same into any target layout, published atomically (background_writer.py)
    portable.py           the writer's layout-independent optimizer state
    portable_restore.py, engine_state.py
                          resuming such a checkpoint into any data-parallel size and ZeRO stage
    tensor_parallel_layout.py   which entries tensor parallelism splits, merge and split
    weight_files.py       consolidated exports: .bin/.pt, .safetensors, sharded with an index
    official_layout.py    the official release's `pytorch_model.bin` names
"""
