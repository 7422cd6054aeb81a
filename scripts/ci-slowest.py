#!/usr/bin/env python3
"""The ten slowest tests and test binaries of a cargo-nextest run, from its JUnit report.

    python3 scripts/ci-slowest.py target/nextest/ci/junit.xml [N]

Prints two Markdown tables (seconds per test; per binary the sum of its tests' seconds and
their count). nextest runs tests in parallel, so a binary's sum is CPU-side time, not wall.
"""
import sys
import xml.etree.ElementTree as ET


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    root = ET.parse(sys.argv[1]).getroot()
    tests, binaries = [], {}
    for suite in root.iter("testsuite"):
        name = suite.get("name", "?")
        for case in suite.iter("testcase"):
            t = float(case.get("time", "0"))
            tests.append((t, name, case.get("name", "?")))
            total, count = binaries.get(name, (0.0, 0))
            binaries[name] = (total + t, count + 1)
    tests.sort(reverse=True)
    print(f"| slowest tests | binary | s |\n|---|---|---|")
    for t, b, c in tests[:n]:
        print(f"| {c} | {b} | {t:.1f} |")
    print(f"\n| slowest binaries (sum of their tests) | tests | s |\n|---|---|---|")
    for b, (t, count) in sorted(binaries.items(), key=lambda kv: -kv[1][0])[:n]:
        print(f"| {b} | {count} | {t:.1f} |")
    print(f"\n{len(tests)} tests in {len(binaries)} binaries, {sum(t for t, _, _ in tests):.1f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
