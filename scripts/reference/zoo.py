"""PyTorch's side of a zoo suite: the memsave-models networks trained by PyTorch itself.

Usage:
    ~/.cache/memsave/torch-2.13.0/bin/python scripts/reference/zoo.py SUITE.yaml OUT.json [--filter REGEX]

For every model of the suite whose kind is one of the zoo's (``resnet``,
``mobilenet_v2``, ``llama``, ``vit``, ``unet``, ``encoder_decoder``) it builds PyTorch's
own network (torchvision's ``resnet18``..``resnet152`` and ``mobilenet_v2``; the
LLaMA-style decoder, the vision transformer, the U-Net and the encoder-decoder of
``zoo_models.py``, torchvision's ``VisionTransformer`` for the ViT), a batch of the same
shapes and dtypes as memsave's synthetic batch, and measures each strategy's training
step exactly as ``memsave bench`` does:

    gradients None, parameters and batch allocated;
    peak = max bytes allocated during forward + loss + backward - bytes at the start.

The loss is the mean cross-entropy of the logits (reshaped to ``[-1, classes]``; the
U-Net's ``[batch, classes, height, width]`` as they are, one target per pixel) against
the target, as ``memsave_models::Network::loss``. Bytes come from a counting
CPU allocator of this script's own (below), which counts the bytes each storage asks
for, as memsave's meter does; the measure does not depend on the seed (no op here
allocates by the values of its input).

Strategies: ``baseline``, ``checkpoint: {every_layer: true}`` and
``checkpoint: {segments: k}`` (torch.utils.checkpoint on the chain of blocks memsave
builds: stem, each residual/inverted-residual/decoder/encoder block, head). The U-Net
and the encoder-decoder are not chains: ``every_layer`` is
``torch.utils.checkpoint(use_reentrant=False)`` around each of their named blocks (the
ones memsave runs through ``Blocks``), and ``segments`` is unavailable. Others are
reported ``unavailable``. Models of the harness's own kinds are reported
``unavailable`` too (``shared/reference/pytorch_suite.py`` runs those).

The JSON has the schema of ``memsave bench --json`` (schema version 2), so
``zoo_table.py`` (and ``memsave_bench::Report::from_json``) read both alike.

torchvision==0.28.0 is installed into this Python with pip when it is missing.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

TORCHVISION = "torchvision==0.28.0"


def ensure_torchvision():
    try:
        import torchvision  # noqa: F401
    except ImportError:
        print(f"zoo.py: installing {TORCHVISION} into {sys.executable}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", TORCHVISION], check=True)


ensure_torchvision()

import torch  # noqa: E402
import torchvision  # noqa: E402
import yaml  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.checkpoint import checkpoint, checkpoint_sequential  # noqa: E402
from torch.utils.cpp_extension import load_inline  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo_models  # noqa: E402

# The counting allocator: every storage's size in a table keyed by its pointer (so the
# data pointer is its own context, the raw-deleter convention oneDNN checks), the
# current total and its high-water mark.
COUNTER_SOURCE = r'''
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <mutex>
#include <unordered_map>

namespace {
std::mutex lock;
std::unordered_map<void*, size_t>* sizes = new std::unordered_map<void*, size_t>();
int64_t now_bytes = 0;
int64_t high_bytes = 0;

void release(void* data) {
  if (data == nullptr) return;
  {
    std::lock_guard<std::mutex> g(lock);
    auto found = sizes->find(data);
    if (found != sizes->end()) {
      now_bytes -= static_cast<int64_t>(found->second);
      sizes->erase(found);
    }
  }
  c10::free_cpu(data);
}

struct Tally final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* data = c10::alloc_cpu(bytes);
    if (data != nullptr) {
      std::lock_guard<std::mutex> g(lock);
      (*sizes)[data] = bytes;
      now_bytes += static_cast<int64_t>(bytes);
      if (now_bytes > high_bytes) high_bytes = now_bytes;
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* to, const void* from, size_t bytes) const override {
    default_copy_data(to, from, bytes);
  }
};
}  // namespace

void use_tally() {
  static Tally* tally = new Tally();
  c10::SetCPUAllocator(tally, /*priority=*/200);
}
int64_t allocated() { std::lock_guard<std::mutex> g(lock); return now_bytes; }
int64_t high_water() { std::lock_guard<std::mutex> g(lock); return high_bytes; }
void restart_high_water() { std::lock_guard<std::mutex> g(lock); high_bytes = now_bytes; }
'''


def load_counter():
    # ninja lives next to this Python in the project's venv.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    counter = load_inline("memsave_zoo_counter", cpp_sources=COUNTER_SOURCE,
                          functions=["use_tally", "allocated", "high_water", "restart_high_water"],
                          extra_cflags=["-O2"], verbose=False)
    counter.use_tally()
    return counter


ZOO_KINDS = ("resnet", "mobilenet_v2", "llama", "vit", "unet", "encoder_decoder")
# Kinds that are not chains: the model runs its own blocks, model(x, run).
GRAPH_KINDS = ("unet", "encoder_decoder")


def build(m):
    """(model, chain of blocks, classes) for a suite's model entry, in training mode; the
    chain is None for the kinds that are not chains (GRAPH_KINDS)."""
    kind = m["kind"]
    if kind == "resnet":
        channels = m["image"][0]
        net = getattr(torchvision.models, f"resnet{m['depth']}")(num_classes=m["classes"])
        if channels != 3:
            net.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
        stem = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)
        blocks = [b for stage in (net.layer1, net.layer2, net.layer3, net.layer4) for b in stage]

        def head(x):  # torchvision's ResNet._forward_impl after layer4
            return net.fc(torch.flatten(net.avgpool(x), 1))

        chain, classes = [stem, *blocks, head], m["classes"]
    elif kind == "mobilenet_v2":
        channels = m["image"][0]
        net = torchvision.models.mobilenet_v2(num_classes=m["classes"])
        if channels != 3:
            net.features[0][0] = nn.Conv2d(channels, 32, kernel_size=3, stride=2, padding=1, bias=False)

        def head(x):  # torchvision's MobileNetV2._forward_impl after features
            return net.classifier(torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1))

        chain, classes = [*net.features, head], m["classes"]
    elif kind == "llama":
        keys = ("vocab", "dim", "layers", "heads", "kv_heads", "hidden", "seq", "tied")
        net = zoo_models.llama({k: m[k] for k in keys if k in m})
        chain, classes = zoo_models.layers(net), m["vocab"]
    elif kind == "vit":
        keys = ("image", "patch", "dim", "layers", "heads", "mlp", "classes")
        net = zoo_models.vit({k: m[k] for k in keys})
        chain, classes = zoo_models.layers(net), m["classes"]
    elif kind == "unet":
        keys = ("image", "classes", "base", "levels")
        net, chain, classes = zoo_models.unet({k: m[k] for k in keys}), None, m["classes"]
    elif kind == "encoder_decoder":
        keys = ("vocab", "dim", "heads", "encoder_layers", "decoder_layers", "source", "target")
        net, chain, classes = zoo_models.encoder_decoder({k: m[k] for k in keys}), None, m["vocab"]
    else:
        raise ValueError(kind)
    net.train()
    return net, chain, classes


def synthetic_batch(m):
    """Input and target of memsave's synthetic batch: the same shapes and dtypes
    (images N(0, 1) and int64 labels; int64 tokens, the target their next ones)."""
    b = m["batch"]
    if m["kind"] == "llama":
        tokens = torch.randint(m["vocab"], (b, m["seq"] + 1))
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        del tokens
        return x, y
    if m["kind"] == "encoder_decoder":
        # Source and decoder input packed in one row, the target the decoder input
        # shifted by one (memsave_models::Task::Seq2Seq).
        source = torch.randint(m["vocab"], (b, m["source"]))
        target = torch.randint(m["vocab"], (b, m["target"] + 1))
        x = torch.cat([source, target[:, :-1]], 1)
        y = target[:, 1:].contiguous()
        del source, target
        return x, y
    if m["kind"] == "unet":
        _, height, width = m["image"]
        return torch.randn(b, *m["image"]), torch.randint(m["classes"], (b, height, width))
    return torch.randn(b, *m["image"]), torch.randint(m["classes"], (b,))


def strategy_name(s):
    """(memsave's canonical name, [(technique, arguments)]) of a strategies: entry."""
    if isinstance(s, str):
        return s, [(s, {})]
    if "name" in s or "with" in s:
        parts = [strategy_name(p) for p in s.get("with", [])]
        name = s.get("name") or "+".join(p[0] for p in parts)
        return name, [t for p in parts for t in p[1]]
    (kind, args), = s.items()
    args = args or {}
    inner = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in args.items())
    return f"{kind}({inner})", [(kind, args)]


