//! `fit` times every configuration with glibc's `malloc` settled: its mmap threshold
//! raised to the cap, whatever ran before. In a process of its own (this file), so
//! that the state before `fit` is glibc's own.
use memsave_checkpoint::CheckpointedSequential;
use memsave_plan::{fit, Batch, FitRequest, Workload};
use memsave_sys::alloc::c_mapped_blocks;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

/// Two small linear layers: no tensor anywhere near a MiB.
struct Small {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    data: Tensor,
}

impl Workload for Small {
    fn name(&self) -> &str {
        "small"
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

/// Whether glibc gives a fresh block of `bytes` a mapping of its own (freeing it raises
/// the threshold to its size if it did).
fn mapped_on_its_own(bytes: usize) -> bool {
    let before = c_mapped_blocks().expect("glibc says how many blocks it maps");
    let block = std::hint::black_box(Vec::<u8>::with_capacity(bytes));
    let during = c_mapped_blocks().unwrap();
    drop(block);
    during == before + 1
}

#[test]
fn after_fit_glibc_serves_blocks_up_to_its_cap_from_the_heap() {
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let mut layers = CheckpointedSequential::new();
    for i in 0..2 {
        let l = nn::linear(vs.root() / i, 16, 16, Default::default());
        layers = layers.add_fn(move |x| l.forward(x).tanh());
    }
    let data = Tensor::rand([8, 16], (Kind::Float, Device::Cpu));
    let mut model = Small { vs, layers, data };
    // glibc's own state: a 24 MiB block is mapped (and its free raises the threshold
    // to 24 MiB, no further).
    assert!(mapped_on_its_own(24 << 20), "glibc starts below 24 MiB");
    fit(&mut model, &FitRequest::new(64 << 20)).unwrap();
    // Nothing but `fit`'s settling frees a block near 32 MiB in this process.
    assert!(
        !mapped_on_its_own(31 << 20),
        "a 31 MiB block was given a mapping of its own after fit"
    );
}
