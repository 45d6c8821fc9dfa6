"""What deepy.py and the ranks it starts share on a machine, used by both sides (megatron/launch, megatron/runtime)
and importing neither: deepy.py's identity, which its ranks watch (orphan_watch), DeepSpeed's compiled-op cache
(extension_cache), metrics.jsonl's whole-line appends (metrics_file).
"""
