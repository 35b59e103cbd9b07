"""verl's FSDP2 engine with and without hilore, two gloo processes on CPU (tiny random Qwen2).

One spawn of two ranks trains verl's own ``FSDPEngineWithLMHead`` and then
``HiLoReFSDPEngine`` (``codecs: []``, exact plans; with the drop of
zero-exposure samples, and with only the whole-micro-batch skip) for three
optimizer steps each on the same batches (the last with verl's dynamic batch size), and
returns what it measured, so the slow compile is shared by every test here. Each step computes the old log-probs with a
``forward_only`` pass first, as verl's ``compute_log_prob`` does. Then one update with int8 on and
verl's token budget set (``shared_plans``) shows that rank 0 plans every block graph and rank 1 runs its plans.

The batches are built so the ranks disagree: rank 0 has one mixed group and
two groups with equal rewards (zero advantages), rank 1 one zero group and
two mixed ones: half the groups are zero. With verl's micro-batches ordered least exposed first, slot 0 is zero on both ranks
(skipped by both), slot 1 is zero on rank 0 only (it runs there, since rank 1
works in that slot), slot 2 is real work on both.

The integration's rules that need no processes are test_verl_rules.py's.
"""

from __future__ import annotations

import functools
import time
import warnings

import pytest
import torch

pytest.importorskip("verl")

from hilore_compiler.bench import verl_engines  # noqa: E402
from hilore_compiler.bench.verl_engines import cpu_platform, full_parameters, save_tiny_qwen2  # noqa: E402
from hilore_compiler.distributed import spawn  # noqa: E402

#: Samples per rank, GRPO group size (= micro-batch size), prompt and response lengths.
B_RANK, GROUP, PROMPT, RESPONSE = 12, 4, 6, 10
#: Groups with zero advantages, per rank (see the module docstring).
ZERO_GROUPS = ((1, 2), (0,))
#: verl's token budget per micro-batch under its dynamic batch size: GROUP * (PROMPT + RESPONSE)
#: tokens at most, rounded up. Packed micro-batches are not padded: each has its own token count.
PAD_BUCKET = 64
STEPS = 3
#: From this step on verl's dynamic batch size packs the micro-batches (by a
#: token budget of PAD_BUCKET).
DYNAMIC_FROM = 2
#: SGD: the update is a fixed multiple of the gradient, so comparing parameters
#: compares gradients (Adam's first step, about lr * sign(g), amplifies rounding).
LR = 0.5


def build_engine(path: str, hilore: dict | None, initialize: bool = True, skip_zero: bool = True,
                 drop_zero: bool = True, registered: bool = False, **model_fields):
    """verl's engine (``hilore=None``) or the hilore one, SGD, micro-batches of one group."""
    fields = None if hilore is None else {"hilore_skip_zero": skip_zero, "hilore_drop_zero": drop_zero}
    return verl_engines.build_engine(path, hilore, micro_batch_size=GROUP, lr=LR, initialize=initialize,
                                     registered=registered, engine_fields=fields, **model_fields)


