"""The memory model (solver/memory.py): kept and rebuilt bytes, backward
windows, the step's terms, and log-prob chunks that backward rebuilds one at
a time."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hilore_compiler.planfile import RECOMPUTE, STORE
from hilore_compiler.solver import BucketSpec, cost_model, simulate, solve
from hilore_compiler.solver.memory import kept_by_segment, rule_violations
from hilore_compiler.solver.planner import InfeasibleBudgetError
from hilore_compiler.solver.synthetic import SyntheticConfig, synthetic_trace
from hilore_compiler.tracefile import TIED_PARTIALS, RecoveryUnit, Trace
from hilore_compiler.vocabulary import READ_PAST_UNITS

ONE_BUCKET = [BucketSpec("b", 0.0, math.inf, 1.0)]
RISK = 1e-3


def _model(trace: Trace):
    return cost_model(trace, batch=trace.batch, seq_len=trace.seq_len,
                      codecs=sorted({c for u in trace.units for c in u.codecs}))


def test_memory_model_by_hand():
    """Kept bytes plus the largest per-layer set of rebuilt units and a workspace."""
    trace = synthetic_trace(SyntheticConfig(num_layers=2, hidden=8, intermediate=16, heads=2, kv_heads=2,
                                            vocab=8, batch=1, seq_len=1))
    model = _model(trace)
    decisions = {u.key: STORE for u in model.units}
    gate, up = "model.layers.1.mlp.gate_proj:mm:0", "model.layers.1.mlp.up_proj:mm:0"
    sdpa = "model.layers.0.self_attn:sdpa:0"
    decisions.update({gate: RECOMPUTE, up: "compress:int8", sdpa: RECOMPUTE})
    p = simulate(model, decisions)
    backward = model.step.backward_bytes  # outputs' gradient, gradient workspace, weight gradients
    kept_by = kept_by_segment(model, decisions)
    layer1 = model.unit(gate).bytes + model.unit(up).bytes + backward["layer 1"]  # recomputed + decoded copy
    # Backward meets layer 1 first: by layer 0's backward, layer 1's kept bytes are freed.
    layer0 = model.unit(sdpa).bytes + model.step.recovering("layer 0", model.unit(sdpa).recompute_transient) \
        - kept_by["layer 1"]
    assert model.step.freed("layer 0", kept_by) == kept_by["layer 1"] and model.step.freed("layer 1", kept_by) == 0
    assert p.transient_bytes == max(layer0, layer1, model.step.floor(kept_by))
    kept = sum(u.bytes for u in model.units) - model.unit(gate).bytes - model.unit(sdpa).bytes \
        - model.unit(up).bytes + model.unit(up).codecs["int8"].bytes
    assert p.kept_bytes == kept and p.memory_bytes == kept + p.transient_bytes
    # A recompute chain across layers is refused: layer 1's input from layer 0's recomputed output.
    chain = {**decisions, "model.layers.1:add:0": RECOMPUTE, "model.layers.0.mlp.down_proj:mm:0": RECOMPUTE}
    assert any("another layer" in p for p in rule_violations(model, chain))


def test_rebuilt_units_are_freed_as_backward_consumes_them():
    """A segment holds at once only the rebuilt units whose windows meet
    (segments.Segment): from their latest reader down to themselves, and a
    recomputed unit from the moment a recomputed reader needs it."""
    trace = synthetic_trace(SyntheticConfig(num_layers=2, hidden=8, intermediate=16, heads=2, kv_heads=2,
                                            vocab=8, batch=1, seq_len=1))
    model = _model(trace)
    store_all = {u.key: STORE for u in model.units}
    # Layer 1, the first layer backward meets: no kept bytes are freed before it.
    q, gate = "model.layers.1.self_attn.q_proj:mm:0", "model.layers.1.mlp.gate_proj:mm:0"
    norm, up = "model.layers.1.post_attention_layernorm:mul:0", "model.layers.1.mlp.up_proj:mm:0"
    around = model.step.recovering("layer 1", 0)  # none of these has a recompute workspace

    def transient(**options: str) -> int:
        return simulate(model, {**store_all, **options}).transient_bytes

    def at_least(rebuilt: int, **options: str) -> int:
        """``rebuilt`` bytes alive in layer 1's backward, or the plan's other phases if larger."""
        return max(rebuilt + around, model.step.floor(kept_by_segment(model, {**store_all, **options})))

    b = {k: model.unit(k).bytes for k in (q, gate, norm, up)}
    # q is done with in attention's backward, gate is rebuilt for the MLP's: never alive together.
    both = {q: RECOMPUTE, gate: RECOMPUTE}
    assert transient(**both) == at_least(b[gate], **both) < b[q] + b[gate] + around
    # A decoded copy lives in its window too: q's never meets gate's, up's does (both read by the product).
    plan = {q: "compress:int8", gate: RECOMPUTE}
    assert transient(**plan) == at_least(b[gate], **plan)
    plan = {up: "compress:int8", gate: RECOMPUTE}
    assert transient(**plan) == at_least(b[gate] + b[up], **plan)
    # Stored, the norm's output leaves gate's rebuild alone; recomputed, it is rebuilt with gate,
    # before its own window, and both are alive.
    assert transient(**{gate: RECOMPUTE}) == at_least(b[gate], **{gate: RECOMPUTE})
    assert transient(**{norm: RECOMPUTE}) == at_least(b[norm], **{norm: RECOMPUTE})
    plan = {gate: RECOMPUTE, norm: RECOMPUTE}
    assert transient(**plan) == at_least(b[gate] + b[norm], **plan) > at_least(b[gate], **plan)
    # The ILP prices the same windows: its least memory is the simulated one.
    for plan in ({q: RECOMPUTE, gate: RECOMPUTE}, {gate: RECOMPUTE, norm: RECOMPUTE}):
        decisions = {**store_all, **plan}
        budget = simulate(model, decisions).memory_bytes
        got = solve(trace, budget, risk_budget=RISK, buckets=ONE_BUCKET, codecs=[])
        assert got.bucket("b").memory_bytes <= budget


def test_step_peak_counts_outputs_loss_and_weight_gradients():
    """The step's peak (memory.py): kept + the worse of the loss phase and each segment's backward."""
    base = synthetic_trace(SyntheticConfig(num_layers=2, hidden=8, intermediate=16, heads=2, kv_heads=2,
                                           vocab=8, batch=1, seq_len=4))
    trace = dataclasses.replace(base, output_bytes="B*S*32", param_bytes={"outside": 100, "layer 0": 10,
                                                                           "layer 1": 20})
    codecs = sorted({c for u in trace.units for c in u.codecs})
    bare = cost_model(base, batch=1, seq_len=4, codecs=codecs)
    model = cost_model(trace, batch=1, seq_len=4, codecs=codecs, loss_ratio=3.0)
    step = model.step
    assert step.output_bytes == 128 and step.loss_bytes == 384
    # Backward meets outside first, then layer 1, then layer 0: weight gradients so far grow;
    # the outputs' gradient is freed after the head's backward (outside).
    grads = {"outside": 100, "layer 1": 120, "layer 0": 130}
    outputs = {"outside": 2 * 128, "layer 1": 128, "layer 0": 128}
    for g, extra in grads.items():
        assert step.backward_bytes[g] == bare.step.backward_bytes[g] + outputs[g] + extra
    store_all = {u.key: STORE for u in model.units}
    kept = sum(u.bytes for u in model.units)
    assert simulate(model, store_all).memory_bytes == kept + step.floor(kept_by_segment(model, store_all)) \
        == model.store_bytes
    assert model.gc_bytes > bare.gc_bytes and model.store_bytes > bare.store_bytes
    # A plan that recomputes a unit pays its segment's backward terms on top of the rebuilt bytes.
    unit = next(u for u in model.units if u.recomputable and u.layer == 1)
    one = {**store_all, unit.key: RECOMPUTE}
    # Its recompute workspace and the segment's gradient workspace are never alive together.
    held = unit.bytes + step.recovering("layer 1", unit.recompute_transient)
    assert held == unit.bytes + step.backward_bytes["layer 1"] - step.gradient_bytes["layer 1"] \
        + max(unit.recompute_transient, step.gradient_bytes["layer 1"])
    assert simulate(model, one).memory_bytes == kept - unit.bytes + max(held, step.floor(kept_by_segment(model, one)))


def test_a_tied_weight_keeps_its_second_partial_and_the_outputs_gradient_to_the_end():
    """An embedding tied to the lm_head (``TIED_PARTIALS``): its gradient's partial
    from the head is summed with the embedding's at the end of backward, with the
    outputs' gradient still alive (measured at Qwen2.5-0.5B's widths: 1953 MB tied,
    1651 MB untied, the same model otherwise)."""
    base = synthetic_trace(SyntheticConfig(num_layers=2, hidden=8, intermediate=16, heads=2, kv_heads=2,
                                           vocab=8, batch=1, seq_len=4))
    untied = dataclasses.replace(base, output_bytes="B*S*32", param_bytes={"outside": 100, "inputs": 100,
                                                                            "layer 0": 10, "layer 1": 20})
    tied = dataclasses.replace(untied, param_bytes={"outside": 100, "layer 0": 10, "layer 1": 20},
                               partial_grad_bytes={TIED_PARTIALS: 100})
    codecs = sorted({c for u in base.units for c in u.codecs})
    a, b = (cost_model(t, batch=1, seq_len=4, codecs=codecs).step for t in (untied, tied))
    assert a.end_bytes == b.end_bytes - 128  # the same weight bytes, plus the outputs' gradient
    assert a.outputs_in("layer 0") == 128 and b.outputs_in("layer 0") == 256
    assert a.outputs_in("outside") == b.outputs_in("outside") == 256


CHUNK, CHUNKS = 4000, 3


def _chunked_loss_trace(*, read_until: bool, partial_grad: int = 0) -> Trace:
    """The head of a whole step with log-probs in chunks (``grpo.compiled_step``,
    ``checkpoint_chunks=False``): the final norm, one logits unit per chunk,
    and the loss's saved ratio, whose recomputation reads every chunk."""

    def unit(key: str, nbytes: int, recompute_from: tuple[str, ...], until: str) -> RecoveryUnit:
        return RecoveryUnit(
            key=key, layer=None, kind=key.split(":")[0], op="op", dtype="float32", bytes=str(nbytes),
            bytes_at_trace=nbytes, recompute_from=recompute_from, recompute_transient="0",
            recompute_time_s=1e-3, recompute_flops=0, recompute_source="test",
            read_until=until if read_until else None)

    chunks = [f"mm:{k}" for k in range(CHUNKS)]
    units = [unit("norm:0", 100, (), chunks[0])]
    units += [unit(c, CHUNK, ("norm:0",), nxt) for c, nxt in zip(chunks, [*chunks[1:], "exp:0"])]
    units.append(unit("exp:0", 10, tuple(chunks), READ_PAST_UNITS))
    return Trace(fingerprint="chunks", model="chunks", batch=1, seq_len=1, device="none", cost_source="test",
                 units=tuple(units), gc_bytes="200", store_bytes=str(100 + CHUNKS * CHUNK + 10), num_layers=0,
                 param_bytes={"outside": 50_000}, partial_grad_bytes={"outside": partial_grad} if partial_grad else {})


