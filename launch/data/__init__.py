"""Training data: corpus files, tokenizers, packing into rows, and each row's place in the run.

The launch side (run.sh's checks, `prepare-data`) and the rank programs read data through this one room, so the
check before launch and the ranks see the same documents, the same damaged records skipped, and the same rows.
No torch here; Megatron-Core's indexed datasets are opened by launch/torchtools/indexed.py.
"""
