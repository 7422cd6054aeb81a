#!/usr/bin/env python3
"""Checks that two results.json files of train_shakespeare have the same shape: the same keys
at every level (the union of the keys of a list's elements), the same type at every leaf
(null matches any type: a statistic undefined in one configuration), the same target ids,
variants, seeds, paired differences and gradient-parity configurations, and no empty
evaluation list. Values are not compared. CI runs it on the committed CPU JSON
(docs/figures/train_shakespeare_cpu.json) and the smoke configuration's fresh one, so the
code and the committed results cannot drift apart.

    python3 scripts/train-json-shape.py COMMITTED.json FRESH.json
"""
import json
import sys


def kind(v):
    if v is None:
        return None
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return type(v).__name__


def shape(v, path="$", out=None):
    """Key paths of `v` (list elements merged under `path[]`) -> the set of leaf types."""
    out = {} if out is None else out
    if isinstance(v, dict):
        for k, x in v.items():
            p = f"{path}.{k}"
            out.setdefault(p, set())
            shape(x, p, out)
    elif isinstance(v, list):
        keys = {tuple(sorted(x)) for x in v if isinstance(x, dict)}
        if len(keys) > 1:  # elements of one list must not differ in their keys
            out.setdefault(f"{path}[] (elements with different keys)", set())
        for x in v:
            shape(x, path + "[]", out)
    else:
        out.setdefault(path, set()).add(kind(v))
    return out


def listed(j, key, field):
    items = j.get(key) if isinstance(j, dict) else None
    return [x.get(field) if isinstance(x, dict) else None for x in items] if isinstance(items, list) else None


def facts(j):
    if not isinstance(j, dict):
        return {"top level": type(j).__name__}
    parity = j.get("gradient_parity") or {}
    configs = parity.get("configs") if isinstance(parity, dict) else None
    runs = j.get("runs") if isinstance(j.get("runs"), list) else []
    return {
        "target ids": listed(j, "targets", "id"),
        "variants": sorted({r.get("variant") for r in runs if isinstance(r, dict)}, key=str),
        "seeds": j.get("seeds"),
        "paired differences": listed(j, "differences", "variant"),
        "gradient-parity configurations": [(c.get("bits"), c.get("recompute")) for c in configs or []],
        "runs without evaluations": [r.get("name") for r in runs if isinstance(r, dict) and not r.get("evals")],
    }


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, b = (json.load(open(p)) for p in sys.argv[1:])
    problems = []
    sa, sb = shape(a), shape(b)
    for p in sorted(sa.keys() - sb.keys()):
        problems.append(f"only in {sys.argv[1]}: {p}")
    for p in sorted(sb.keys() - sa.keys()):
        problems.append(f"only in {sys.argv[2]}: {p}")
    for p in sorted(sa.keys() & sb.keys()):
        ta, tb = sa[p] - {None}, sb[p] - {None}
        if ta and tb and ta != tb:
            problems.append(f"{p}: {sorted(ta)} vs {sorted(tb)}")
    fa, fb = facts(a), facts(b)
    for what in fa:
        if fa[what] != fb.get(what):
            problems.append(f"{what} differ: {fa[what]} vs {fb.get(what)}")
    for what in ("runs without evaluations",):
        if fb.get(what):
            problems.append(f"{sys.argv[2]}: {what}: {fb[what]}")
    if problems:
        print("\n".join(problems))
        sys.exit(f"{len(problems)} difference(s): regenerate the committed results (scripts/train-results.sh)")
    print(f"same shape: {len(sa)} key paths, {len(fa['target ids'] or [])} targets")


if __name__ == "__main__":
    main()
