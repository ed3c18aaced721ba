"""Issue #35's time clause: the step at a quarter of PyTorch's best checkpoint peak.

Usage (after ./libtorch-setup.sh; the setup's Python, which has pyyaml):
    ~/.cache/memsave/torch-2.13.0/bin/python scripts/per_block_time.py [SUITE:MODEL ...]
        [--fraction 0.25] [--out DIR] [--pytorch-suite PATH] [--allow LEVER ...]

For each model (by default every model of suites/zoo.yaml, then suites/levers.yaml's):

1. PyTorch's checkpoint peaks: the model alone in a suite of ``baseline``,
   ``checkpoint: {every_layer: true}`` and, for a chain, ``checkpoint: {segments: k}``
   for k in 2, 3, 4, run by PyTorch (``scripts/reference/zoo.py`` for the zoo's kinds,
   ``--pytorch-suite`` (the developers' ``shared/reference/pytorch_suite.py``) for the
   harness's own); the best is the least peak among the checkpoint strategies.
2. The budget: ``fit`` counts the whole device, so it is what memsave's plain step
   holds at its start (parameters, buffers, the batch: the baseline's ``start_bytes``)
   plus ``fraction`` times PyTorch's best checkpoint peak (above the step's start).
3. ``memsave bench`` on the model alone with ``baseline``, ``fit: {budget, uniform:
   true}`` (every block, or every layer, under one lever; a chain's checkpoint solver)
   and ``fit: {budget}`` (a lever per block or per layer), timed in the same
   interleaved rounds.

It prints one Markdown table: per model, the budget, each fit strategy's choice, its
median step time and its ratio to memsave's plain step in the same rounds and to
PyTorch's plain step (PyTorch's median of its own two repeats, another process), and
whether fit's measured whole-device peak is within the budget. Every figure comes from
the tools; the JSON files stay in ``--out``.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ZOO_KINDS = {"resnet", "mobilenet_v2", "llama", "vit", "unet", "encoder_decoder"}
GRAPH_KINDS = {"unet", "encoder_decoder"}
MEMSAVE = os.path.join(ROOT, "target", "release", "memsave")


def one_model_suite(suite, model, strategies, path):
    """Writes `suite`'s settings with `model` alone and `strategies` to `path`."""
    doc = {k: v for k, v in suite.items() if k not in ("models", "strategies")}
    doc["models"] = [model]
    doc["strategies"] = strategies
    with open(path, "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)


def cases(path):
    with open(path) as f:
        return {c["strategy"]: c for c in json.load(f)["cases"]}


def mib(b):
    return f"{b / 2**20:.2f} MiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="*")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--allow",
        action="append",
        default=[],
        help="a lossy lever fit may use (as memsave fit --allow: micro-batches, bf16, ...); repeat for more",
    )
    ap.add_argument(
        "--table-only",
        action="store_true",
        help="print the table of the rows already in --out (rows.jsonl)",
    )
    ap.add_argument(
        "--pytorch-suite",
        default=os.path.join(ROOT, "..", "shared", "reference", "pytorch_suite.py"),
    )
    args = ap.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="per-block-time-")
    os.makedirs(out, exist_ok=True)
    rows_path = os.path.join(out, "rows.jsonl")
    if args.table_only:
        with open(rows_path) as f:
            table([json.loads(line) for line in f], args.fraction)
        return
    # The reference scripts build C++ with ninja, which sits beside this Python.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "memsave-bench"], cwd=ROOT, check=True
    )
    specs = args.specs
    if not specs:
        specs = []
        for suite in ("suites/zoo.yaml", "suites/levers.yaml"):
            with open(os.path.join(ROOT, suite)) as f:
                specs += [f"{suite}:{m['name']}" for m in yaml.safe_load(f)["models"]]
    rows = []
    for spec in specs:
        suite_path, name = spec.split(":")
        with open(os.path.join(ROOT, suite_path)) as f:
            suite = yaml.safe_load(f)
        model = next(m for m in suite["models"] if m["name"] == name)
        kind = model["kind"]
        # Two repeats for PyTorch's plain time; the rest as the suite says.
        suite = dict(suite, warmup=1, repeats=2)
        ckpts = [{"checkpoint": {"every_layer": True}}]
        if kind not in GRAPH_KINDS:
            ckpts += [{"checkpoint": {"segments": k}} for k in (2, 3, 4)]
        ref_yaml = os.path.join(out, f"{name}-ref.yaml")
        ref_json = os.path.join(out, f"{name}-pytorch.json")
        one_model_suite(suite, model, ["baseline"] + ckpts, ref_yaml)
        script = (
            os.path.join(ROOT, "scripts", "reference", "zoo.py")
            if kind in ZOO_KINDS
            else args.pytorch_suite
        )
        subprocess.run(
            [sys.executable, script, ref_yaml, ref_json],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        ref = cases(ref_json)
        best = min(
            c["peak_bytes"]
            for s, c in ref.items()
            if s.startswith("checkpoint") and c["status"] == "ok"
        )
        pytorch_plain = ref["baseline"]["step_time_s"]["median"]
        # memsave's plain step's start: parameters, buffers and the batch.
        base_yaml = os.path.join(out, f"{name}-base.yaml")
        base_json = os.path.join(out, f"{name}-base.json")
        one_model_suite(dict(suite, repeats=1), model, ["baseline"], base_yaml)
        subprocess.run(
            [MEMSAVE, "bench", base_yaml, "--json", base_json],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        start = cases(base_json)["baseline"]["start_bytes"]
        budget = start + math.ceil(args.fraction * best)
        # The strategies' names carry the budget in bytes ("B" is a unit of its own).
        allow = {"allow": [a.replace("-", "_") for a in args.allow]} if args.allow else {}
        fits = [
            {"fit": {"budget": f"{budget}B", "uniform": True, **allow}},
            {"fit": {"budget": f"{budget}B", **allow}},
        ]
        run_yaml = os.path.join(out, f"{name}.yaml")
        run_json = os.path.join(out, f"{name}.json")
        one_model_suite(dict(suite, repeats=3), model, ["baseline"] + fits, run_yaml)
        subprocess.run(
            [MEMSAVE, "bench", run_yaml, "--json", run_json],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        got = cases(run_json)
        plain = got["baseline"]["step_time_s"]["median"]
        row = {
            "model": name,
            "best": best,
            "budget": budget,
            "plain": plain,
            "pytorch_plain": pytorch_plain,
        }
        for label, c in zip(
            ("uniform", "per_block"),
            [v for k, v in got.items() if k.startswith("fit(")],
        ):
            if c["status"] != "ok":
                row[label] = (c["status"], None, False, c.get("error") or "")
                continue
            t = c["step_time_s"]["median"]
            within = c.get("fit_device_peak_bytes")
            row[label] = (c.get("choice"), t, within is not None and within <= budget, within)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
        with open(rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")
    table(rows, args.fraction)
    print(f"\nJSON files in {out}", file=sys.stderr)


def table(rows, fraction):
    """The Markdown table of `rows`."""
    print(
        f"| model | PyTorch's best checkpoint peak | budget ({fraction}x, whole device) "
        "| plain (memsave / PyTorch) | uniform choice | time (x plain / x PyTorch) "
        "| per-block choice | time (x plain / x PyTorch) |"
    )
    print("| --- | ---: | ---: | ---: | --- | ---: | --- | ---: |")
    for r in rows:
        cells = []
        for label in ("uniform", "per_block"):
            choice, t, ok, within = r[label]
            if t is None:
                # fit's refusal, short: the least it found.
                least = re.search(r"least memory found is (.*?), predicted peak ([0-9.]+ ?[KMG]?i?B)", within)
                why = f"least `{least.group(1)}`, {least.group(2)}" if least else within[:120]
                cells += [f"{choice}: {why}", "-"]
                continue
            mark = "" if ok else " (over the budget)"
            cells += [
                f"`{choice}`{mark}",
                f"{t * 1e3:.1f} ms ({t / r['plain']:.2f}x / {t / r['pytorch_plain']:.2f}x)",
            ]
        print(
            f"| {r['model']} | {mib(r['best'])} | {mib(r['budget'])} "
            f"| {r['plain'] * 1e3:.1f} / {r['pytorch_plain'] * 1e3:.1f} ms | "
            + " | ".join(cells)
            + " |"
        )


if __name__ == "__main__":
    main()