def test_log_prob_chunks_are_rebuilt_one_at_a_time():
    """Backward needs a chunk's logits only for that chunk's gradient
    (``read_until``: the next unit), although recomputing the loss's ratio
    reads them all; without ``read_until`` (older traces) the model holds
    every recomputed chunk at once."""
    recompute = {f"mm:{k}": RECOMPUTE for k in range(CHUNKS)}
    held = {}
    for read_until in (True, False):
        model = _model(_chunked_loss_trace(read_until=read_until))
        decisions = {**{u.key: STORE for u in model.units}, **recompute}
        around = model.step.recovering("outside", 0)
        held[read_until] = simulate(model, decisions).transient_bytes - around
        # The ILP prices the same windows: the simulated memory is feasible for it.
        budget = simulate(model, decisions).memory_bytes
        got = solve(_chunked_loss_trace(read_until=read_until), budget, risk_budget=RISK,
                    buckets=ONE_BUCKET, codecs=[])
        assert got.bucket("b").memory_bytes <= budget
    assert held == {True: CHUNK, False: CHUNKS * CHUNK}
    # Where the peak falls: one chunk's backward, with one chunk rebuilt.
    model = _model(_chunked_loss_trace(read_until=True))
    peak = simulate(model, {**{u.key: STORE for u in model.units}, **recompute}).peak
    assert (peak.at, peak.rebuilt) == ("backward of outside", CHUNK)
    assert peak.workspace == model.step.gradient_bytes["outside"]
    assert peak.weight_gradients == 50_000 and peak.total == held[True] + model.step.recovering("outside", 0)
    stored = simulate(model, {u.key: STORE for u in model.units})
    assert (stored.peak.at, stored.peak.rebuilt) == ("backward of outside", 0)
    assert stored.transient_bytes == model.step.floor()


