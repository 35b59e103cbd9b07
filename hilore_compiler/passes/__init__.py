"""Graph passes: a model's joint graph in, recovery units and their costs out; plans applied back.

Modules in the order a trace is made, then a plan applied:

- ``tracer``:      drives the rest: model -> recovery units with measured costs -> ``Trace``.
- ``capture``:     the AOT joint graph Inductor's partitioner receives, and what min-cut saves.
- ``gpu_lowering``: attention lowered as a GPU does, where no GPU is there to choose.
- ``values``:      the forward values profiling re-runs regions on (recorded, or meta).
- ``annotate``:    the saved activations grouped into recovery units.
- ``sizes``:       sizes of graph values as sympy expressions of ``B`` and ``S``.
- ``classes``:     block classes of units, one member of each profiled.
- ``profile``:     what each unit costs to store, compress or recompute.
- ``costmodel``:   analytic (roofline) costs, for a GPU that is not there.
- ``codec_timing``: a codec's encode and decode as compiled in a step, timed once.
- ``allocator``:   cost timings on the allocator a trainer runs with.
- ``apply``:       the joint graph rewritten so min-cut partitions it as a plan says.
- ``partition``:   min-cut of a joint graph after a plan's decisions are applied.
- ``calibration``: measured gradient sensitivity per (unit kind, codec).
"""
