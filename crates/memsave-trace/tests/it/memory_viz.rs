//! The snapshot through PyTorch's own tool, `torch.cuda._memory_viz` of the torch
//! wheel that `libtorch-setup.sh` installs: it accepts the file, and replaying the
//! file gives the meter's peak and end.
use memsave_meter::measure;
use memsave_trace::{Category, Phase, Recorder};
use serial_test::serial;
use std::path::PathBuf;
use std::process::Command;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// The python of the torch environment, found as `libtorch-setup.sh` finds it.
fn torch_python() -> PathBuf {
    let home = std::env::var_os("MEMSAVE_TORCH_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/memsave/torch-2.13.0")
        });
    let python = home.join("bin/python");
    assert!(
        python.is_file(),
        "{} is missing: run ./libtorch-setup.sh (or set MEMSAVE_TORCH_HOME)",
        python.display()
    );
    python
}

/// Reads the snapshot with `_memory_viz`'s functions and prints `peak end flame_bytes`;
/// then runs the module's command line (`python -m torch.cuda._memory_viz ...`) for
/// `trace_plot` and `segment_plot` (writing `<plot>.html` in the snapshot's directory)
/// and `stats` (its output follows on stdout). One interpreter for all of it: each
/// start imports torch, a second or more.
const CHECK: &str = r#"
import os, pickle, runpy, sys, warnings
from torch.cuda import _memory_viz as mv
with open(sys.argv[1], "rb") as f:
    data = pickle.load(f)
current = peak = 0
for e in data["device_traces"][0]:
    if e["action"] == "alloc":
        current += e["size"]
        peak = max(peak, current)
    elif e["action"] == "free_completed":
        current -= e["size"]
lines = mv.memory(data, format_flamegraph=lambda lines: lines)
flame = sum(int(l.rsplit(" ", 1)[1]) for l in lines.splitlines() if l.strip())
mv.segsum(data)
text = mv.trace(data)
assert "entries" in text, text[:200]
names = {f["name"] for e in data["device_traces"][0] for f in e["frames"]}
assert "saved_activation of AddmmBackward0" in names, names
assert "aten::addmm" in names, names
assert "the tensor's grad_fn: AddBackward0" in names, names
assert any("memsave:gradient" in l for l in lines.splitlines()), lines[:500]
print(peak, current, flame, flush=True)
# The module's `__main__`, as `python -m` runs it (runpy warns that the module is
# already imported: it runs a fresh copy of it all the same).
warnings.simplefilter("ignore", RuntimeWarning)
directory = os.path.dirname(sys.argv[1])
commands = [[plot, sys.argv[1], "-o", os.path.join(directory, plot + ".html")]
            for plot in ("trace_plot", "segment_plot")]
for args in commands + [["stats", sys.argv[1]]]:
    sys.argv = ["_memory_viz.py"] + args
    runpy.run_module("torch.cuda._memory_viz", run_name="__main__")
"#;

#[test]
#[serial]
fn torch_memory_viz_accepts_the_snapshot_and_finds_the_same_peak() {
    memsave_meter::install();
    let dev = Device::Cpu;
    let vs = nn::VarStore::new(dev);
    let layers: Vec<_> = (0..4)
        .map(|i| nn::linear(vs.root() / i, 32, 32, Default::default()))
        .collect();
    let x = Tensor::randn([16, 32], (Kind::Float, dev));
    let params = vs.trainable_variables();
    let ((_, m), trace) = Recorder::new(dev)
        .parameters(&params)
        .inputs(&[x.shallow_clone()])
        .record(|s| {
            measure(dev, |_| {
                s.phase(Phase::Forward);
                let mut h = x.shallow_clone();
                for (i, layer) in layers.iter().enumerate() {
                    s.mark(format!("layer {i}"));
                    h = &h + layer.forward(&h);
                }
                let loss = h.square().mean(Kind::Float);
                s.phase(Phase::Backward);
                loss.backward();
            })
        })
        .unwrap();
    let meter_peak = m.start_bytes + m.peak_bytes;
    assert_eq!(trace.peak_bytes(), meter_peak);
    assert!(trace.end_bytes()[Category::Gradient] > 0);

    let dir = tempfile::tempdir().unwrap();
    let snapshot = dir.path().join("snapshot.pickle");
    std::fs::write(&snapshot, trace.to_snapshot_pickle().unwrap()).unwrap();
    let python = torch_python();

    let out = Command::new(&python)
        .args(["-c", CHECK])
        .arg(&snapshot)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let (first, stats) = stdout.split_once('\n').unwrap_or((&stdout, ""));
    let numbers: Vec<u64> = first
        .split_whitespace()
        .map(|n| n.parse().unwrap())
        .collect();
    assert_eq!(numbers, vec![meter_peak, m.end_bytes, m.end_bytes]);

    for plot in ["trace_plot", "segment_plot"] {
        let html = dir.path().join(format!("{plot}.html"));
        let page = std::fs::read_to_string(&html)
            .unwrap_or_else(|e| panic!("{plot}: {}: {e}", html.display()));
        assert!(page.contains("snapshot.pickle"), "{plot}: {page:.200}");
    }
    assert!(stats.contains("total_allocated"), "stats: {stats:.200}");
}
