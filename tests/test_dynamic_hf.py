"""A Hugging Face Llama under plain ``torch.compile(model, backend="hilore")`` stays planned
across lengths (``test_dynamic.py`` has the built-in policy and packed rows; a file of its
own so that pytest-xdist's ``--dist loadfile`` runs the two on different workers)."""

from __future__ import annotations

import pytest
import torch

from test_dynamic import check, run_lengths

pytestmark = pytest.mark.slow


def test_hugging_face_llama_stays_planned_across_lengths(tmp_path):
    pytest.importorskip("transformers")
    from hilore_compiler.models.hf import build_hf_model

    torch.manual_seed(0)
    model = build_hf_model("llama", vocab_size=64, use_cache=False)
    # Roofline costs: the plans are a function of the shapes. With measured
    # costs a loaded machine times its way to other plans, some of which this
    # tiny Llama's step peaks 4-10% over (at length 48 on the previous main
    # too; in CI's quieter runs it passed): the memory model's error on
    # those plans is still to be found.
    check(run_lengths(model, lambda fn, ids: fn(input_ids=ids).logits, 64, tmp_path, cost_model="roofline:cpu"))
