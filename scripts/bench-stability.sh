#!/usr/bin/env bash
# Are `memsave bench`'s times to be trusted? Runs the seed suite twice, then once with
# `baseline` moved last, and prints each strategy's median time in the three runs, how
# far the two runs differ, and the `x base` ratio with baseline first and last. Run it
# on a quiet machine (after ./libtorch-setup.sh):  bash scripts/bench-stability.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p memsave-bench
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
python3 - "$out" <<'PY'
import sys
out = sys.argv[1]
lines = open("suites/seed.yaml").read().splitlines()
lines.remove("  - baseline")
open(f"{out}/seed-last.yaml", "w").write("\n".join(lines + ["  - baseline", ""]))
PY
target/release/memsave bench suites/seed.yaml --json "$out/first.json"
target/release/memsave bench suites/seed.yaml --json "$out/second.json" >/dev/null
target/release/memsave bench "$out/seed-last.yaml" --json "$out/last.json" >/dev/null
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def medians(name):
    cases = json.load(open(f"{out}/{name}.json"))["cases"]
    return {c["strategy"]: c["step_time_s"]["median"] for c in cases if c["status"] == "ok"}
a, b, c = medians("first"), medians("second"), medians("last")
print(f"{'strategy':30} {'run 1 s':>8} {'run 2 s':>8} {'differ':>7} {'x base':>7} {'(last)':>7} {'differ':>7}")
worst_runs = worst_base = 0.0
for s in a:
    runs = abs(a[s] - b[s]) / min(a[s], b[s])
    x_first, x_last = a[s] / a["baseline"], c[s] / c["baseline"]
    base = abs(x_first - x_last) / min(x_first, x_last)
    worst_runs, worst_base = max(worst_runs, runs), max(worst_base, base)
    print(f"{s:30} {a[s]:8.4f} {b[s]:8.4f} {runs:7.1%} {x_first:7.2f} {x_last:7.2f} {base:7.1%}")
print(f"largest difference between the runs: {worst_runs:.1%}; of x base, baseline first or last: {worst_base:.1%}")
PY