def test_a_weight_read_by_several_chunks_holds_a_partial_gradient():
    """An lm_head read by every chunk: backward sums its gradient from one
    partial per chunk, a weight-sized tensor beside the sum (measured on the
    small-v128k step: GC + chunked log-probs peaks when the 131 MB partial is
    made); the segment's gradient workspace is then the partial, not the
    widest activation's gradient."""
    plain = _model(_chunked_loss_trace(read_until=True))
    shared = _model(_chunked_loss_trace(read_until=True, partial_grad=20_000))
    small = _model(_chunked_loss_trace(read_until=True, partial_grad=10))
    widest = plain.step.gradient_bytes["outside"]
    assert shared.step.gradient_bytes["outside"] == widest - CHUNK + 20_000
    assert small.step.gradient_bytes == plain.step.gradient_bytes  # smaller than a chunk: no change
    assert shared.step.backward_bytes["outside"] - plain.step.backward_bytes["outside"] == 20_000 - CHUNK


def test_accumulated_gradients_are_alive_in_every_phase():
    """An update that sums gradients over microbatches (``grpo.actor_update``)
    holds every weight's gradient from the second microbatch on, in every
    phase; a compiled backward returns its new gradients only at its end, so
    those made so far are alive beside them. Measured on the small actor
    update (T=256, 32 microbatches of 2, GC): at the allocator's peak, the
    15.8 MB of accumulated gradients and 10.3 MB of new ones."""
    base = synthetic_trace(SyntheticConfig(num_layers=2, hidden=8, intermediate=16, heads=2, kv_heads=2,
                                           vocab=8, batch=1, seq_len=4))
    grads = {"outside": 100, "layer 0": 10, "layer 1": 20, "inputs": 40}
    trace = dataclasses.replace(base, output_bytes="B*S*32", param_bytes=grads)
    codecs = sorted({c for u in trace.units for c in u.codecs})
    one = cost_model(trace, batch=1, seq_len=4, codecs=codecs, loss_ratio=3.0)
    summed = cost_model(trace, batch=1, seq_len=4, codecs=codecs, loss_ratio=3.0, accumulate_gradients=True)
    total = sum(grads.values())
    assert summed.step.held_gradient_bytes == total and one.step.held_gradient_bytes == 0
    # The new gradients grow as backward goes, as without accumulation, on top of the held ones.
    assert one.step.weight_gradient_bytes == {"outside": 100, "layer 1": 120, "layer 0": 130}
    assert summed.step.weight_gradient_bytes == {g: v + total for g, v in one.step.weight_gradient_bytes.items()}
    assert summed.step.loss_phase_bytes == one.step.loss_phase_bytes + total
    assert summed.step.end_bytes == one.step.end_bytes + total  # every new gradient beside every held one
    for g, before in one.step.backward_bytes.items():
        assert summed.step.backward_bytes[g] == before + total
    assert summed.gc_bytes > one.gc_bytes and summed.store_bytes > one.store_bytes
    store_all = {u.key: STORE for u in summed.units}
    assert simulate(summed, store_all).peak.weight_gradients >= total

