"""Model file formats, each an adapter to and from one canonical state.

The canonical state is the whole model (no tensor-parallel blocks, no pipeline numbering) under
TokenFormerModel's state-dict names (`layers.{i}.attention.query.key_param_tokens`, ...; the Pattentions:
megatron/model/spec.py), with the Config that describes it: a `dict[str, Tensor]` of weights, or, where the
training state goes along (grow, re-shard, resume), one `checkpoint.parameter_state.ParameterState` (weight,
Adam's moments) per entry. Growth, export, import and resume all pass through it; no format converts to
another directly.

    deepspeed/         this framework's checkpoints: DeepSpeed's TP/PP/ZeRO files plus the grow tool's
                       layout-independent optimizer state (reader.py reads any layout entry by entry,
                       writer.py writes any layout, resume.py resumes a live engine)
    tensor_parallel.py which entries tensor parallelism splits; merging t blocks, splitting into t
    consolidated.py    plain weight files (.bin/.pt, .safetensors, sharded with an index) with config.json
    official.py        the official release's pytorch_model.bin (sequential.N.<name>)
    huggingface.py     a transformers model directory (model.safetensors, config.json, remote code)

registry.py is what a new format implements: a `WeightFormat` (recognise a path, read it into the canonical
state and its Config, write the canonical state), registered in `FORMATS`; `read_state` picks the reader.
"""
