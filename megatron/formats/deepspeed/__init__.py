"""This framework's checkpoints: DeepSpeed's model and optimizer files in any tensor/pipeline/ZeRO layout, plus
the grow tool's layout-independent optimizer state.

    files.py, model_files.py   model files as per-tensor-rank state dicts under TokenFormerModel's names
    optimizer_files.py         Adam's state in DeepSpeed's ZeRO files
    names.py                   module parameter names (pipeline, frozen rows) -> TokenFormerModel names
    reader.py                  a checkpoint's full training state, entry by entry (ParameterState)
    writer.py                  the same into any target layout, published atomically
    portable.py                the writer's layout-independent optimizer state
    weights.py                 the whole model's weights, verified (the registry's reader)
    compatibility.py           does a checkpoint fit the run resuming it
    resume.py, restore.py, engine_state.py
                               resuming a live engine: DeepSpeed's files, then the portable state
"""
