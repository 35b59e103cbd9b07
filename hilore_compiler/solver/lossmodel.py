"""The loss a caller runs after the compiled graph, when nobody measured it.

The step's peak includes the loss: a trainer computes token log-probs and
its loss from the graph's logits after the graph returns, with every kept
activation still alive (``memory.py``'s loss phase). The bench and the demo
measure that loss's own peak (``bench.measure.loss_side``); a user's
``torch.compile(model, backend="hilore")`` cannot, so it is modelled from the
logits' dtype as the loss TRL, verl and ``models.token_logprobs`` run: a
log-softmax in fp32 over the vocabulary, gathered at the tokens. Beyond the
logits it holds the log-softmax's fp32 output (kept for its backward), the
gather's dense gradient and the log-softmax's input gradient, three fp32
copies of the logits, and for narrower logits their fp32 upcast as well.
Measured on (1, 512, 32000) logits: 2.99x the logits' bytes in fp32, 7.98x
in bf16; the model says 3 and 8.
"""

from __future__ import annotations

#: fp32 copies of the logits the loss holds at its peak (module docstring).
_FP32_COPIES = 3

#: Bytes per element of the floating dtypes a trace names (``str(torch.dtype)``
#: without ``torch.``); a table, so that planning never imports torch.
_ITEMSIZE = {"float64": 8, "double": 8, "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
             "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}


def modelled_loss_ratio(output_dtype: str) -> float:
    """The loss's peak over the logits' bytes for logits of ``output_dtype``
    (``Trace.output_dtype``, ``"bfloat16"``); 0 when the dtype is not known
    or not a floating one (nothing to model)."""
    itemsize = _ITEMSIZE.get(output_dtype)
    if itemsize is None:
        return 0.0
    if itemsize >= 4:  # computed in the logits' own precision
        return float(_FP32_COPIES)
    widen = 4 / itemsize
    return (_FP32_COPIES + 1) * widen  # the fp32 upcast is alive too
