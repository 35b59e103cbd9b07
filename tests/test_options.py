"""Backend options fail fast, with the CLI's words, before anything is profiled or cached."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hilore_compiler.backend import BackendOptions, HiLoReBackend
from hilore_compiler.backend.planning import HiLoReWarning
from hilore_compiler.cli import main as cli_main
from hilore_compiler.solver import parse_budget


@pytest.mark.parametrize("options, words", [
    ({"codecs": ["int3"]}, r"'codecs': unknown codec\(s\) \['int3'\]: hilore knows \['bf16', 'int8', 'fp8', 'int4'\]"),
    ({"codecs": [], "trace_codecs": ["int3"]}, r"'trace_codecs': unknown codec\(s\) \['int3'\]"),
    ({"memory_budget": "1.1gc"}, r"'memory_budget': budget '1.1gc' is not understood; accepted: .*'1.10x-gc'"),
    ({"memory_budget": "-2GiB"}, r"'memory_budget': budget '-2GiB' is negative"),
    ({"memory_budget": "0x-gc"}, r"'memory_budget': budget '0x-gc' must be positive"),
    ({"risk_budget": "cos>=x"}, r"'risk_budget': risk budget 'cos>=x': expected 'cos>=0.999'"),
    ({"risk_budget": -1.0}, r"'risk_budget' must be a number >= 0"),
    ({"loss_ratio": -0.5}, r"'loss_ratio' must be a number >= 0"),
    ({"gc_peak_bytes": 0}, r"'gc_peak_bytes' must be a positive int"),
    ({"max_seq_len": -8}, r"'max_seq_len' must be a positive int"),
])
def test_malformed_options_raise_one_clear_error_naming_what_is_accepted(options, words):
    with pytest.raises(ValueError, match=words):
        BackendOptions.from_mapping(options)


def test_a_misspelt_codec_fails_before_anything_is_profiled_or_cached(tmp_path):
    with pytest.raises(ValueError, match="unknown codec"):
        HiLoReBackend({"codecs": ["int3"], "cache_dir": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []


def test_the_backend_and_the_cli_speak_of_a_bad_budget_in_the_same_words(tmp_path, capsys):
    from hilore_compiler.solver.synthetic import random_trace

    trace_file = str(random_trace(0).save(tmp_path / "t.json"))
    with pytest.raises(ValueError) as raised:
        parse_budget("1.1gc")
    with pytest.raises(ValueError) as option:
        BackendOptions.from_mapping({"memory_budget": "1.1gc"})
    assert cli_main(["plan", trace_file, "--budget", "1.1gc", "-o", str(tmp_path / "plan.json")]) == 2
    said = capsys.readouterr().err
    assert str(raised.value) in str(option.value) and str(raised.value) in said


def test_an_infeasible_well_formed_budget_falls_back_naming_the_smallest_feasible(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    backend = HiLoReBackend({"memory_budget": "0.01x-gc", "codecs": [], "buckets": 1, "verbose": False,
                             "cache_dir": str(tmp_path)})
    with pytest.warns(HiLoReWarning, match=r"smallest feasible budget is .*x-gc"):
        torch.compile(model, backend=backend, dynamic=False)(torch.randn(4, 8)).pow(2).mean().backward()
    assert backend.graphs[0].plan is None  # Inductor's own choice: training goes on
