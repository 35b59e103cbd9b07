"""``hilore bench --compile-cost``: first-compile seconds of plain Inductor and zero-config hilore.

A new user's first ``torch.compile`` of a Hugging Face ``LlamaForCausalLM``
built from a config (random weights, sdpa, fp32), or of the ``hf:`` model a
user names (``model``, any config, LoRA included), at several depths: for each
depth, plain ``torch.compile(model)``, ``torch.compile(model,
backend="hilore")`` (costs measured) and the same with ``cost_model
"roofline:cpu"`` (costs predicted, nothing timed) run back to back, each
twice: in a fresh process with empty Inductor and hilore caches, then in
another fresh process with the caches the first left (a trainer's second
run: hilore's plan and Inductor's FX graph and AOTAutograd caches warm).
Per run: the first forward + backward's seconds (dynamo, tracing, hilore's
planning, Inductor's codegen), hilore's own breakdown of them (its verbose
line: capture, profiling, solving, Inductor), Inductor's cache hits, the
median of the next steps' seconds, and the kernels Inductor generated.
Ratios are hilore's over Inductor's at the same depth and caches, so a
loaded machine moves both alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

#: The compiles timed, in each depth's order.
METHODS = ("inductor", "hilore", "hilore-roofline")

#: Each method runs twice: on empty caches, then on the caches its first run left.
CACHES = ("fresh", "warm")

#: The hilore backend's options per method (zero-config: only the cost model differs).
_OPTIONS = {"hilore": {}, "hilore-roofline": {"cost_model": "roofline:cpu"}}


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileCostConfig:
    """Model sizes, shape and steps of ``--compile-cost``."""

    depths: tuple[int, ...] = (2, 8, 32)
    hidden: int = 128
    heads: int = 4
    vocab: int = 512
    batch: int = 2
    seq_len: int = 256
    #: Steps after the first, timed for the step time.
    steps: int = 3
    threads: int | None = None
    #: Seconds one compile may take before it is reported as a timeout.
    timeout_s: float = 1800.0
    #: A Hugging Face model reference (``HFModelSpec.ref``) compiled instead of the
    #: built-in Llama (``hidden``, ``heads`` and ``vocab`` then unused), cut to each depth.
    model: str | None = None
    #: Parameter dtype.
    dtype: str = "float32"


#: ``--quick``: small enough for a test.
QUICK = {"depths": (1, 2), "hidden": 32, "vocab": 64, "seq_len": 16, "steps": 1}


def _worker(config: dict[str, Any], layers: int, method: str) -> dict[str, Any]:
    """In a fresh process: build, compile, time the first and later steps."""
    import torch
    from torch._inductor import metrics

    from ..models.hf import build_hf_model

    if config["threads"]:
        torch.set_num_threads(config["threads"])
    if config.get("model"):  # the causal LM itself, as a trainer compiles it
        from ..models.hf_config import build_from_config, load_config, parse_model_ref

        spec = dataclasses.replace(parse_model_ref(config["model"]), layers=layers)
        model = build_from_config(spec, load_config(spec), dtype=getattr(torch, config.get("dtype", "float32")))
    else:
        model = build_hf_model("llama", vocab_size=config["vocab"], hidden=config["hidden"], layers=layers,
                               heads=config["heads"], kv_heads=config["heads"], intermediate=2 * config["hidden"],
                               max_positions=max(64, config["seq_len"]), use_cache=False)
    ids = torch.randint(0, model.config.vocab_size, (config["batch"], config["seq_len"]),
                        generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model) if method == "inductor" else \
        torch.compile(model, backend="hilore", options=_OPTIONS[method])

    def step() -> float:
        began = time.perf_counter()
        compiled(input_ids=ids).logits.float().log_softmax(-1).pow(2).mean().backward()
        return time.perf_counter() - began

    metrics.reset()
    first = step()
    kernels = metrics.generated_kernel_count
    later = [step() for _ in range(config["steps"])]
    from torch._dynamo.utils import counters

    hits = {"fx_graph": dict(counters["inductor"]).get("fxgraph_cache_hit", 0),
            "aot_autograd": dict(counters["aot_autograd"]).get("autograd_cache_hit", 0)}
    return {"layers": layers, "method": method, "status": "ok", "first_s": first,
            "step_s": statistics.median(later) if later else None, "kernels": kernels, "cache_hits": hits}


def _run_one(config: CompileCostConfig, layers: int, method: str, caches: str, tmp: str) -> dict[str, Any]:
    """One (depth, method) in its own process with the caches in ``tmp`` (empty for
    ``fresh``); a failure is a row, not a crash."""
    # Inductor's FX graph and AOTAutograd caches on, as they are by default,
    # whatever the caller's environment says (the test suite turns them off).
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(tmp, "inductor"),
           "HILORE_CACHE_DIR": os.path.join(tmp, "hilore"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "1"}
    code = (f"import json; from hilore_compiler.bench.compile_cost import _worker; "
            f"print('RESULT ' + json.dumps(_worker({asdict(config)!r}, {layers}, {method!r})))")
    began = time.perf_counter()
    row = {"layers": layers, "method": method, "caches": caches}
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=config.timeout_s)
    except subprocess.TimeoutExpired:
        return {**row, "status": f"timeout after {config.timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {**row, "status": f"failed: {tail[0][:300]}"}
    return {**row, **json.loads(lines[-1].removeprefix("RESULT ")), "breakdown": breakdowns(done.stderr),
            "process_s": time.perf_counter() - began}


def breakdowns(stderr: str) -> list[str]:
    """hilore's verbose line per graph, where its first compile went, unfolded
    (``progress.tell`` folds a long message onto indented lines)."""
    found: list[str] = []
    folded = False
    for line in stderr.splitlines():
        if line.startswith("hilore: compiled this graph"):
            found.append(line.removeprefix("hilore: "))
            folded = True
        elif folded and line.startswith(" "):
            found[-1] += " " + line.strip()
        else:
            folded = False
    return found


def run_compile_cost(config: CompileCostConfig, progress=lambda message: None) -> dict[str, Any]:
    """Every depth, each method fresh then warm, back to back; the report with per-depth ratios."""
    rows = []
    for layers in config.depths:
        for method in METHODS:
            with tempfile.TemporaryDirectory(prefix="hilore-compile-cost-") as tmp:
                for caches in CACHES:
                    progress(f"compile-cost: {layers} layers, {method}, {caches} caches")
                    rows.append(_run_one(config, layers, method, caches, tmp))
                    progress(f"compile-cost: {layers} layers, {method}, {caches} caches: {_brief(rows[-1])}")
    return {"config": asdict(config), "rows": rows, "ratios": ratios(rows)}


def _brief(row: dict[str, Any]) -> str:
    if row.get("status") != "ok":
        return row["status"]
    return "; ".join([f"first {row['first_s']:.1f} s, {row['kernels']} kernels", *row.get("breakdown", [])])


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per depth and caches: each hilore method's first compile and step time over Inductor's."""
    out = []
    for layers in dict.fromkeys(r["layers"] for r in rows):
        for caches in CACHES:
            got = {r["method"]: r for r in rows if r["layers"] == layers and r.get("caches", "fresh") == caches
                   and r.get("status") == "ok"}
            plain = got.get("inductor")
            for method in METHODS[1:]:
                hilore = got.get(method)
                if plain is None or hilore is None:
                    continue
                out.append({"layers": layers, "caches": caches, "method": method,
                            "first_compile": hilore["first_s"] / plain["first_s"],
                            "step": hilore["step_s"] / plain["step_s"] if plain.get("step_s") else None,
                            "kernels": (hilore["kernels"], plain["kernels"])})
    return out


