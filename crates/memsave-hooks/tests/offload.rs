//! Disk offload: bitwise gradients, exact memory, an empty store after backward, and
//! bad directories and damaged files.
use memsave_hooks::{saved_tensors_hooks, DiskOffload, OffloadError};
use memsave_meter::f_memory_allocated;
use proptest::prelude::*;
use serial_test::serial;
use std::path::Path;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

struct Net {
    vs: nn::VarStore,
    layers: Vec<nn::Linear>,
}

/// `depth` layers of `h = h + Linear(width, width)(h)`: each layer saves its input.
fn net(depth: usize, width: i64, device: Device) -> Net {
    let vs = nn::VarStore::new(device);
    let layers = (0..depth)
        .map(|i| nn::linear(vs.root() / i, width, width, Default::default()))
        .collect();
    Net { vs, layers }
}

impl Net {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.layers
            .iter()
            .fold(x.shallow_clone(), |h, l| &h + l.forward(&h).relu())
    }

    fn clear_grads(&self) {
        for p in self.vs.trainable_variables() {
            memsave_sys::tensor::set_grad_none(&p).unwrap();
        }
    }

    fn grads(&self) -> Vec<Tensor> {
        self.vs
            .trainable_variables()
            .iter()
            .map(|p| p.grad().copy())
            .collect()
    }

    fn baseline_grads(&self, x: &Tensor) -> Vec<Tensor> {
        self.clear_grads();
        self.forward(x).square().mean(Kind::Float).backward();
        let g = self.grads();
        self.clear_grads();
        g
    }
}

fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

fn bitwise_equal(a: &[Tensor], b: &[Tensor]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.equal(y))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    #[test]
    #[serial]
    fn offload_gives_bitwise_baseline_gradients_and_leaves_memory_and_store_as_they_were(
        depth in 1usize..6,
        width in 1i64..40,
        batch in 1i64..6,
        prefetch in 0usize..3,
        max_in_flight in prop::sample::select(vec![0u64, 100, 1 << 20]),
        seed in 0i64..100,
    ) {
        tch::manual_seed(seed);
        let net = net(depth, width, Device::Cpu);
        let x = Tensor::randn([batch, width], (Kind::Float, Device::Cpu));
        let expected = net.baseline_grads(&x);
        let dir = tempfile::tempdir().unwrap();
        let start = f_memory_allocated(Device::Cpu).unwrap();
        let store = DiskOffload::new(dir.path()).unwrap()
            .excluding(&[x.shallow_clone()])
            .prefetch(prefetch)
            .max_in_flight_bytes(max_in_flight);
        let loss = saved_tensors_hooks(store.clone(), || net.forward(&x).square().mean(Kind::Float)).unwrap();
        store.flush().unwrap();
        // relu's output (saved by the next layer's addmm and by relu itself) per layer,
        // x excluded; with depth 1 only relu saves.
        prop_assert!(store.stats().tensors_written >= depth as u64);
        loss.backward();
        drop(loss);
        prop_assert!(bitwise_equal(&net.grads(), &expected));
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()).collect();
        prop_assert!(left.is_empty(), "{:?} {:?}", left, store.stats());
        prop_assert_eq!(store.stats().kept_in_memory, 0);
        net.clear_grads();
        prop_assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start);
    }
}

#[test]
#[serial]
fn after_the_writer_is_done_the_forward_retains_only_its_output() {
    let net = net(6, 64, Device::Cpu);
    let x = Tensor::randn([16, 64], (Kind::Float, Device::Cpu));
    let dir = tempfile::tempdir().unwrap();
    let start = f_memory_allocated(Device::Cpu).unwrap();
    let store = DiskOffload::new(dir.path())
        .unwrap()
        .excluding(&[x.shallow_clone()]);
    let y = saved_tensors_hooks(store.clone(), || net.forward(&x)).unwrap();
    store.flush().unwrap();
    assert_eq!(
        f_memory_allocated(Device::Cpu).unwrap() - start,
        16 * 64 * 4
    );
    assert!(files_in(dir.path()) > 0);
    drop(y);
    // Dropping the graph unused removes the files too.
    assert_eq!(files_in(dir.path()), 0);
    assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start);
}

