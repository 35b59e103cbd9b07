"""The ``paper`` method of ``hilore bench``: HiLoRe's reference runtime, eager, in our own code.

The paper authors' runtime (``ChnIRuI/HiLoRe``: ``hilore/runtime.py`` and the initialisation
in ``hilore/initialize.py``), one concept a module:

- ``recovery``: one decoder layer's saved tensors in a step, kept (H), kept with one MLP
  tensor in fp8 (L) or dropped and replayed from the layer's inputs (R);
- ``layers``: that recovery installed on every decoder layer, and the L threshold scaled to
  the model;
- ``allocator``: the per-step dynamic program over (memory left, risk left);
- ``profile``: the per-layer time saved and bytes of each action, and the capture plans;
- ``calibration``: kappa and the mean L error of the risk model;
- ``method``: ``PaperMethod``, which joins them for the bench (``methods.prepare_method``).

What it does differently from the reference, and why, is in ``method``'s docstring.
"""

from .method import PaperConfig, PaperMethod

__all__ = ["PaperConfig", "PaperMethod"]
