"""Thin adapters that run other trainers' actor updates through hilore.

- ``trl``: ``HiLoReGRPOTrainer``, TRL's ``GRPOTrainer`` with the training
  forward compiled by the hilore backend and exposure-ordered microbatches
  (``pip install -e ".[trl]"``).
- ``batching``: fixed shapes and the microbatch slots of a TRL generation
  batch, cut by ``grpo.packing`` (no trl import).
- ``verl``: ``HiLoReFSDPEngine``, verl's FSDP2 engine with the decoder blocks
  compiled in place by the hilore backend and exposure-ordered micro-batches,
  selected by ``HiLoReFSDPEngineConfig`` (``pip install -e ".[verl]"``);
  zero-exposure samples dropped before micro-batches are formed.
- ``verl_packing``: when verl's update may drop zero samples, verl's budget,
  and its metrics weighted to the whole batch.
- ``slots``: order of a rank's micro-batches and the slots every rank skips
  (no verl import).
- ``toy``: a tiny random policy, a local tokenizer and a verifiable task, for
  the example and tests (no downloads).

Each adapter imports its framework on import, so ``import hilore_compiler``
never needs it.
"""
