"""FSDP2 with one ``torch.compile`` of the whole model, two gloo ranks.

``fully_shard`` on each decoder layer and on the root, then the whole model
compiled with hilore, as a user who compiles once would. Dynamo splits the
model at FSDP's hooks into several graphs, some of which save nothing for
backward; rank 0 shares what it found for each (``distributed/plan_share``)
and the other rank must run from that without stopping, whatever it is.
Gradients after the reduce-scatter equal one process's eager ones.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hilore_compiler.distributed import spawn

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")]

B_RANK, T = 2, 16


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (2 * B_RANK, T), generator=torch.Generator().manual_seed(3))  # (2B, T)


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().logsumexp(-1).mean()


def rank_main(rank: int, world: int) -> dict:
    from hilore_compiler.backend.report import HiLoReWarning
    from hilore_compiler.distributed import shard_blocks
    from hilore_compiler.models import build_model

    ids = _batch()
    model = shard_blocks(build_model("tiny"))
    compiled = torch.compile(model, backend="hilore",
                             options={"codecs": [], "memory_budget": "1.10x-gc", "verbose": False})
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):  # the second step runs what the first compiled
            model.zero_grad(set_to_none=True)
            _loss(compiled(ids[rank * B_RANK:(rank + 1) * B_RANK])).backward()
    # numpy arrays pickle by value; tensors would go through shared memory the rank frees on exit.
    grads = {n.replace("_orig_mod.", ""): p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
    return {"grads": grads, "warnings": [str(w.message) for w in said if issubclass(w.category, HiLoReWarning)]}


@pytest.fixture(scope="module")
def ranks():
    return spawn(rank_main, 2, backend="gloo", timeout_s=900)


def test_every_rank_trains_and_gradients_equal_one_process(ranks):
    from hilore_compiler.models import build_model

    model = build_model("tiny")
    _loss(model(_batch())).backward()  # one process, eager, the whole batch
    for r in ranks:
        for name, param in model.named_parameters():
            torch.testing.assert_close(torch.from_numpy(r["grads"][name]), param.grad, rtol=1e-4, atol=1e-6,
                                       msg=name)


def test_no_rank_falls_back_for_every_graph(ranks):
    for r in ranks:
        assert not any("every unit" in w or "this graph falls back" in w for w in r["warnings"]), r["warnings"]
