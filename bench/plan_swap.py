"""Give one plan another plan's decisions for some units, to find which decisions cost time.

    python bench/plan_swap.py BASE.plan.json OTHER.plan.json OUT.plan.json KEY[,KEY...]

Every non-skip bucket of BASE takes OTHER's decision (its first non-skip bucket's) for each named
unit key. BASE must offer those options (a plan with more codecs as BASE). The memory prediction
is not redone: OUT is for timing (bench/plan_ab.py), not for a ceiling.
"""

import json
import sys
from pathlib import Path


def main(base: str, other: str, out: str, keys: list[str]) -> None:
    plan, theirs = json.loads(Path(base).read_text()), json.loads(Path(other).read_text())
    decisions = next(b for b in theirs["buckets"] if b["plan"] != "skip")["decisions"]
    for bucket in plan["buckets"]:
        if bucket["plan"] != "skip":
            bucket["decisions"].update({key: decisions[key] for key in keys})
    Path(out).write_text(json.dumps(plan, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(","))