def rank_batch(rank: int, step: int):
    """This rank's left/right-padded batch of one step, as verl's trainer hands it over."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(100 * step + rank)
    n, t = B_RANK, PROMPT + RESPONSE
    ids = torch.randint(1, 128, (n, t), generator=g)
    prompt_len = torch.randint(3, PROMPT + 1, (n,), generator=g)
    response_len = torch.randint(4, RESPONSE + 1, (n,), generator=g)
    attention = torch.zeros(n, t, dtype=torch.long)
    for i in range(n):
        attention[i, PROMPT - prompt_len[i]:PROMPT + response_len[i]] = 1
    response_mask = attention[:, PROMPT:].clone()  # (B, R)
    advantages = torch.randn(n, generator=g)  # one per sample, broadcast over its tokens as GRPO does
    for group in ZERO_GROUPS[rank]:
        advantages[GROUP * group:GROUP * (group + 1)] = 0.0
    td = TensorDict({
        "prompts": ids[:, :PROMPT].clone(), "responses": ids[:, PROMPT:].clone(), "input_ids": ids,
        "attention_mask": attention, "response_mask": response_mask,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "advantages": advantages[:, None] * response_mask, "old_log_probs": torch.zeros(n, RESPONSE),
    }, batch_size=[n])
    return left_right_2_no_padding(td)


def run_engine(engine, rank: int, steps: int = STEPS, dynamic_from: int | None = DYNAMIC_FROM) -> dict:
    """``steps`` updates (old log-probs forward_only, then train_batch); parameters and what was seen.

    Updates from ``dynamic_from`` on use verl's dynamic batch size (None: never).
    """
    import verl.utils.tensordict_utils as tu
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    actor = ActorConfig(strategy="fsdp2", ppo_mini_batch_size=2 * B_RANK, ppo_micro_batch_size_per_gpu=GROUP,
                        use_dynamic_bsz=False, rollout_n=GROUP)
    loss = functools.partial(ppo_loss, config=actor)
    out = {"times": [], "graphs": [], "frames": [], "forwards": [], "metrics": []}
    _count_training_forwards(engine, out["forwards"])
    backends = list({id(b): b for b in getattr(engine, "hilore_backends", [])}.values())  # blocks share some
    for step in range(steps):
        data = rank_batch(rank, step)
        dynamic = dynamic_from is not None and step >= dynamic_from
        tu.assign_non_tensor(data, use_remove_padding=True, use_dynamic_bsz=dynamic, max_token_len_per_gpu=PAD_BUCKET,
                             micro_batch_size_per_gpu=GROUP, global_batch_size=2 * B_RANK, temperature=1.0)
        with engine.eval_mode():
            logp = engine.infer_batch(data.clone(), loss_function=None)["model_output"]["log_probs"]
        data["old_log_probs"] = no_padding_2_padding(logp, data)  # on-policy: ratio 1
        start = time.perf_counter()
        with engine.train_mode():
            metrics = engine.train_batch(data, loss_function=loss)["metrics"]
        out["times"].append(time.perf_counter() - start)
        out["metrics"].append({k: (m.aggregation.value, list(m.values)) for k, m in metrics.items()
                               if k.startswith("actor/")})
        out["forwards"].append(None)  # a step's end: the passes before it are this step's
        out["graphs"].append(sum(len(b.graphs) for b in backends))
        out["frames"].append(int(torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    out["params"] = full_parameters(engine)
    out["history"] = list(getattr(engine, "bucket_history", []))
    out["planned"] = sum(g.plan is not None for b in backends for g in b.graphs)
    out["dynamic"] = [g.planner is not None and g.planner.dynamic for b in backends for g in b.graphs]
    out["packed_lengths"] = sorted({n for b in backends for g in b.graphs if g.planner for n in g.planner.seq_range})
    return out


def _count_training_forwards(engine, seen: list) -> None:
    """Record (samples, zero-advantage samples) of every training forward the engine runs."""
    original = engine.forward_step

    def forward_step(micro_batch, loss_function, forward_only):
        if not forward_only:
            adv = micro_batch["advantages"]
            per_sample = [a.abs().sum().item() for a in (adv.unbind() if adv.is_nested else adv)]
            seen.append((len(per_sample), sum(x == 0.0 for x in per_sample)))
        return original(micro_batch, loss_function=loss_function, forward_only=forward_only)

    engine.forward_step = forward_step


def _per_step(forwards: list) -> list[tuple[int, int]]:
    """(samples, zero samples) forwarded in each step."""
    steps, samples, zero = [], 0, 0
    for item in forwards:
        if item is None:
            steps.append((samples, zero))
            samples, zero = 0, 0
        else:
            samples, zero = samples + item[0], zero + item[1]
    return steps


def refusals(path: str, hilore: dict) -> dict:
    """What the hilore engine says about gradient checkpointing and activation offload."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = build_engine(path, hilore, enable_gradient_checkpointing=True)
    said = [str(w.message) for w in caught if "turns gradient checkpointing off" in str(w.message)]
    try:
        build_engine(path, hilore, initialize=False, enable_activation_offload=True)
        offload = None
    except ValueError as error:
        offload = str(error)
    return {"checkpointing_warned": bool(said), "offload_refused": offload,
            "checkpointing_left_on": bool(engine.module.is_gradient_checkpointing)}


#: The hilore options of these runs: exact plans, one nonzero bucket (one compile).
HILORE = {"codecs": [], "buckets": 1, "verbose": False}
#: The plan-sharing run's: int8 on, so each rank's own profiling could pick
#: different options; the lengths come from verl's token budget (``planned_lengths``).
SHARED = {"codecs": ["int8"], "buckets": 1, "verbose": False}


