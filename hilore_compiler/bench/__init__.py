"""``hilore bench``: the actor update of every method side by side, as DESIGN.md "Measuring" says.

Modules in the order a run uses them:

- ``measure``: time and peak memory of one step (CPU: VmHWM - VmRSS with the
  high-water mark reset; CUDA: max_memory_allocated), gradient fidelity.
- ``methods``: how each method compiles the policy (store-all, GC, selective
  AC, PyTorch's memory-budget partitioner, uniform int8, HiLoRe).
- ``worker``: one process per method, driven over a pipe: the fixed batch,
  the GRPO actor step, setup and measured steps.
- ``search``: bisection of PyTorch's activation_memory_budget to HiLoRe's peak.
- ``runner``: spawns the workers, sets them up, alternates them in rounds.
- ``report``: statistics, the paper's targets, table, JSON and PNG.
"""