#[test]
#[serial]
fn a_missing_or_unusable_directory_is_an_err_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    let err = DiskOffload::new(&missing).unwrap_err();
    assert!(matches!(err, OffloadError::Dir { .. }));
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let err = DiskOffload::new(&file).unwrap_err();
    assert!(err.to_string().contains("is not a directory"), "{err}");
    // /proc takes no new files, even for root.
    let err = DiskOffload::new("/proc").unwrap_err();
    assert!(
        err.to_string().contains("/proc: does not take files"),
        "{err}"
    );
}

#[test]
#[serial]
fn when_writes_fail_tensors_stay_in_memory_gradients_stay_exact_and_flush_says_so_once() {
    let net = net(4, 32, Device::Cpu);
    let x = Tensor::randn([4, 32], (Kind::Float, Device::Cpu));
    let expected = net.baseline_grads(&x);
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("store");
    std::fs::create_dir(&dir).unwrap();
    let store = DiskOffload::new(&dir)
        .unwrap()
        .excluding(&[x.shallow_clone()]);
    std::fs::remove_dir(&dir).unwrap();
    let loss =
        saved_tensors_hooks(store.clone(), || net.forward(&x).square().mean(Kind::Float)).unwrap();
    let err = store.flush().unwrap_err();
    assert!(matches!(err, OffloadError::KeptInMemory { .. }), "{err}");
    assert!(
        err.to_string().contains(&dir.display().to_string()),
        "{err}"
    );
    assert!(store.flush().is_ok(), "said once");
    assert_eq!(store.stats().tensors_written, 0);
    assert!(store.stats().kept_in_memory >= 4);
    loss.backward();
    assert!(bitwise_equal(&net.grads(), &expected));
    net.clear_grads();
}

fn damaged_store_backward(damage: impl Fn(&Path)) -> String {
    let net = net(3, 32, Device::Cpu);
    let x = Tensor::randn([4, 32], (Kind::Float, Device::Cpu));
    let dir = tempfile::tempdir().unwrap();
    let store = DiskOffload::new(dir.path())
        .unwrap()
        .excluding(&[x.shallow_clone()])
        .prefetch(0);
    let loss =
        saved_tensors_hooks(store.clone(), || net.forward(&x).square().mean(Kind::Float)).unwrap();
    store.flush().unwrap();
    for file in std::fs::read_dir(dir.path()).unwrap() {
        damage(&file.unwrap().path());
    }
    let err = loss.f_backward().unwrap_err().to_string();
    net.clear_grads();
    drop(loss);
    assert_eq!(files_in(dir.path()), 0);
    err
}

#[test]
#[serial]
fn a_truncated_store_file_fails_backward_naming_it() {
    let err = damaged_store_backward(|path| {
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.set_len(7).unwrap();
    });
    assert!(
        err.contains("was truncated or changed between forward and backward: 7 bytes"),
        "{err}"
    );
    assert!(err.contains("memsave-"), "{err}");
}

#[test]
#[serial]
fn a_store_file_changed_in_place_fails_backward_on_its_checksum() {
    let err = damaged_store_backward(|path| {
        let mut bytes = std::fs::read(path).unwrap();
        bytes[3] ^= 0x40;
        std::fs::write(path, bytes).unwrap();
    });
    assert!(err.contains("checksum mismatch"), "{err}");
}

#[test]
#[serial]
#[ignore = "needs CUDA"]
fn offload_from_cuda_gives_bitwise_gradients_and_frees_device_memory() {
    let device = Device::Cuda(0);
    let net = net(4, 256, device);
    let x = Tensor::randn([64, 256], (Kind::Float, device));
    let expected = net.baseline_grads(&x);
    let dir = tempfile::tempdir().unwrap();
    let start = f_memory_allocated(device).unwrap();
    let store = DiskOffload::new(dir.path())
        .unwrap()
        .excluding(&[x.shallow_clone()]);
    let y = saved_tensors_hooks(store.clone(), || net.forward(&x)).unwrap();
    store.flush().unwrap();
    assert_eq!(f_memory_allocated(device).unwrap() - start, 64 * 256 * 4);
    y.square().mean(Kind::Float).backward();
    drop(y);
    assert!(bitwise_equal(&net.grads(), &expected));
    assert_eq!(files_in(dir.path()), 0);
}
