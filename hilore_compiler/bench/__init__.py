"""``hilore bench``: the actor update of every method side by side, as DESIGN.md "Measuring" says.

Modules in the order a run uses them:

- ``measure``: time and peak memory of one step (CPU: VmHWM - VmRSS with the
  high-water mark reset; CUDA: max_memory_allocated), gradient fidelity.
- ``checkpointing``: how the checkpointing methods wrap the decoder layers
  (GC, the selective ACs, GC with int8 checkpoints).
- ``methods``: how each method compiles the policy (store-all, GC, selective
  AC, PyTorch's memory-budget partitioner, uniform int8, HiLoRe and its
  one-bucket, exposure-blind variant).
- ``plans``: what a hilore method planned, as its worker reads it: the
  bucket a batch runs under, the plan's record and digests, a step's cosine bound.
- ``peers``: the planners that ship with PyTorch (activation_memory_budget's
  solvers and estimators, Inductor's fp8 saved activations) and their knobs.
- ``offload``, ``sac_milp``: the peers that run on CUDA only: GC with its
  checkpoints in host memory, selective AC saving to the host
  (``MUST_CPU_OFFLOAD``), PyTorch's ``sac_milp`` over its own estimators.
- ``paper`` (a package): the ``paper`` method, the paper authors' reference
  runtime in our code: a decoder layer's saved tensors kept, kept with one in
  fp8, or replayed; its installation on the layers; the per-step dynamic
  program; profiling; risk calibration; the method that joins them.
- ``worker``: one process per method, driven over a pipe: the fixed batch,
  the GRPO actor step, setup and measured steps.
- ``search``: a grid over a peer's knob (activation_memory_budget, fp8's
  size threshold): the fastest probe whose peak fits HiLoRe's.
- ``process``: a worker process and its pipe; the environment it runs in.
- ``launcher``: starts a method's workers: set-up and peak, then the timed one.
- ``rounds``: a method's figures as a run goes; alternating, counted rounds.
- ``runner``: the step bench: every method set up in turn, rounds, fidelity.
- ``paired``: per-round paired speed ratios, geometric mean and 95% t-interval.
- ``peer_table``: from a frontier result, HiLoRe's paired ratio over every other
  method at every ceiling (``python -m hilore_compiler.bench.peer_table FILE``).
- ``report``: statistics, the paper's targets, table and JSON.
- ``plot``: the PNG, throughput against peak memory.
- ``compile_cost``: ``--compile-cost``, first-compile seconds of plain Inductor
  and zero-config hilore on a Hugging Face Llama at several depths.
- ``verl_engines``, ``verl_zero``: ``--verl-zero``, verl's FSDP2 engine with
  and without hilore at shares of all-equal-reward groups.
"""