def plan(techniques, graph=False):
    """The checkpointing a strategy asks for (None, ("every_layer",), ("segments", k)),
    or False when this script has no PyTorch counterpart for it (segments of a model
    that is not a chain, with ``graph``)."""
    chosen = None
    for kind, args in techniques:
        if kind == "baseline":
            continue
        if kind == "checkpoint" and args.get("every_layer"):
            chosen = ("every_layer",)
        elif kind == "checkpoint" and "segments" in args and not graph:
            chosen = ("segments", int(args["segments"]))
        else:
            return False
    return chosen


def _checkpointed(block, *inputs):
    return checkpoint(block, *inputs, use_reentrant=False)


def forward(net, chain, x, ckpt):
    if chain is None:  # not a chain: the model runs its blocks, each checkpointed or not
        return net(x, run=_checkpointed) if ckpt else net(x)
    if ckpt is None:
        for block in chain:
            x = block(x)
        return x
    if ckpt[0] == "segments":
        return checkpoint_sequential(chain, ckpt[1], x, use_reentrant=False)
    for block in chain:
        x = checkpoint(block, x, use_reentrant=False)
    return x


def step(counter, net, chain, classes, x, y, ckpt):
    """One training step: (peak, retained after forward, seconds, gradients)."""
    net.zero_grad(set_to_none=True)
    start = counter.allocated()
    counter.restart_high_water()
    t0 = time.perf_counter()
    out = forward(net, chain, x, ckpt)
    retained = counter.allocated() - start
    logits = out if out.dtype == torch.float32 else out.float()
    del out
    # The careful loop: nothing holds the output (the logits) through backward; what
    # the loss's backward needs of it, autograd keeps.
    if isinstance(net, zoo_models.UNet):  # [batch, classes, h, w] against [batch, h, w]
        loss = F.cross_entropy(logits, y)
    else:
        loss = F.cross_entropy(logits.reshape(-1, classes), y.reshape(-1))
    del logits
    loss.backward()
    del loss
    seconds = time.perf_counter() - t0
    peak = counter.high_water() - start
    grads = [p.grad.detach().clone() for p in net.parameters() if p.grad is not None]
    return peak, retained, seconds, grads, start


