"""The README's zoo table: memsave's baseline peak against PyTorch's, per model.

Usage:
    python3 scripts/reference/zoo_table.py MEMSAVE.json PYTORCH.json [--strategy NAME] [--held HELD.json] [--update README.md]

MEMSAVE.json is ``memsave bench SUITE --json MEMSAVE.json``, PYTORCH.json is
``scripts/reference/zoo.py SUITE PYTORCH.json`` on the same suite. Prints a markdown
table with one row per model both measured: memsave's peak bytes of the strategy
(default: the baseline case, by ``is_baseline``), PyTorch's, and memsave's difference
from PyTorch in percent. With ``--update FILE`` the table also replaces the lines
between ``<!-- zoo-table:start -->`` and ``<!-- zoo-table:end -->`` in FILE, so the
README's numbers are this script's output and nothing else. With ``--held HELD.json``
(zoo.py's output from a version that held the model's output through backward, as a
loop that keeps ``out`` does) a last column gives that peak beside the others.
"""
import argparse
import json
import sys

START, END = "<!-- zoo-table:start -->", "<!-- zoo-table:end -->"


def peaks(path, strategy):
    """{model: (peak bytes, status, error)} of the chosen strategy's cases in a report."""
    report = json.load(open(path))
    found = {}
    for case in report["cases"]:
        chosen = case["strategy"] == strategy if strategy else case.get("is_baseline", case["strategy"] == "baseline")
        if chosen and case["model"] not in found:
            found[case["model"]] = (case.get("peak_bytes"), case["status"], case.get("error"))
    return found


def table(memsave, pytorch, strategy, held=None):
    what = f"`{strategy}`" if strategy else "baseline"
    rows = [f"| model | memsave {what} peak (bytes) | PyTorch peak (bytes) | difference |",
            "| --- | ---: | ---: | ---: |"]
    if held is not None:
        rows[0] += " PyTorch, output held through backward (bytes) |"
        rows[1] += " ---: |"
    for model, (ours, status, error) in memsave.items():
        if model not in pytorch:
            continue
        theirs, their_status, their_error = pytorch[model]
        if ours is None or theirs is None:
            reason = error if ours is None else their_error
            rows.append(f"| `{model}` | {ours if ours is not None else status} | "
                        f"{theirs if theirs is not None else their_status} | - ({reason}) |")
            continue
        diff = 100.0 * (ours - theirs) / theirs if theirs else float("nan")
        row = f"| `{model}` | {ours:,} | {theirs:,} | {diff:+.3f}% |"
        if held is not None:
            kept = held.get(model, (None,))[0]
            row += f" {kept:,} |" if kept is not None else " - |"
        rows.append(row)
    return "\n".join(rows)


def update(path, text):
    lines = open(path).read().split("\n")
    try:
        start, end = lines.index(START), lines.index(END)
    except ValueError:
        sys.exit(f"zoo_table.py: {path} has no {START} ... {END} lines to replace")
    if end < start:
        sys.exit(f"zoo_table.py: {path}: {END} comes before {START}")
    lines[start + 1:end] = [text]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("memsave", help="memsave bench --json output")
    parser.add_argument("pytorch", help="zoo.py output")
    parser.add_argument("--strategy", help="compare this strategy instead of the baseline")
    parser.add_argument("--held", metavar="FILE", help="zoo.py output with the model's output held through backward")
    parser.add_argument("--update", metavar="FILE", help="replace the table between the markers in FILE")
    args = parser.parse_args()
    held = peaks(args.held, args.strategy) if args.held else None
    text = table(peaks(args.memsave, args.strategy), peaks(args.pytorch, args.strategy), args.strategy, held)
    print(text)
    if args.update:
        update(args.update, text)


if __name__ == "__main__":
    main()
