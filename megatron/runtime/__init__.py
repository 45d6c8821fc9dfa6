"""A rank's runtime, one for training and inference (train.py, generate.py, eval.py):

    entry.run_rank(main, __doc__)               the config deepy.py passed, main(cfg), errors once, exit
    process_group.initialize_distributed(cfg)   process group, device, parallel groups, seed

settings.RuntimeSettings names the keys they read; collectives.py holds what ranks share (the output rank, tensor
rank 0's tokens). deepy.py's side is megatron/launch, which the ranks never import. Nothing is imported here, so
that a module taking only collectives.py does not load the rest.
"""