def blank_case(model, strategy):
    return dict(model=model, strategy=strategy, status="ok", error=None, start_bytes=None,
                peak_bytes=None, retained_after_forward_bytes=None, step_time_s=None,
                is_baseline=False, has_baseline=False, grad_max_abs_diff=None,
                grad_diverged=False, trace=[], peak_phase=None, optimizer_state_bytes=None,
                offloaded_bytes=None, compressed_saved_bytes=None, grad_rel_l2=None,
                world_size=None, gradient_bytes=None, bytes_sent_per_step=None,
                global_batch=None, tries=None, choice=None)


def selected(suite, pattern):
    """(model, [strategy entries]) as memsave bench --filter selects them."""
    chosen = []
    for m in suite["models"]:
        if not m.get("enabled", True) and not (pattern and m["name"] in pattern.pattern):
            continue
        entries = [s for s in suite["strategies"]
                   if pattern is None or pattern.search(f"{m['name']}/{strategy_name(s)[0]}")]
        if entries:
            chosen.append((m, entries))
    return chosen


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suite")
    parser.add_argument("out")
    parser.add_argument("--filter", help="only cases whose model/strategy matches (as memsave bench)")
    args = parser.parse_args()
    counter = load_counter()
    suite = yaml.safe_load(open(args.suite))
    if suite.get("threads"):
        torch.set_num_threads(int(suite["threads"]))
    warmup, repeats = int(suite.get("warmup", 1)), max(1, int(suite.get("repeats", 3)))
    pattern = re.compile(args.filter) if args.filter else None
    cases = []
    for m, entries in selected(suite, pattern):
        if m["kind"] not in ZOO_KINDS:
            for s in entries:
                case = blank_case(m["name"], strategy_name(s)[0])
                case.update(status="unavailable",
                            error=f"zoo.py runs the zoo's kinds only ({', '.join(ZOO_KINDS)}), not {m['kind']}")
                cases.append(case)
            continue
        torch.manual_seed(int(suite.get("seed", 0)))
        net, chain, classes = build(m)
        x, y = synthetic_batch(m)
        # Every case starts from the same random stream, as memsave's cases do, so
        # dropout draws alike and gradients compare.
        stream = torch.get_rng_state()
        baseline_grads = None
        for s in entries:
            torch.set_rng_state(stream)
            name, techniques = strategy_name(s)
            case = blank_case(m["name"], name)
            case["is_baseline"] = all(t == "baseline" for t, _ in techniques)
            ckpt = plan(techniques, graph=m["kind"] in GRAPH_KINDS)
            try:
                if ckpt is False:
                    case.update(status="unavailable", error="zoo.py has no PyTorch counterpart for this strategy")
                else:
                    for _ in range(warmup):
                        step(counter, net, chain, classes, x, y, ckpt)
                    peaks, times = [], []
                    for _ in range(repeats):
                        peak, retained, seconds, grads, start = step(counter, net, chain, classes, x, y, ckpt)
                        peaks.append(peak)
                        times.append(seconds)
                    times.sort()
                    case.update(start_bytes=start, peak_bytes=max(peaks),
                                retained_after_forward_bytes=retained, global_batch=m["batch"],
                                step_time_s=dict(min=times[0], median=times[len(times) // 2], max=times[-1]))
                    if case["is_baseline"]:
                        baseline_grads = grads
                    elif baseline_grads is not None:
                        diff = max((a - b).abs().max().item() for a, b in zip(grads, baseline_grads))
                        case.update(has_baseline=True, grad_max_abs_diff=diff)
                    net.zero_grad(set_to_none=True)
            except Exception as e:  # recorded as memsave records a failed case
                case.update(status="error", error=str(e).splitlines()[0] if str(e) else type(e).__name__)
            cases.append(case)
            shown = f"{case['peak_bytes']:,} B" if case["peak_bytes"] is not None else "-"
            print(f"{m['name']:>16} {name:<30} {case['status']:<11} peak {shown}", file=sys.stderr)
        del net, chain, x, y
    report = dict(schema_version=2, suite=suite["suite"], device="cpu",
                  libtorch_version=torch.__version__.split("+")[0],
                  threads=torch.get_num_threads(), cases=cases)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
