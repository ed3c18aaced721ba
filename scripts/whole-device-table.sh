#!/usr/bin/env bash
# The README's whole-device table (issue #36): per zoo model, with AdamW, the smallest
# whole-device budget (parameters, optimizer state, input, gradients and everything the
# step allocates) each mode reaches, and the step time there:
#   - plain, and checkpoint every layer: `memsave bench`'s plain step and
#     `checkpoint: {every_layer: true}`, each with AdamW stepped after backward, their
#     peak above the step's start plus the parameters, AdamW's state and the input
#     (what `fit`'s budget counts besides, see the guide; the parameters and the input
#     from the breakdown of `memsave fit` with room to spare);
#   - fit, parameters on the device: the least `memsave fit --no-offload-params` finds
#     (its "give a budget of at least"), then fit run at that budget;
#   - fit, parameters in files: the same without `--no-offload-params`.
# Every figure comes from the tools; nothing is typed in.
#   bash scripts/whole-device-table.sh [model ...]     # after ./libtorch-setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p memsave-bench
models=("$@")
if [ ${#models[@]} -eq 0 ]; then
    models=(vit-small llama-small resnet18-64px unet-64px)
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bin=target/release/memsave

# The least budget a fit finds for $1 with extra flags $2..: fit refuses a budget below
# what any step holds before building anything and names that least; at that least it
# searches and names the smallest budget it reaches ("give a budget of at least").
least() {
    local model=$1
    shift
    local said at
    said=$("$bin" fit suites/zoo.yaml --model "$model" --budget 1KiB --optimizer adamw "$@" 2>&1 >/dev/null || true)
    at=$(printf '%s\n' "$said" | sed -n 's/.*give a budget of at least \([0-9.]* [KMG]*i*B\).*/\1/p' | tail -1)
    said=$("$bin" fit suites/zoo.yaml --model "$model" --budget "${at// /}" --optimizer adamw "$@" 2>&1 >/dev/null || true)
    printf '%s\n' "$said" | sed -n 's/.*give a budget of at least \([0-9.]* [KMG]*i*B\).*/\1/p' | tail -1
}

for m in "${models[@]}"; do
    "$bin" fit suites/zoo.yaml --model "$m" --budget 4GiB --optimizer adamw --json "$out/$m-plain.json" >/dev/null 2>&1
    { sed -n '1,/^models:/p' suites/zoo.yaml | grep -v '^models:'
      echo "models:"
      grep -E "^  - \{name: $m," suites/zoo.yaml
      echo "strategies:"
      echo "  - {name: adamw, with: [{optimizer: {kind: adamw}}]}"
      echo "  - {name: checkpoint+adamw, with: [{checkpoint: {every_layer: true}}, {optimizer: {kind: adamw}}]}"
    } > "$out/$m.yaml"
    "$bin" bench "$out/$m.yaml" --json "$out/$m-checkpoint.json" >/dev/null 2>&1
    for mode in on-device in-files; do
        flags=()
        [ "$mode" = on-device ] && flags=(--no-offload-params)
        budget=$(least "$m" "${flags[@]}")
        if [ -n "$budget" ]; then
            "$bin" fit suites/zoo.yaml --model "$m" --budget "${budget// /}" --optimizer adamw "${flags[@]}" \
                --json "$out/$m-$mode.json" >/dev/null 2>&1 || echo "{\"failed_at\": \"$budget\"}" > "$out/$m-$mode.json"
        else
            echo '{"failed_at": null}' > "$out/$m-$mode.json"
        fi
    done
done

python3 - "$out" "${models[@]}" <<'PY'
import json, sys
out, models = sys.argv[1], sys.argv[2:]
def mib(b):
    return f"{b / 2**20:.2f} MiB"
def fit_cell(path):
    r = json.load(open(path))
    if "failed_at" in r:
        return f"did not fit at {r['failed_at']}"
    return (f"{mib(r['budget_bytes'])}: {r['choice']['strategy']} ({r['choice']['micro_batches']}x"
            f"{r['choice']['micro_batch']}), measured {mib(r['measured_peak_bytes'])}, "
            f"{r['measured_step_time_s']:.3f} s")
print("| model | parameters | plain | checkpoint every layer | fit, parameters on the device | fit, parameters in files |")
print("|---|---|---|---|---|---|")
for m in models:
    roomy = json.load(open(f"{out}/{m}-plain.json"))
    assert not roomy["choice"]["params_in_files"], roomy["choice"]["strategy"]
    params, inp = roomy["breakdown"]["parameters"], roomy["breakdown"]["input"]
    def bench_cell(case):
        if case["status"] != "ok":
            return f"{case['status']}: {case['error']}"
        whole = case["peak_bytes"] + params + case["optimizer_state_bytes"] + inp
        return f"{mib(whole)}, {case['step_time_s']['median']:.3f} s"
    plain, ckpt = json.load(open(f"{out}/{m}-checkpoint.json"))["cases"][:2]
    assert (plain["strategy"], ckpt["strategy"]) == ("adamw", "checkpoint+adamw")
    print(f"| {m} | {mib(params)} | {bench_cell(plain)} | {bench_cell(ckpt)} "
          f"| {fit_cell(f'{out}/{m}-on-device.json')} | {fit_cell(f'{out}/{m}-in-files.json')} |")
PY
