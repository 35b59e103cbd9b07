"""Give one plan another plan's decisions for some units, to find which decisions cost time.

    python bench/plan_swap.py BASE.plan.json OTHER.plan.json OUT.plan.json KEY[,KEY...]

Every non-skip bucket of BASE takes OTHER's decision (its first non-skip bucket's) for each named
unit key. BASE must offer those options (a plan with more codecs as BASE): OUT is checked as a
plan file is before it is written, so a decision BASE's units do not offer fails here. The memory
prediction is not redone: OUT is for timing (bench/plan_ab.py), not for a ceiling.
"""

import sys

from hilore_compiler.jsonio import read_json, write_json_atomic
from hilore_compiler.planfile import PLAN_SCHEMA, plan_from_json


def main(base: str, other: str, out: str, keys: list[str]) -> None:
    plan, theirs = read_json(base, PLAN_SCHEMA), read_json(other, PLAN_SCHEMA)
    decisions = next(b for b in theirs["buckets"] if b["plan"] != "skip")["decisions"]
    for bucket in plan["buckets"]:
        if bucket["plan"] != "skip":
            bucket["decisions"].update({key: decisions[key] for key in keys})
    plan_from_json(plan, where=out)  # checked before anything is written
    write_json_atomic(out, plan)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(","))
