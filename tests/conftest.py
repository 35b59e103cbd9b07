"""Test-wide settings.

Inductor's graph caches (FX graph, AOTAutograd) are off so every compile
runs the hilore partitioner (a cache hit would skip it and leave nothing to
inspect); its C++ kernel cache stays on, so a kernel many tests generate is
compiled once. The backend's zero-config plans go to a per-session folder,
not ~/.cache.
"""

import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
os.environ.setdefault("HILORE_CACHE_DIR", tempfile.mkdtemp(prefix="hilore-test-cache-"))