def _stack_trace(layers: int) -> Trace:
    """One 1000-byte unit per layer that only int8 (260 bytes) or storing can keep."""
    from hilore_compiler.tracefile import CodecCost

    int8 = CodecCost(bytes="260", time_s=1e-3, rel_l2=0.01, max_abs=0.0, source="test", usable=True, reason=None)
    units = tuple(RecoveryUnit(
        key=f"u{i}", layer=i, kind="mlp", op="op", dtype="float32", bytes="1000", bytes_at_trace=1000,
        recompute_from=(), recompute_transient="0", recompute_time_s=0.0, recompute_flops=0,
        recompute_source="test", recomputable=False, not_recomputable_reason="test",
        codecs={"int8": int8}, sensitivity={"int8": 1e-3}) for i in range(layers))
    return Trace(fingerprint="stack", model="stack", batch=1, seq_len=1, device="none", cost_source="test",
                 units=units, gc_bytes="2000", store_bytes=str(1000 * layers), num_layers=layers)


def test_backward_frees_the_kept_bytes_of_layers_it_has_finished():
    """Backward meets the last layer first and frees its saved activations
    before it decodes the layers below: storing the last layer costs no more
    than its compressed copy plus its decoded one, storing the first costs a
    decoded copy more. The ILP prices it the same and stores the last."""
    trace = _stack_trace(3)
    model = _model(trace)
    bw = model.step.backward_bytes["layer 0"]
    assert set(model.step.backward_bytes.values()) == {bw}  # no weights: every layer alike
    last = {"u0": "compress:int8", "u1": "compress:int8", "u2": STORE}
    first = {"u0": STORE, "u1": "compress:int8", "u2": "compress:int8"}
    kept = 2 * 260 + 1000
    assert simulate(model, last).memory_bytes == kept + bw
    assert simulate(model, first).memory_bytes == kept + 1000 + bw  # u2 decoded beside every kept byte
    # Layer 1's backward holds u1 decoded with u2 already freed; layer 0's, u0 with both freed.
    kept_by = kept_by_segment(model, last)
    assert (model.step.freed("layer 1", kept_by), model.step.freed("layer 0", kept_by)) == (1000, 1260)
    got = solve(trace, kept + bw, risk_budget=1.0, buckets=ONE_BUCKET, codecs=["int8"])
    assert dict(got.bucket("b").decisions)["u2"] == STORE and got.bucket("b").memory_bytes <= kept + bw


