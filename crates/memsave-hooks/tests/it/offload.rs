//! Disk offload: bitwise gradients, exact memory, an empty store after backward, and
//! bad directories and damaged files.
use memsave_hooks::{
    saved_tensors_hooks, DiskOffload, GradOffload, OffloadError, SavedTensorHooks,
};
use memsave_meter::f_memory_allocated;
use proptest::prelude::*;
use serial_test::serial;
use std::path::{Path, PathBuf};
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

/// The files under `dir`, in its subdirectories too.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(files_under(&path));
        } else {
            files.push(path);
        }
    }
    files
}

fn files_in(dir: &Path) -> usize {
    files_under(dir).len()
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
        let left = files_under(dir.path());
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
#[serial_test::parallel]
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
#[serial_test::parallel]
fn when_writes_fail_tensors_stay_in_memory_gradients_stay_exact_and_flush_says_so_once_per_failure()
{
    let net = net(4, 32, Device::Cpu);
    let x = Tensor::randn([4, 32], (Kind::Float, Device::Cpu));
    let expected = net.baseline_grads(&x);
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("store");
    std::fs::create_dir(&dir).unwrap();
    let store = DiskOffload::new(&dir)
        .unwrap()
        .excluding(&[x.shallow_clone()]);
    std::fs::remove_dir_all(&dir).unwrap();
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
    let kept = store.stats().kept_in_memory;
    assert!(kept >= 4);
    loss.backward();
    assert!(bitwise_equal(&net.grads(), &expected));
    net.clear_grads();
    // Failures after the report are reported anew, counting only themselves.
    let loss =
        saved_tensors_hooks(store.clone(), || net.forward(&x).square().mean(Kind::Float)).unwrap();
    match store.flush() {
        Err(OffloadError::KeptInMemory { count, .. }) => assert_eq!(count, kept),
        other => panic!("expected the new failures, got {other:?}"),
    }
    assert!(store.flush().is_ok(), "said once");
    assert_eq!(store.stats().kept_in_memory, 2 * kept);
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
    for file in files_under(dir.path()) {
        damage(&file);
    }
    let err = loss.f_backward().unwrap_err().to_string();
    net.clear_grads();
    drop(loss);
    assert_eq!(files_in(dir.path()), 0);
    err
}

#[test]
#[serial_test::parallel]
fn a_truncated_store_file_fails_backward_naming_it() {
    let err = damaged_store_backward(|path| {
        let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
        f.set_len(7).unwrap();
    });
    assert!(
        err.contains("was truncated or changed after it was written: 7 bytes, expected"),
        "{err}"
    );
    assert!(err.contains("memsave-"), "{err}");
}

#[test]
#[serial_test::parallel]
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

/// The store's files live in a directory of its own inside the one given, named after
/// this process; it stays while the graph holds packed tensors and goes with the last
/// of them and the store.
#[test]
#[serial_test::parallel]
fn a_stores_files_live_in_its_own_directory_removed_when_the_store_and_its_tensors_go() {
    let net = net(3, 16, Device::Cpu);
    let x = Tensor::randn([4, 16], (Kind::Float, Device::Cpu));
    let expected = net.baseline_grads(&x);
    let dir = tempfile::tempdir().unwrap();
    let store = DiskOffload::new(dir.path())
        .unwrap()
        .excluding(&[x.shallow_clone()]);
    let own = store.dir().to_path_buf();
    assert_eq!(own.parent(), Some(dir.path()));
    let name = own.file_name().unwrap().to_str().unwrap().to_owned();
    assert!(
        name.starts_with(&format!("memsave-{}-", std::process::id())),
        "{name}"
    );
    let loss =
        saved_tensors_hooks(store.clone(), || net.forward(&x).square().mean(Kind::Float)).unwrap();
    store.flush().unwrap();
    let files = files_under(dir.path());
    assert!(!files.is_empty());
    assert!(
        files.iter().all(|f| f.parent() == Some(own.as_path())),
        "{files:?}"
    );
    // The store goes first: its directory stays for the tensors the graph holds.
    drop(store);
    assert!(own.is_dir());
    loss.backward();
    assert!(bitwise_equal(&net.grads(), &expected));
    net.clear_grads();
    drop(loss);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// When process `pid` started, in clock ticks after boot (`/proc/<pid>/stat`, field 22).
fn start_time(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields = &stat[stat.rfind(')').unwrap() + 1..];
    fields.split_whitespace().nth(19).unwrap().parse().unwrap()
}

/// A store directory as a killed run leaves it: named for `pid` started at `start`,
/// with a file in it.
fn left_behind(parent: &Path, pid: u32, start: u64, boot: &str, host: &str) -> PathBuf {
    let path = parent.join(format!("memsave-{pid}-{start}-{boot}-999999-{host}"));
    std::fs::create_dir(&path).unwrap();
    std::fs::write(path.join("0.bin"), vec![1u8; 4096]).unwrap();
    path
}

/// A new store removes the directories left by stores whose process is gone (exited,
/// or its pid now another process's), and keeps those of live processes (this one's
/// other store, a live owner's), of other hosts, and anything not named as a store's.
#[test]
#[serial_test::parallel]
fn a_new_store_removes_directories_whose_owner_is_gone_and_keeps_live_ones() {
    let dir = tempfile::tempdir().unwrap();
    let live = DiskOffload::new(dir.path()).unwrap().prefetch(0);
    // memsave-<pid>-<start>-<boot>-<n>-<host>, as the docs say.
    let name = live.dir().file_name().unwrap().to_str().unwrap().to_owned();
    let fields: Vec<&str> = name.splitn(6, '-').collect();
    assert_eq!(fields.len(), 6, "{name}");
    let me = std::process::id();
    assert_eq!(fields[1], me.to_string());
    assert_eq!(fields[2], start_time(me).to_string());
    let (boot, host) = (fields[3], fields[5]);

    // A child that has exited and been waited for: its pid names no process now (or
    // another one, started later).
    let mut child = std::process::Command::new("cat")
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let child_start = start_time(child.id());
    let exited = left_behind(dir.path(), child.id(), child_start, boot, host);
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    // A pid no process can have, and this process's pid with another start time.
    let impossible = left_behind(dir.path(), u32::MAX, 1, boot, host);
    let reused = left_behind(dir.path(), me, start_time(me) + 1, boot, host);
    let other_boot = if boot == "00000000" {
        "11111111"
    } else {
        "00000000"
    };
    let rebooted = left_behind(dir.path(), me, start_time(me), other_boot, host);
    // Kept: a live owner (this process), another host's, names that are not a store's.
    let live_owner = left_behind(dir.path(), me, start_time(me), boot, host);
    let other_host = left_behind(dir.path(), u32::MAX, 1, boot, "another-host");
    let not_a_store = dir.path().join("memsave-notes");
    std::fs::create_dir(&not_a_store).unwrap();
    let a_file = dir
        .path()
        .join(format!("memsave-{}-1-{boot}-999998-{host}", u32::MAX));
    std::fs::write(&a_file, b"mine").unwrap();

    // The live store holds a packed tensor in its directory meanwhile.
    let t = Tensor::randn([8, 8], (Kind::Float, Device::Cpu));
    let packed = live.pack(&t).unwrap();
    live.flush().unwrap();

    let _next = GradOffload::new(&[], dir.path()).unwrap();
    for gone in [&exited, &impossible, &reused, &rebooted] {
        assert!(!gone.exists(), "{} was kept", gone.display());
    }
    for kept in [&live_owner, &other_host, &not_a_store, &a_file] {
        assert!(kept.exists(), "{} was removed", kept.display());
    }
    assert!(live.dir().is_dir());
    assert!(live.unpack(&packed).unwrap().equal(&t));
    let _third = DiskOffload::new(dir.path()).unwrap();
    assert!(live.dir().is_dir());
}

/// A saved tensor expanded from a smaller one (stride 0) is written as the smaller
/// one: the forward holds only its output, the file holds the base's bytes, and the
/// gradients are bitwise those without hooks. Several shapes.
#[test]
#[serial]
fn an_expanded_saved_tensor_is_written_as_its_base() {
    memsave_meter::install();
    let cases: [(&[i64], &[i64]); 4] = [
        (&[1, 1024], &[256, 1024]),
        (&[1, 300], &[64, 300]),
        (&[3, 1, 5], &[3, 7, 5]),
        (&[1, 1], &[9, 13]),
    ];
    for (base_shape, shape) in cases {
        let base = Tensor::randn(base_shape, (Kind::Float, Device::Cpu));
        let w = Tensor::randn(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true);
        // mul saves the expanded base, for w's gradient (and not w: the base does not
        // require grad).
        let step = |store: Option<&DiskOffload>| {
            let f = || (base.expand(shape, false) * &w).sum(Kind::Float);
            let start = f_memory_allocated(Device::Cpu).unwrap();
            let loss = match store {
                Some(s) => saved_tensors_hooks(s.clone(), f).unwrap(),
                None => f(),
            };
            if let Some(s) = store {
                s.flush().unwrap();
            }
            let held = f_memory_allocated(Device::Cpu).unwrap() - start;
            loss.backward();
            let grad = w.grad().copy();
            memsave_sys::tensor::set_grad_none(&w).unwrap();
            (held, grad)
        };
        let (plain_held, plain_grad) = step(None);
        assert_eq!(plain_held, 4, "{shape:?}: the loss");
        let dir = tempfile::tempdir().unwrap();
        let store = DiskOffload::new(dir.path()).unwrap();
        let (held, grad) = step(Some(&store));
        let base_bytes = base.numel() as u64 * 4;
        assert_eq!(held, 4, "{shape:?}: nothing waits after the flush");
        assert_eq!(store.stats().tensors_written, 1, "{shape:?}");
        assert_eq!(store.stats().written_bytes, base_bytes, "{shape:?}");
        assert_eq!(store.stats().read_bytes, base_bytes, "{shape:?}");
        assert!(grad.equal(&plain_grad), "{shape:?}");
    }
}

/// SaveOnCpu copies an expanded saved tensor's base to the host, not every repeat,
/// and gives the gradients without hooks, bitwise.
#[test]
#[serial]
#[ignore = "needs CUDA"]
fn save_on_cpu_copies_an_expanded_saved_tensor_as_its_base() {
    let device = Device::Cuda(0);
    for (base_shape, shape) in [([1i64, 1024], [256i64, 1024]), ([1, 1], [9, 13])] {
        let base = Tensor::randn(base_shape, (Kind::Float, device));
        let w = Tensor::randn(shape, (Kind::Float, device)).set_requires_grad(true);
        let f = || (base.expand(shape, false) * &w).sum(Kind::Float);
        f().backward();
        let plain = w.grad().copy();
        memsave_sys::tensor::set_grad_none(&w).unwrap();
        let hooks = memsave_hooks::SaveOnCpu::new();
        let loss = saved_tensors_hooks(hooks.clone(), f).unwrap();
        assert_eq!(
            hooks.offloaded_bytes(),
            base.numel() as u64 * 4,
            "{shape:?}"
        );
        loss.backward();
        assert!(w.grad().equal(&plain), "{shape:?}");
        memsave_sys::tensor::set_grad_none(&w).unwrap();
    }
}