def shared_plans(path: str, rank: int, hilore: dict = SHARED) -> dict:
    """One update under ``use_dynamic_bsz`` with a token budget: what each block graph planned, and from where.

    Both ranks compile a static graph and then a dynamic one (two packed
    lengths each, different on each rank); rank 0 traces and solves, rank 1
    runs its plans (``distributed/plan_share``).
    """
    from hilore_compiler.backend.planning import HiLoReWarning
    from hilore_compiler.distributed.plan_sync import plan_digest

    # As in a fresh process: dynamo forgets the lengths the runs before compiled the blocks at,
    # so the first compile is static again and the dynamic one comes at each rank's second length.
    torch._dynamo.reset()
    engine = build_engine(path, hilore, initialize=False)
    engine.engine_config.use_dynamic_bsz, engine.engine_config.max_token_len_per_gpu = True, PAD_BUCKET
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.initialize()
        run_engine(engine, rank, steps=1, dynamic_from=None)
    graphs = [g for b in {id(b): b for b in engine.hilore_backends}.values() for g in b.graphs if g.planner]
    return {"plans": [plan_digest(g.plan) for g in graphs], "sources": [g.planner.source for g in graphs],
            "traces": [g.planner.trace.fingerprint + str(g.planner.trace.to_json()) for g in graphs],
            "ranges": [g.planner.seq_range for g in graphs], "dynamic": [g.planner.dynamic for g in graphs],
            "options": sorted({o.option for g in graphs for u in g.plan.units for o in u.options}),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, HiLoReWarning)]}


