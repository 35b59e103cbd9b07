"""What a newcomer reads first works as written: README's size, its quick start, the
results it and docs/ cite, and every example it names."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: Issue 54's hard limit; the aim is about 15 KB.
README_LIMIT_BYTES = 20_000


def _cited_text() -> str:
    return "\n".join(p.read_text() for p in [README, *sorted((ROOT / "docs").glob("*.md"))])


def quick_start() -> str:
    """The first ```python block after README's "Quick start" heading."""
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README's Quick start has no python block"
    return match.group(1)


def test_readme_is_short_and_opens_with_the_two_commands():
    assert README.stat().st_size < README_LIMIT_BYTES
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    commands = [line for line in first_block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2
    assert "demo" in commands[0] and "pytest" in commands[1]
    assert all("-c constraints.txt" in c for c in commands)  # the CPU torch pin


def test_ci_runs_the_readmes_test_command_as_written():
    """A new user's install is CI's: the README's second command appears in .ci/run verbatim."""
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    tests = [line for line in first_block.splitlines() if line.strip() and not line.startswith("#")][1]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests.strip() in [line.strip() for line in ci], ".ci/run does not run the README's test command"


def test_every_result_file_is_cited_by_readme_or_docs():
    cited = _cited_text()
    results = sorted((ROOT / "bench" / "results").iterdir())
    assert results
    # A pair cited as name.{json,png} counts for both files.
    uncited = [p.name for p in results if p.name not in cited and f"{p.stem}.{{json,png}}" not in cited]
    assert not uncited, f"bench/results/ holds files no README or docs cite: {uncited}"


def test_every_example_is_named_by_the_readme():
    text = README.read_text()
    for example in sorted((ROOT / "examples").glob("*.py")):
        assert f"examples/{example.name}" in text


def test_readme_links_to_docs_exist():
    for link in re.findall(r"\]\((docs/[^)#]+)", README.read_text()):
        assert (ROOT / link).exists(), link


@pytest.mark.slow
def test_quick_start_runs_as_written(tmp_path):
    code = quick_start()
    assert '"tiny"' in code  # the quick start builds the tiny policy: seconds, not minutes
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "HILORE_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"predicted peak \d\.\d\dx GC's", done.stdout)


#: After the quick start: one call at a length the plan was not made for, then the same
#: plan read back from its file (no trace with it) on a fresh model at both lengths.
_NEW_LENGTH = """
import warnings
with hilore.exposure("b1"):
    compiled(ids[:, :96]).logsumexp(-1).mean().backward()           # re-solved from the plan's trace
plan.save("plan.json")
torch._dynamo.reset()  # as in a new process: dynamo would serve this forward from the first model's graph
again = torch.compile(build_model("tiny"), backend="hilore", options={"plan": hilore.load_plan("plan.json")})
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    for n in (128, 96):
        again(ids[:, :n]).logsumexp(-1).mean().backward()
print("warned:", [str(w.message) for w in said if "hilore" in str(w.message)])
"""


@pytest.mark.slow
def test_a_quick_start_plan_at_a_new_length_is_re_solved_or_falls_back_once(tmp_path):
    """The README's plan, called at 96 tokens: re-solved from the trace it carries. Read from a
    file it carries none: that graph runs plain Inductor with one warning; training goes on."""
    done = subprocess.run([sys.executable, "-c", quick_start() + _NEW_LENGTH], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "HILORE_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "re-solving the plan for batch 2, sequence 96 from its trace" in done.stderr
    warned = done.stdout.split("warned:", 1)[1]
    assert warned.count("no trace is at hand") == 1 and "falls back to Inductor" in warned, warned


@pytest.mark.slow
def test_hf_compile_example_runs_on_one_tiny_architecture():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "hf_compile.py"), "--archs", "llama",
                           "--seq-len", "16"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    row = done.stdout.splitlines()[-1].split()
    assert row[0] == "llama" and float(row[1]) < 1e-4  # store/recompute only: eager's gradient


@pytest.mark.slow
def test_trl_example_trains_one_step(tmp_path):
    pytest.importorskip("trl")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "trl_grpo.py"), "--steps", "1",
                           "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled graphs:" in done.stdout
