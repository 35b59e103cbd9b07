"""Test-wide settings.

Inductor's on-disk caches are off so every compile runs the hilore
partitioner (a cache hit would skip it and leave nothing to inspect), and the
backend's zero-config plans go to a per-session folder, not ~/.cache.
"""

import os
import tempfile

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
os.environ.setdefault("HILORE_CACHE_DIR", tempfile.mkdtemp(prefix="hilore-test-cache-"))