def format_table(report: dict[str, Any]) -> str:
    """The report as a table: seconds and kernels per depth, method and caches, and the ratios."""
    lines = [f"{'layers':>6}  {'method':<16} {'caches':<6} {'first s':>8} {'step s':>8} {'kernels':>7}  hits"]
    for r in report["rows"]:
        caches = r.get("caches", "fresh")
        if r.get("status") != "ok":
            lines.append(f"{r['layers']:>6}  {r['method']:<16} {caches:<6} {r['status']}")
            continue
        step = "-" if r["step_s"] is None else f"{r['step_s']:.3f}"
        hits = r.get("cache_hits", {})
        lines.append(f"{r['layers']:>6}  {r['method']:<16} {caches:<6} {r['first_s']:>8.1f} {step:>8} "
                     f"{r['kernels']:>7}  fx {hits.get('fx_graph', 0)}, aot {hits.get('aot_autograd', 0)}")
        lines += [f"{'':>8}{line}" for line in r.get("breakdown", [])]
    for q in report["ratios"]:
        step = "-" if q["step"] is None else f"{q['step']:.2f}x"
        lines.append(f"{q['layers']:>3} layers, {q.get('caches', 'fresh')} caches: {q.get('method', 'hilore')}"
                     f"/inductor first compile {q['first_compile']:.2f}x, step {step}, "
                     f"kernels {q['kernels'][0]} vs {q['kernels'][1]}")
    return "\n".join(lines)
