//! A step whose backward fails (the seed's `x += f(x)`, which overwrites what `f` saved
//! for backward) gives its memory back: the input and the weights are not kept alive by
//! the reference cycle the in-place update makes through autograd's saved tensors. The
//! step is run in a fresh process, where no earlier test has installed memsave's
//! autograd engine: libtorch's own engine leaves that cycle in place.
use memsave_checkpoint::CheckpointedSequential;
use memsave_step::step::f_step_with;
use memsave_step::{Batch, StepConfig, Workload};
use std::process::Command;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// Three layers of `x += x W` on a [16, 32] input: the matmul saves `x` to compute
/// `W`'s gradient, and the in-place add changes it, so backward fails.
struct InplaceResidual {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    data: Tensor,
}

impl InplaceResidual {
    fn new() -> Self {
        tch::manual_seed(3);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut layers = CheckpointedSequential::new();
        for i in 0..3 {
            let lin = nn::linear(vs.root() / i, 32, 32, Default::default());
            layers = layers.add_fn(move |x| {
                let y = lin.forward(x);
                let mut x = x.shallow_clone();
                let _ = x.g_add_(&y);
                x
            });
        }
        let data = Tensor::rand([16, 32], (Kind::Float, Device::Cpu));
        Self { vs, layers, data }
    }
}

impl Workload for InplaceResidual {
    fn name(&self) -> &str {
        "inplace-residual"
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
        // A copy, so that the in-place layers do not change the workload's data.
        Ok(Batch::input(
            self.data.f_narrow(0, 0, size)?.f_detach_copy()?,
        ))
    }
}

/// Runs in the child process: bytes allocated after the failed step, every handle
/// dropped, equal those before it.
#[test]
#[ignore = "run by a_failed_backward_gives_back_the_input_and_activations, in a fresh process"]
fn failed_step_worker() {
    let model = InplaceResidual::new();
    let before = memsave_meter::f_memory_allocated(Device::Cpu).unwrap();
    {
        let x = model.batch(16).unwrap();
        let err = f_step_with(
            &model,
            &x,
            &StepConfig::baseline(),
            Device::Cpu,
            false,
            None,
            None,
        )
        .expect_err("backward through the overwritten input must fail");
        assert!(
            err.to_string().contains("inplace operation"),
            "the failure is libtorch's version check: {err}"
        );
    }
    for p in model.parameters() {
        assert!(
            !p.grad().defined(),
            "no gradient is left from the failed step"
        );
    }
    let after = memsave_meter::f_memory_allocated(Device::Cpu).unwrap();
    assert_eq!(
        after,
        before,
        "bytes allocated after the failed step, every handle dropped ({} B more)",
        after as i64 - before as i64
    );
}

#[test]
fn a_failed_backward_gives_back_the_input_and_activations() {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([
            "failed_step::failed_step_worker",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .output()
        .expect("start the test binary");
    assert!(
        out.status.success(),
        "the worker failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the worker did not run: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
