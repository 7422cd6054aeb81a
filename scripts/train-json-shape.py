#!/usr/bin/env python3
"""Checks that two results.json files of train_shakespeare have the same shape: the same keys
at every level (the union of the keys of a list's elements), the same target ids, the same
variants and the same seeds. Values are not compared. CI runs it on the committed CPU JSON
(docs/figures/train_shakespeare_cpu.json) and the smoke configuration's fresh one, so the
code and the committed results cannot drift apart.

    python3 scripts/train-json-shape.py COMMITTED.json FRESH.json
"""
import json
import sys


def shape(v, path="$"):
    """The set of key paths of `v` (list elements merged under `path[]`)."""
    out = set()
    if isinstance(v, dict):
        for k, x in v.items():
            p = f"{path}.{k}"
            out.add(p)
            out |= shape(x, p)
    elif isinstance(v, list):
        for x in v:
            out |= shape(x, path + "[]")
    return out


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = (json.load(open(p)) for p in sys.argv[1:])
    problems = []
    sa, sb = shape(a), shape(b)
    # a key whose value is null in one file and an object in the other shows up here too
    for p in sorted(sa - sb):
        problems.append(f"only in {sys.argv[1]}: {p}")
    for p in sorted(sb - sa):
        problems.append(f"only in {sys.argv[2]}: {p}")
    for what, get in [
        ("target ids", lambda j: [t["id"] for t in j.get("targets", [])]),
        ("variants", lambda j: sorted({r["variant"] for r in j.get("runs", [])})),
        ("seeds", lambda j: j.get("seeds")),
    ]:
        if get(a) != get(b):
            problems.append(f"{what} differ: {get(a)} vs {get(b)}")
    if problems:
        print("\n".join(problems))
        sys.exit(f"{len(problems)} difference(s): regenerate the committed results (scripts/train-results.sh)")
    print(f"same shape: {len(sa)} key paths, {len(a.get('targets', []))} targets")


if __name__ == "__main__":
    main()
