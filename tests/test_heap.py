"""``--heap``: the allocator setting timed bench workers run on, and that it takes effect."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hilore_compiler.bench.measure import MMAP_THRESHOLD_ENV
from hilore_compiler.bench.process import FIXED_HEAP_ENV, worker_env

#: Mallocs 16 MiB, touches it, frees it; prints VmRSS growth after the free, in MiB.
_FREED_BLOCK = """
import ctypes, ctypes.util
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
before = rss()
block = libc.malloc(16 << 20)
ctypes.memset(block, 1, 16 << 20)
libc.free(ctypes.c_void_p(block))
print(rss() - before)
"""


def test_timed_workers_get_the_named_heap_and_peak_workers_the_peak_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_TOP_PAD_", "1")  # the caller's own setting is not the bench's
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    malloc = lambda env: {k: v for k, v in env.items() if k.startswith("MALLOC_")}
    assert malloc(worker_env(tmp_path)) == {}
    assert malloc(worker_env(tmp_path, heap="fixed")) == FIXED_HEAP_ENV
    assert malloc(worker_env(tmp_path, peak=True, heap="fixed")) == MMAP_THRESHOLD_ENV
    assert worker_env(tmp_path, heap="fixed")["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
    with pytest.raises(ValueError, match="heap must be one of default, fixed"):
        worker_env(tmp_path, heap="jemalloc")


def test_bench_configs_reject_an_unknown_heap():
    from hilore_compiler.bench.actor import ActorBenchConfig
    from hilore_compiler.bench.lengths import LengthsBenchConfig
    from hilore_compiler.bench.runner import BenchConfig

    for config in (BenchConfig, ActorBenchConfig, LengthsBenchConfig):
        with pytest.raises(ValueError, match="heap must be one of"):
            config(heap="big")


def test_launcher_times_on_the_fixed_heap_and_measures_peaks_apart(tmp_path):
    from hilore_compiler.bench.launcher import Launcher
    from hilore_compiler.bench.runner import BenchConfig

    launcher = Launcher(BenchConfig(model="tiny", heap="fixed"), "cpu", tmp_path, lambda _: None)
    assert launcher.peaks_apart
    assert {k: launcher.env[k] for k in FIXED_HEAP_ENV} == FIXED_HEAP_ENV
    assert launcher.peak_env["MALLOC_MMAP_THRESHOLD_"] == MMAP_THRESHOLD_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert "MALLOC_TRIM_THRESHOLD_" not in launcher.peak_env


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc")
def test_the_fixed_heap_keeps_a_freed_block_where_the_default_returns_it(tmp_path):
    """The effect the setting is for: on glibc's default a fresh process maps
    a 16 MiB block apart and unmaps it on free, so the next step's buffers land
    somewhere that depends on history; on the fixed heap it stays resident for reuse."""
    def rss_kept(env: dict[str, str]) -> float:
        out = subprocess.run([sys.executable, "-c", _FREED_BLOCK], env=env, capture_output=True, text=True,
                             check=True, timeout=60)
        return float(out.stdout)

    assert rss_kept(worker_env(tmp_path)) < 4
    assert rss_kept(worker_env(tmp_path, heap="fixed")) >= 15


def test_heap_reaches_every_bench_config_from_the_command_line(monkeypatch):
    from hilore_compiler.cli import build_parser
    from hilore_compiler.commands.bench import actor_config_from_args, config_from_args

    parse = build_parser().parse_args
    assert config_from_args(parse(["bench"])).heap == "default"
    assert config_from_args(parse(["bench", "--heap", "fixed", "--ceilings", "1.0,1.1"])).heap == "fixed"
    assert actor_config_from_args(parse(["bench", "--actor-update", "--heap", "fixed"])).heap == "fixed"
    with pytest.raises(SystemExit):
        parse(["bench", "--heap", "big"])


def test_result_files_carry_the_command_that_made_them(tmp_path, monkeypatch, capsys):
    import json

    from hilore_compiler.commands.bench import _write_results

    monkeypatch.setattr(sys, "argv", ["hilore", "bench", "--ceilings", "1.0", "--heap", "fixed"])
    _write_results({"rows": []}, tmp_path / "r.json", lambda report: dict(report), lambda report, path: None, None)
    assert json.loads((tmp_path / "r.json").read_text())["command"] == "hilore bench --ceilings 1.0 --heap fixed"
    assert "plot: skipped" in capsys.readouterr().out
