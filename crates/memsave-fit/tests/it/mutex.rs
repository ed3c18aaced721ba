//! `fit` on layers that hold a `Mutex` (the way to share a tch module, which is `Send`
//! but not `Sync`, with a checkpoint closure) and call tch's panicking methods: a budget
//! that some probes exceed must not make a layer fail inside `fit` (which would poison
//! its lock), and a successful `fit` prints nothing to stderr.
use memsave_checkpoint::CheckpointedSequential;
use memsave_fit::{fit, FitRequest};
use memsave_step::step::f_step;
use memsave_step::{Batch, StepConfig, Workload};
use std::process::Command;
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// Set in the child process that runs the scenario with stderr captured.
const CHILD: &str = "MEMSAVE_FIT_MUTEX_CHILD";

/// Residual blocks `x + down(gelu(up(x)))` whose two linears sit behind mutexes.
struct Locked {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    linears: Vec<Arc<Mutex<nn::Linear>>>,
    data: Tensor,
}

impl Locked {
    fn new(blocks: usize, hidden: i64, batch: i64, rows: i64) -> Locked {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut seq = CheckpointedSequential::new();
        let mut linears = Vec::new();
        for i in 0..blocks {
            let p = vs.root() / i;
            let up = Arc::new(Mutex::new(nn::linear(
                &p / "up",
                hidden,
                2 * hidden,
                Default::default(),
            )));
            let down = Arc::new(Mutex::new(nn::linear(
                &p / "down",
                2 * hidden,
                hidden,
                Default::default(),
            )));
            linears.push(Arc::clone(&up));
            linears.push(Arc::clone(&down));
            seq = seq.add_fn(move |x| {
                // As a user writes it: a poisoned lock or a failed op panics here.
                let h = up.lock().unwrap().forward(x).gelu("none");
                x + down.lock().unwrap().forward(&h)
            });
        }
        let data = Tensor::rand([batch, rows, hidden], (Kind::Float, Device::Cpu));
        Locked {
            vs,
            layers: seq,
            linears,
            data,
        }
    }
}

impl Workload for Locked {
    fn name(&self) -> &str {
        "locked-mlp"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn layers(&self) -> &CheckpointedSequential {
        &self.layers
    }
    fn layers_mut(&mut self) -> &mut CheckpointedSequential {
        &mut self.layers
    }
    fn parameters(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }
    fn global_batch(&self) -> i64 {
        self.data.size()[0]
    }
    fn batch(&self, size: i64) -> Result<Batch, tch::TchError> {
        Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
    }
    fn loss(&self, output: &Tensor, _target: Option<&Tensor>) -> Result<Tensor, tch::TchError> {
        output.f_square()?.f_mean(Kind::Float)
    }
}

/// Fits the locked model to a third of its plain step's peak (so that probes go over
/// the budget), then runs it again: every lock must still be usable.
fn scenario() {
    memsave_meter::install();
    let mut model = Locked::new(6, 32, 16, 32);
    let x = model.batch(16).unwrap();
    let plain = f_step(
        &model,
        &x,
        &StepConfig::baseline(),
        Device::Cpu,
        false,
        None,
    )
    .unwrap();
    memsave_accum::free_grads(&model.parameters()).unwrap();
    let budget = plain.peak_bytes / 5;

    let report = fit(&mut model, &FitRequest::new(budget)).unwrap_or_else(|e| panic!("{e}"));
    assert!(report.measured_peak_bytes <= budget, "{}", report.to_text());
    // The scenario is the one the issue is about: some run went over the budget.
    let over = report.small_runs_over_budget
        + report.runners_up_over_budget
        + report
            .candidates
            .iter()
            .filter(|c| c.note.is_some())
            .count();
    assert!(
        over > 0,
        "no run went over the budget:\n{}",
        report.to_text()
    );
    assert_eq!(memsave_meter::memory_limit(Device::Cpu), None);

    // No lock is poisoned, and the model still steps (on the schedule fit chose).
    for (i, linear) in model.linears.iter().enumerate() {
        assert!(!linear.is_poisoned(), "linear {i}'s lock is poisoned");
    }
    let again = f_step(
        &model,
        &x,
        &StepConfig::baseline(),
        Device::Cpu,
        false,
        None,
    );
    assert!(again.is_ok(), "{again:?}");
}

#[test]
#[serial_test::serial]
fn fit_on_layers_holding_a_mutex_returns_ok_and_leaves_the_locks_usable() {
    scenario();
}

/// The scenario in a child process (this binary, re-run on one test), its stderr
/// captured: a successful `fit` prints nothing there, with backtraces on or not.
#[test]
fn a_successful_fit_prints_nothing_to_stderr() {
    if std::env::var_os(CHILD).is_some() {
        return; // the child runs `child_scenario` only
    }
    // The test's name in this binary: its module path less the crate's name (a file
    // of its own, or a module of a binary holding several).
    let name = match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::child_scenario"),
        None => "child_scenario".to_owned(),
    };
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the child failed:\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stdout.contains(&format!("test {name} ... ok")),
        "the child did not run the scenario:\n{stdout}"
    );
    assert!(
        stderr.trim().is_empty(),
        "a successful fit printed to stderr:\n{stderr}"
    );
}

/// Runs the scenario only in the child of [`a_successful_fit_prints_nothing_to_stderr`].
#[test]
fn child_scenario() {
    if std::env::var_os(CHILD).is_some() {
        scenario();
    }
}
