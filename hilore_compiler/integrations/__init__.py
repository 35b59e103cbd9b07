"""Thin adapters that run other trainers' actor updates through hilore.

- ``trl``: ``HiLoReGRPOTrainer``, TRL's ``GRPOTrainer`` with the training
  forward compiled by the hilore backend and exposure-ordered microbatches
  (``pip install -e ".[trl]"``).
- ``batching``: fixed shapes and exposure-ordered microbatches of a TRL
  generation batch (no trl import).
- ``verl``: ``HiLoReFSDPEngine``, verl's FSDP2 engine with the decoder blocks
  compiled in place by the hilore backend and exposure-ordered micro-batches,
  selected by ``HiLoReFSDPEngineConfig`` (``pip install -e ".[verl]"``).
- ``slots``: order of a rank's micro-batches and the slots every rank skips
  (no verl import).
- ``toy``: a tiny random policy, a local tokenizer and a verifiable task, for
  the example and tests (no downloads).

Each adapter imports its framework on import, so ``import hilore_compiler``
never needs it.
"""
