#!/usr/bin/env bash
# The README's ZeRO-3 table: suites/zero3.yaml (DDP, ZeRO-1, ZeRO-2, ZeRO-3 on an 8-layer
# model whose weights dominate) on 1, 2 and 4 local ranks, printed as a Markdown table
# from `memsave bench --json`. Every figure is the meter's, per rank; nothing is typed in.
#   bash scripts/zero3-table.sh            # after ./libtorch-setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p memsave-bench
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for n in 1 2 4; do
    target/release/memsave bench suites/zero3.yaml --world-size "$n" --json "$out/zero3-$n.json" >/dev/null
done
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
def b(v):
    return "–" if v is None else f"{v:,}"
print("| ranks | strategy | held between steps | peak (held + step) | weights held (`parameter_bytes`) | optimizer state | gradients after backward | most gathered weights | sent per step |")
print("|---|---|---|---|---|---|---|---|---|")
for n in (1, 2, 4):
    cases = json.load(open(f"{out}/zero3-{n}.json"))["cases"]
    for c in cases:
        if c["status"] != "ok":
            print(f"| {n} | {c['strategy']} | {c['status']}: {c['error']} |||||||")
            continue
        print(f"| {n} | {c['strategy']} | {b(c['start_bytes'])} | {b(c['start_bytes'] + c['peak_bytes'])} | "
              f"{b(c['parameter_bytes'])} | {b(c['optimizer_state_bytes'])} | {b(c['gradient_bytes'])} | "
              f"{b(c['gathered_peak_bytes'])} | {b(c['bytes_sent_per_step'])} |")
PY
