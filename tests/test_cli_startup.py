"""The commands a newcomer types first answer at once: no torch, a fraction of a second.

CPU time of a fresh process, from ``resource.getrusage(RUSAGE_CHILDREN)``,
not wall time: the machine running the suite may be busy, a process's CPU
time is its own.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "small-cpu-T2048.json"
#: Importing torch alone takes about 2 s of CPU here; the commands take 0.1-0.8 s without it.
CPU_LIMIT_S = 2.0


def _cpu_seconds(*args: str) -> float:
    """User + system CPU seconds of ``python -m hilore_compiler ARGS`` in a fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "hilore_compiler", *args], capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert done.returncode == 0, done.stderr
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


@pytest.mark.parametrize("args", [("--help",), ("plan", "--help"), ("show", str(TRACE))],
                         ids=["help", "plan-help", "show-trace"])
def test_first_commands_take_under_two_cpu_seconds(args):
    assert _cpu_seconds(*args) < CPU_LIMIT_S


@pytest.mark.parametrize("command", ["plan", "show", None])
def test_plan_and_show_never_import_torch(command):
    """Building the parser a command runs under, and importing its module, loads no torch."""
    code = ("import sys; from hilore_compiler import cli; "
            f"cli.build_parser({[command] if command else []!r}).format_help(); "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
