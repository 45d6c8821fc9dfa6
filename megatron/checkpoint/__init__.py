"""What every run needs of its checkpoints, whatever format their tensors are in: saving, publishing,
verifying, choosing, locking, pruning. Nothing here imports the model, a file format (megatron/formats/),
training, growth or inference; they import this.

    save.py               save_checkpoint of a live DeepSpeed engine (resumed by formats/deepspeed/resume.py)
    commit.py             staged write, then publish with `latest` once every rank's files are complete
    manifest.py           `manifest.json`: size and SHA-256 of every file
    selection.py          which checkpoint a run resumes from, verified before DeepSpeed reads it
    save_lock.py          one run per `save` directory
    pruning.py            keep_last_n_checkpoints
    safety.py             unpickling without running code
    rng_state.py          every generator of a rank
    work_split.py         hashing shared over the ranks
    output_directory.py   tools write into new or empty directories only
    growth_record.py      `growth.json`: what growth made of a model, carried by every later checkpoint
    parameter_state.py    one parameter's weight and moments, whole: the unit of the canonical training state
    engine_optimizer.py   where a live DeepSpeed engine keeps each parameter's master weight and Adam state
    background_writer.py  writing files on background threads
"""