def test_a_unit_read_by_later_layers_is_held_from_their_backward():
    """An attention mask made in layer 0 and read by every layer (``read_until``
    in layer 2) is, when recomputed, rebuilt in layer 2's backward, the first
    to need it, and held through layers 1 and 0 while kept bytes are still
    alive: it saves nothing over storing it. Counted in layer 0's backward
    alone, after layers 1 and 2 freed their kept bytes, recomputing looked
    1000 bytes cheaper (a Hugging Face Llama's plans measured up to 10% over
    their predictions)."""
    mask = RecoveryUnit(
        key="mask", layer=0, kind="attn.sdpa", op="where", dtype="float32", bytes="1000", bytes_at_trace=1000,
        recompute_from=(), recompute_transient="0", recompute_time_s=1e-3, recompute_flops=0,
        recompute_source="test", recomputable=True, not_recomputable_reason=None, codecs={}, sensitivity={},
        read_until="u2")
    stack = _stack_trace(3)
    trace = dataclasses.replace(stack, units=(mask, *stack.units), store_bytes="4000")
    model = _model(trace)
    assert [(u.key, first, last) for u, first, last in model.segments[1].carried] == [("mask", 1, 1)]  # all of it
    assert [s.name for s in model.segments] == ["layer 0", "layer 1", "layer 2"]
    bw = model.step.backward_bytes["layer 2"]
    recompute = {"mask": RECOMPUTE, "u0": STORE, "u1": STORE, "u2": STORE}
    p = simulate(model, recompute)
    assert set(model.step.backward_bytes.values()) == {bw}
    assert p.peak.at == "backward of layer 2" and p.memory_bytes == 3000 + 1000 + bw
    assert simulate(model, {**recompute, "mask": STORE}).memory_bytes == 4000 + bw
    with pytest.raises(InfeasibleBudgetError) as info:
        solve(trace, 3000 + bw, risk_budget=1.0, buckets=ONE_BUCKET, codecs=[])
    assert info.value.min_budget_bytes == 4000 + bw