def rank_main(rank: int, world: int, path: str, steps: int = STEPS) -> dict:
    """verl's engine, then hilore's (with the drop; with the whole-micro-batch skip), ``steps`` updates each.

    Timings of these engines: ``hilore bench --verl-zero`` (``bench/verl_zero.py``)."""
    from verl.plugin.platform import set_platform

    set_platform(cpu_platform())
    import hilore_compiler.integrations.verl  # noqa: F401  (what external_lib does: registers, patches)

    torch.manual_seed(0)
    start = full_parameters(build_engine(path, None))
    dynamic_from = DYNAMIC_FROM
    ref = run_engine(build_engine(path, None), rank, steps, dynamic_from)
    sub = run_engine(build_engine(path, HILORE), rank, steps, dynamic_from)
    plain = run_engine(build_engine(path, None, registered=True), rank, steps, dynamic_from)
    skip = run_engine(build_engine(path, HILORE, drop_zero=False), rank, steps, dynamic_from)
    return {"start": start, "ref": ref, "sub": sub, "plain": plain, "skip": skip, "shared": shared_plans(path, rank),
            **refusals(path, HILORE)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))
    save_tiny_qwen2(path)
    cache = {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "0",
             "TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}
    results = spawn(rank_main, 2, path, backend="gloo", env=cache, timeout_s=900)
    for rank, r in enumerate(results):  # the measured figures, for pytest -s
        print(f"rank {rank}: verl step s {[round(t, 3) for t in r['ref']['times']]}, hilore step s "
              f"{[round(t, 3) for t in r['sub']['times']]}, buckets {r['sub']['history']}")
    return results


def _flat(params: dict) -> torch.Tensor:
    return torch.cat([torch.from_numpy(params[n]).reshape(-1).double() for n in sorted(params)])


@pytest.mark.slow
def test_three_steps_with_the_drop_match_verls_engine_with_exact_plans(ranks):
    """Half the groups have equal rewards (3 of the 6 over both ranks); hilore drops their samples."""
    for r in ranks:
        p0, ref, sub = _flat(r["start"]), _flat(r["ref"]["params"]), _flat(r["sub"]["params"])
        assert (ref - p0).norm() / p0.norm() > 1e-4, "verl's engine did not move the parameters"
        rel = ((sub - ref).norm() / ref.norm()).item()
        print(f"parameters, relative L2 after {STEPS} steps: {rel:.2e}")
        assert rel < 1e-6
        assert ((sub - ref).norm() / (ref - p0).norm()).item() < 1e-4  # the updates, not just the weights
        skip = _flat(r["skip"]["params"])  # the whole-micro-batch skip is the same update too
        assert ((skip - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.slow
def test_the_drop_runs_no_zero_sample_forward(ranks):
    for rank, r in enumerate(ranks):
        zero = GROUP * len(ZERO_GROUPS[rank])
        assert _per_step(r["ref"]["forwards"]) == [(B_RANK, zero)] * STEPS  # verl runs every sample
        assert _per_step(r["sub"]["forwards"]) == [(B_RANK - zero, 0)] * STEPS
        assert all(h["dropped_samples"] == zero and h["padding_microbatches"] == 0 for h in r["sub"]["history"])
        for h in r["sub"]["history"]:  # one bucket (codecs: [] plans one): every micro-batch is pure
            assert all(set(mb) == {"b0"} for mb in h["microbatch_buckets"]), h


@pytest.mark.slow
def test_logged_loss_is_verls_and_per_token_means_cover_the_whole_batch(ranks):
    for r in ranks:
        for ref, sub in zip(r["ref"]["metrics"], r["sub"]["metrics"]):
            assert set(ref) == set(sub)
            agg, ref_loss = ref["actor/pg_loss"]
            assert agg == "sum" and sum(sub["actor/pg_loss"][1]) == pytest.approx(sum(ref_loss), rel=1e-5, abs=1e-8)
            # Per-token means: on-policy nothing clips (ratio 1), in both; ppo_kl is rounding-sized.
            for key in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower"):
                assert sum(ref[key][1]) == sum(sub[key][1]) == 0.0
            assert abs(sum(sub["actor/ppo_kl"][1])) < 1e-5


@pytest.mark.slow
def test_without_a_hilore_field_the_registered_engine_is_verls(ranks):
    for r in ranks:  # the reference model's case: bit for bit what verl's engine does
        assert all((r["plain"]["params"][n] == r["ref"]["params"][n]).all() for n in r["ref"]["params"])
        assert r["plain"]["graphs"] == [0] * STEPS and r["plain"]["history"] == []


@pytest.mark.slow
def test_blocks_went_through_hilore_and_nothing_recompiles(ranks):
    for r in ranks:
        graphs, frames = r["sub"]["graphs"], r["sub"]["frames"]
        assert graphs[0] > 0, "no block graph was compiled by the hilore backend"
        assert r["sub"]["planned"] > 0, "the backend fell back to Inductor: no block graph has a plan"
        assert graphs[1:] == [graphs[0]] * (STEPS - 1), f"hilore graphs per step: {graphs}"
        assert frames[1:] == [frames[0]] * (STEPS - 1), f"dynamo graphs per step: {frames}"
        # Unpadded packed micro-batches of several token counts: after the first
        # length, one symbolic graph per block serves them all.
        assert any(r["sub"]["dynamic"]), "no block graph was compiled with the packed length symbolic"
        assert r["ref"]["graphs"] == [0] * STEPS  # verl's engine compiled nothing


@pytest.mark.slow
def test_rank_0_plans_every_block_graph_and_rank_1_runs_its_plans(ranks):
    """With int8 on, each rank's own profiling gives it plans of its own (share_plans off: 4 digests)."""
    r0, r1 = (r["shared"] for r in ranks)
    assert r0["dynamic"] == r1["dynamic"] == [False, True]  # a static compile, then the packed length symbolic
    assert "compress:int8" in r0["options"], r0["options"]
    assert r0["sources"] == ["made", "made"] and r1["sources"] == ["rank 0", "rank 0"]  # rank 1 measured nothing
    assert r0["plans"] == r1["plans"]  # graph by graph: the static one's, the dynamic one's
    assert r0["traces"] == r1["traces"]
    assert r0["ranges"] == r1["ranges"] == [(1, PAD_BUCKET)] * 2  # verl's token budget (planned_lengths)
    assert r0["warnings"] == r1["warnings"] == []


@pytest.mark.slow
def test_zero_microbatches_are_skipped_on_both_ranks_together(ranks):
    r0, r1 = (r["skip"]["history"] for r in ranks)  # hilore_drop_zero=False: verl's micro-batches
    # Slot 0 is zero on both ranks: skipped by both. Slot 1 is zero on rank 0
    # only: it runs there, since rank 1 works in that slot. (With the dynamic
    # batch size verl balances lengths, which mixes groups: no fixed expectation.)
    assert [h["skipped_microbatches"] for h in r0[:DYNAMIC_FROM]] == [1] * DYNAMIC_FROM
    assert [h["skipped_microbatches"] for h in r1[:DYNAMIC_FROM]] == [1] * DYNAMIC_FROM
    assert all(h["zero"] == GROUP * len(ZERO_GROUPS[0]) for h in r0)
    assert all(h["zero"] == GROUP * len(ZERO_GROUPS[1]) for h in r1)


@pytest.mark.slow
def test_checkpointing_is_turned_off_with_a_warning_and_offload_refused(ranks):
    for r in ranks:
        assert r["checkpointing_warned"] and not r["checkpointing_left_on"]
        assert r["offload_refused"] and "enable_activation_offload=False" in r["offload_refused"]
