"""backend="hilore" resolves through the torch_dynamo_backends entry point alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch._dynamo import lookup_backend
    assert "hilore_compiler" not in sys.modules, "the test must not import the package itself"
    backend = lookup_backend("hilore")
    print(backend.__module__, backend.__name__)
    compiled = torch.compile(torch.nn.Linear(2, 2), backend="hilore")
    print(type(compiled).__name__)
""")


def test_backend_resolves_without_importing_the_package():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "hilore_compiler.backend.compiler hilore_backend"
    assert lines[1] == "OptimizedModule"
