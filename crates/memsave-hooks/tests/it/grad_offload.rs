//! Gradient offload: bitwise the gradients of plain accumulation, no gradient held
//! between backward passes (exact bytes), the last micro-batch's whole gradients
//! handed over, damaged files and bad setups as errors.
use memsave_hooks::{GradOffload, OffloadError};
use memsave_meter::f_memory_allocated;
use proptest::prelude::*;
use serial_test::serial;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

struct Net {
    vs: nn::VarStore,
    layers: Vec<nn::Linear>,
}

/// `depth` layers of `h = h + Linear(width, width)(h)`.
fn net(depth: usize, width: i64) -> Net {
    let vs = nn::VarStore::new(Device::Cpu);
    let layers = (0..depth)
        .map(|i| nn::linear(vs.root() / i, width, width, Default::default()))
        .collect();
    Net { vs, layers }
}

impl Net {
    fn params(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }

    fn loss(&self, x: &Tensor) -> Tensor {
        self.layers
            .iter()
            .fold(x.shallow_clone(), |h, l| &h + l.forward(&h).relu())
            .square()
            .sum(Kind::Float)
    }

    fn clear_grads(&self) {
        for p in self.params() {
            memsave_sys::tensor::set_grad_none(&p).unwrap();
        }
    }

    fn param_bytes(&self) -> u64 {
        self.params().iter().map(|p| p.numel() as u64 * 4).sum()
    }

    /// The gradients of plain accumulation over `splits` micro-batches of `x`,
    /// copied out of libtorch.
    fn accumulated(&self, x: &Tensor, splits: i64) -> Vec<Vec<f32>> {
        self.clear_grads();
        for mb in x.chunk(splits, 0) {
            self.loss(&mb).backward();
        }
        let g = host(&self.params().iter().map(Tensor::grad).collect::<Vec<_>>());
        self.clear_grads();
        g
    }
}

fn host(ts: &[Tensor]) -> Vec<Vec<f32>> {
    ts.iter()
        .map(|t| Vec::<f32>::try_from(&t.reshape([-1])).unwrap())
        .collect()
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

/// (parameter index, its whole gradient) as `on_complete` was handed them.
type HandedOver = Arc<Mutex<Vec<(usize, Vec<f32>)>>>;

fn files_in(dir: &Path) -> usize {
    files_under(dir).len()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    #[test]
    #[serial]
    fn accumulation_in_files_is_bitwise_and_holds_no_gradient_between_backwards(
        depth in 1usize..4, width in 3i64..24, rows in 4i64..13, splits in 1i64..4, seed in 0i64..1000,
    ) {
        tch::manual_seed(seed);
        let n = net(depth, width);
        let x = Tensor::randn([rows, width], (Kind::Float, Device::Cpu));
        let expected = n.accumulated(&x, splits);
        let dir = tempfile::tempdir().unwrap();
        let offload = GradOffload::new(&n.params(), dir.path()).unwrap();
        let start = f_memory_allocated(Device::Cpu).unwrap();
        for mb in x.chunk(splits, 0) {
            n.loss(&mb).backward();
            // Every gradient is in its file: nothing above the start is allocated.
            prop_assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start);
        }
        prop_assert_eq!(offload.stats().stored_bytes, n.param_bytes());
        prop_assert_eq!(files_in(dir.path()), n.params().len());
        offload.check().unwrap();
        offload.restore().unwrap();
        prop_assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start + n.param_bytes());
        let got = host(&n.params().iter().map(Tensor::grad).collect::<Vec<_>>());
        prop_assert_eq!(got, expected);
        prop_assert_eq!(files_in(dir.path()), 0);
        prop_assert_eq!(offload.stats().stored_bytes, 0);
        n.clear_grads();
    }
}

#[test]
#[serial]
fn the_last_micro_batch_hands_each_whole_gradient_over() {
    tch::manual_seed(7);
    let n = net(3, 16);
    let x = Tensor::randn([12, 16], (Kind::Float, Device::Cpu));
    let expected = n.accumulated(&x, 3);
    let dir = tempfile::tempdir().unwrap();
    // (parameter index, its whole gradient) as handed over.
    type Seen = Arc<Mutex<Vec<(usize, Vec<f32>)>>>;
    let seen: Seen = Arc::default();
    let sink = Arc::clone(&seen);
    let offload = GradOffload::new(&n.params(), dir.path())
        .unwrap()
        .on_complete(Box::new(move |index, p| {
            let g = Vec::<f32>::try_from(&p.grad().reshape([-1]))?;
            sink.lock().unwrap().push((index, g));
            memsave_sys::tensor::set_grad_none(p)?;
            Ok(())
        }));
    let start = f_memory_allocated(Device::Cpu).unwrap();
    let chunks = x.chunk(3, 0);
    for (i, mb) in chunks.iter().enumerate() {
        offload.set_last_micro_batch(i + 1 == chunks.len());
        n.loss(mb).backward();
        assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start);
    }
    let mut seen = seen.lock().unwrap().clone();
    seen.sort_by_key(|(i, _)| *i);
    assert_eq!(
        seen.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        (0..n.params().len()).collect::<Vec<_>>()
    );
    let got: Vec<Vec<f32>> = seen.into_iter().map(|(_, g)| g).collect();
    assert_eq!(got, expected);
    assert_eq!(offload.stats().stored_bytes, 0);
    assert_eq!(files_in(dir.path()), 0);
}

#[test]
#[serial]
fn a_file_changed_between_backwards_fails_the_next_backward_naming_it() {
    tch::manual_seed(3);
    let n = net(1, 8);
    let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    let dir = tempfile::tempdir().unwrap();
    let _offload = GradOffload::new(&n.params(), dir.path()).unwrap();
    n.loss(&x).backward();
    let file = files_under(dir.path())
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let len = std::fs::metadata(&file).unwrap().len() as usize;
    std::fs::write(&file, vec![7u8; len]).unwrap();
    let err = n.loss(&x).f_backward().unwrap_err().to_string();
    assert!(err.contains(&file.display().to_string()), "{err}");
    assert!(err.contains("changed"), "{err}");
    n.clear_grads();
}

#[test]
#[serial_test::parallel]
fn a_bad_directory_or_a_taken_hook_slot_is_an_err() {
    let n = net(1, 4);
    let missing = std::env::temp_dir().join("memsave-no-such-dir-for-grads");
    match GradOffload::new(&n.params(), &missing) {
        Err(OffloadError::Dir { dir, .. }) => assert_eq!(dir, missing),
        other => panic!("expected a directory error, got {other:?}"),
    }
    let dir = tempfile::tempdir().unwrap();
    let first = GradOffload::new(&n.params(), dir.path()).unwrap();
    match GradOffload::new(&n.params(), dir.path()) {
        Err(OffloadError::Param { index, source, .. }) => {
            assert_eq!(index, 0);
            let reason = source.to_string();
            assert!(reason.contains("post-accumulate-grad hook"), "{reason}");
        }
        other => panic!("expected a parameter error, got {other:?}"),
    }
    drop(first);
    // The slot is free again once the first is dropped.
    GradOffload::new(&n.params(), dir.path()).unwrap();
}

#[test]
#[serial]
fn a_parameter_unused_by_the_last_micro_batch_is_handed_over_after_it() {
    tch::manual_seed(5);
    let used = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let skipped = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    let dir = tempfile::tempdir().unwrap();
    let seen: Arc<Mutex<Vec<usize>>> = Arc::default();
    let sink = Arc::clone(&seen);
    let offload = GradOffload::new(&[used.shallow_clone(), skipped.shallow_clone()], dir.path())
        .unwrap()
        .on_complete(Box::new(move |index, p| {
            assert!(p.grad().defined());
            sink.lock().unwrap().push(index);
            memsave_sys::tensor::set_grad_none(p)?;
            Ok(())
        }));
    // The first micro-batch uses both, the last only the first.
    (x.mm(&used).sum(Kind::Float) + x.mm(&skipped).sum(Kind::Float)).backward();
    offload.set_last_micro_batch(true);
    x.mm(&used).sum(Kind::Float).backward();
    assert_eq!(*seen.lock().unwrap(), vec![0]);
    offload.complete_remaining().unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![0, 1]);
    assert_eq!(offload.stats().stored_bytes, 0);
    assert_eq!(files_in(dir.path()), 0);
}

/// `on_complete`'s own error type, to find it again as the error's source.
#[derive(Debug)]
struct StepRefused(usize);

impl std::fmt::Display for StepRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "step refused for parameter {}", self.0)
    }
}

impl std::error::Error for StepRefused {}

/// An error of `on_complete` is kept as the cause: `complete_remaining` returns
/// `OffloadError::OnComplete` naming the parameter, whose source is the closure's own
/// error (downcast back to its type); in backward, the error names both.
#[test]
#[serial_test::parallel]
fn an_error_of_on_complete_is_kept_as_the_cause() {
    let used = Tensor::ones([3, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let skipped = Tensor::ones([2, 5], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
    let y = Tensor::ones([4, 2], (Kind::Float, Device::Cpu));
    let dir = tempfile::tempdir().unwrap();
    let offload = GradOffload::new(&[used.shallow_clone(), skipped.shallow_clone()], dir.path())
        .unwrap()
        .on_complete(Box::new(|index, _| Err(Box::new(StepRefused(index)))));
    (x.mm(&used).sum(Kind::Float) + y.mm(&skipped).sum(Kind::Float)).backward();
    offload.set_last_micro_batch(true);
    let err = x
        .mm(&used)
        .sum(Kind::Float)
        .f_backward()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "parameter 0 (shape [3, 2]): on_complete failed: step refused for parameter 0"
        ),
        "{err}"
    );
    match offload.complete_remaining() {
        Err(e @ OffloadError::OnComplete { index: 1, .. }) => {
            let source = std::error::Error::source(&e).expect("a source");
            let refused = source
                .downcast_ref::<StepRefused>()
                .expect("the closure's error");
            assert_eq!(refused.0, 1);
            assert_eq!(
                e.to_string(),
                "parameter 1 (shape [2, 5]): on_complete failed: step refused for parameter 1"
            );
        }
        other => panic!("expected on_complete's error, got {other:?}"),
    }
}
/// How a test damages a gradient file.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// One bit flipped: same length, another checksum.
    Flip,
    /// Cut to 3 bytes.
    Truncate,
    /// Removed.
    Remove,
}

fn damage(file: &Path, how: Damage) {
    match how {
        Damage::Flip => {
            let mut bytes = std::fs::read(file).unwrap();
            let middle = bytes.len() / 2;
            bytes[middle] ^= 0x10;
            std::fs::write(file, bytes).unwrap();
        }
        Damage::Truncate => {
            let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
            f.set_len(3).unwrap();
        }
        Damage::Remove => std::fs::remove_file(file).unwrap(),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]
    /// A gradient file damaged after micro-batch `damaged_after` (of `splits`; equal:
    /// after the last) loses that parameter's sum: the next backward, if any, fails
    /// naming the file, and `check`, `restore` and `f_grad` then fail naming it too,
    /// again when asked again; the lost parameter has no gradient, the others (when
    /// every backward before the damage ran whole) their plain sums.
    #[test]
    #[serial]
    fn a_gradient_file_damaged_between_micro_batches_is_an_err_naming_it_never_a_wrong_gradient(
        depth in 1usize..4, width in 2i64..24, splits in 1i64..5, after in 1i64..5,
        pick in any::<prop::sample::Index>(),
        how in prop::sample::select(vec![Damage::Flip, Damage::Truncate, Damage::Remove]),
        f_grad_first in any::<bool>(), seed in 0i64..1000,
    ) {
        tch::manual_seed(seed);
        let damaged_after = after.min(splits);
        let n = net(depth, width);
        let x = Tensor::randn([2 * splits, width], (Kind::Float, Device::Cpu));
        let expected = n.accumulated(&x, splits);
        let params = n.params();
        let lost = pick.index(params.len());
        let dir = tempfile::tempdir().unwrap();
        let offload = GradOffload::new(&params, dir.path()).unwrap();
        let suffix = format!("grad-{lost}");
        let mut file = None;
        for (i, mb) in x.chunk(splits, 0).iter().enumerate() {
            let result = n.loss(mb).f_backward();
            if (i as i64) < damaged_after {
                prop_assert!(result.is_ok(), "{:?}", result);
            } else {
                let err = result.unwrap_err().to_string();
                let path = file.as_ref().map(|p: &PathBuf| p.display().to_string()).unwrap();
                prop_assert!(err.contains(&path), "{}", err);
                prop_assert!(err.contains(&format!("gradient sum of parameter {lost}")), "{}", err);
            }
            if i as i64 + 1 == damaged_after {
                let f = files_under(dir.path())
                    .into_iter()
                    .find(|p| p.to_string_lossy().ends_with(&suffix))
                    .unwrap();
                damage(&f, how);
                file = Some(f);
            }
        }
        let path = file.unwrap().display().to_string();
        // Whichever reads the file first (restore or f_grad, when no backward came
        // after the damage) finds it; from then on each of them says so.
        for round in 0..2 {
            if f_grad_first || round > 0 {
                let err = offload.f_grad(lost).unwrap_err().to_string();
                prop_assert!(err.contains(&path), "{}", err);
            }
            match offload.restore() {
                Err(OffloadError::GradLost { index, source, .. }) => {
                    prop_assert_eq!(index, lost);
                    let reason = source.to_string();
                    prop_assert!(reason.contains(&path), "{}", reason);
                }
                other => prop_assert!(false, "restore gave {:?}", other),
            }
            let err = offload.check().unwrap_err().to_string();
            prop_assert!(err.contains(&path) && err.contains("the accumulated gradient is lost"), "{}", err);
        }
        prop_assert!(!params[lost].grad().defined());
        if damaged_after == splits {
            // Every backward ran whole: the other sums are restored, bitwise.
            for (i, p) in params.iter().enumerate().filter(|(i, _)| *i != lost) {
                prop_assert_eq!(&host(&[p.grad()])[0], &expected[i]);
            }
        }
        n.clear_grads();
    }
}

/// The offload's files live in a directory of its own inside the one given, named
/// after this process and removed with the offload.
#[test]
#[serial_test::parallel]
fn the_files_live_in_a_directory_of_the_offloads_own_removed_when_it_is_dropped() {
    let n = net(2, 8);
    let x = Tensor::randn([4, 8], (Kind::Float, Device::Cpu));
    let dir = tempfile::tempdir().unwrap();
    let offload = GradOffload::new(&n.params(), dir.path()).unwrap();
    n.loss(&x).backward();
    let entries: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let own = &entries[0];
    assert!(own.is_dir());
    let name = own.file_name().unwrap().to_str().unwrap();
    assert!(
        name.starts_with(&format!("memsave-{}-", std::process::id())),
        "{name}"
    );
    assert_eq!(files_in(own), n.params().len());
    drop(offload);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    n.clear_grads();
}

/// Gradients that cannot be written (the directory gone) stay in `.grad`: the next
/// backward adds into them and `restore` gives the plain sums, bitwise. `check` says
/// so once; the stats keep the count.
#[test]
#[serial]
fn gradients_that_cannot_be_written_stay_in_memory_and_check_says_so_once() {
    tch::manual_seed(11);
    let n = net(2, 8);
    let x = Tensor::randn([6, 8], (Kind::Float, Device::Cpu));
    let expected = n.accumulated(&x, 3);
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("grads");
    std::fs::create_dir(&dir).unwrap();
    let offload = GradOffload::new(&n.params(), &dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    for mb in x.chunk(3, 0) {
        n.loss(&mb).backward();
    }
    let count = 3 * n.params().len() as u64;
    match offload.check() {
        Err(OffloadError::KeptInMemory {
            count: c, first, ..
        }) => {
            assert_eq!(c, count);
            let reason = first.to_string();
            assert!(reason.contains(&dir.display().to_string()), "{reason}");
        }
        other => panic!("expected the failed writes, got {other:?}"),
    }
    offload.check().unwrap();
    assert_eq!(offload.stats().kept_in_memory, count);
    assert_eq!(offload.stats().stored_bytes, 0);
    offload.restore().unwrap();
    let got = host(&n.params().iter().map(Tensor::grad).collect::<Vec<_>>());
    assert_eq!(got, expected);
    n.clear_grads();
}

/// Adding the stored sum back into a new gradient reads the file a chunk of 64 KiB at
/// a time into the gradient: the second backward's peak is the first's plus one chunk
/// (65,536 bytes), not plus a second copy of the gradient (528,192 bytes here).
#[test]
#[serial]
fn adding_the_stored_sum_back_costs_one_chunk() {
    memsave_meter::install();
    let w = Tensor::zeros([131, 1008], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let c = (Tensor::arange(131 * 1008, (Kind::Float, Device::Cpu)) * 0.01)
        .sin()
        .view([131, 1008]);
    let dir = tempfile::tempdir().unwrap();
    let offload = GradOffload::new(&[w.shallow_clone()], dir.path()).unwrap();
    // The peak of backward alone: the new gradient, and what adding the sum costs
    // (the factor held here, so that backward frees nothing of the forward's).
    let peak = |scale: f64| {
        let factor = &c * scale;
        let loss = (&w * &factor).sum(Kind::Float);
        let (_, m) = memsave_meter::f_measure(Device::Cpu, |_| loss.backward()).unwrap();
        m.peak_bytes
    };
    let first = peak(1.0);
    let second = peak(2.0);
    assert_eq!(
        second,
        first + 65_536,
        "first backward {first} B, second {second} B"
    );
    offload.restore().unwrap();
    let expected = &c * 3.0;
    assert!(w.grad().equal(&expected), "the sum is the plain one");
}

/// Adding the stored sum back chunk by chunk gives plain accumulation's bits in every
/// floating-point kind and size: none, one value, a few, and several 64 KiB chunks
/// with a shorter last one; every byte stored is read back once per backward after
/// the first and once by restore, and no file is left.
#[test]
#[serial]
fn the_stored_sum_added_back_in_chunks_is_plain_accumulation_in_every_kind() {
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float, Kind::Double] {
        for n in [0i64, 1, 3, 40_001] {
            let values = |scale: f64, shift: f64| {
                ((Tensor::arange(n, (Kind::Float, Device::Cpu)) * scale + shift).sin() * 1.7)
                    .to_kind(kind)
            };
            let offloaded = values(0.37, 0.0).set_requires_grad(true);
            let plain = values(0.37, 0.0).set_requires_grad(true);
            let dir = tempfile::tempdir().unwrap();
            let offload = GradOffload::new(&[offloaded.shallow_clone()], dir.path()).unwrap();
            for step in 0..3 {
                let c = values(0.11, step as f64);
                (&offloaded * &c).sum(kind).backward();
                (&plain * &c).sum(kind).backward();
                assert!(!offloaded.grad().defined(), "{kind:?}, {n} values");
            }
            offload.restore().unwrap();
            let (ours, theirs) = (offloaded.grad(), plain.grad());
            assert!(
                ours.view_dtype(Kind::Uint8)
                    .equal(&theirs.view_dtype(Kind::Uint8)),
                "{kind:?}, {n} values"
            );
            let bytes = n as u64 * kind.elt_size_in_bytes() as u64;
            assert_eq!(
                offload.stats().read_bytes,
                3 * bytes,
                "{kind:?}, {n} values"
            );
            assert_eq!(files_in(offload.dir()), 0, "{kind:?}, {n} values");
        }
    }
}

/// A file of several chunks changed in its last chunk is found by its checksum after
/// the chunks before were added: the gradient (a part of the sum) is freed, the file
/// removed, and the sum lost, as when the file is read back whole.
#[test]
#[serial]
fn a_sum_damaged_in_its_last_chunk_is_lost_and_its_partial_gradient_freed() {
    let n = 40_001;
    let w = Tensor::zeros([n], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let c = Tensor::ones([n], (Kind::Float, Device::Cpu));
    let dir = tempfile::tempdir().unwrap();
    let offload = GradOffload::new(&[w.shallow_clone()], dir.path()).unwrap();
    (&w * &c).sum(Kind::Float).backward();
    let file = files_under(offload.dir()).pop().unwrap();
    let mut bytes = std::fs::read(&file).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x10;
    std::fs::write(&file, bytes).unwrap();
    let err = (&w * &c)
        .sum(Kind::Float)
        .f_backward()
        .unwrap_err()
        .to_string();
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(!w.grad().defined(), "the partial sum is freed");
    assert_eq!(files_in(offload.dir()), 0);
    assert_eq!(offload.stats().read_bytes, 0);
    let err = offload.restore().unwrap_err();
    assert!(matches!(err, OffloadError::GradLost { .. }), "{err}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// Gradients per parameter group: the biases (and any parameter `keep_in_memory`
    /// picks) accumulate in `.grad`, the weights in files. Bitwise plain accumulation
    /// either way; between backward passes the device holds exactly the kept gradients;
    /// with `on_complete`, every parameter is handed over once in the last micro-batch.
    #[test]
    #[serial]
    fn gradients_kept_in_memory_by_group_are_plain_accumulation_and_handed_over_once(
        depth in 1usize..4, width in 3i64..24, rows in 4i64..13, splits in 1i64..4, seed in 0i64..1000,
    ) {
        tch::manual_seed(seed);
        let n = net(depth, width);
        let x = Tensor::randn([rows, width], (Kind::Float, Device::Cpu));
        let expected = n.accumulated(&x, splits);
        let is_bias = |p: &Tensor| p.dim() == 1;
        let kept_bytes: u64 = n.params().iter().filter(|p| is_bias(p)).map(|p| p.numel() as u64 * 4).sum();
        // Plain accumulation in `.grad` for the kept ones, then restore.
        let dir = tempfile::tempdir().unwrap();
        let offload = GradOffload::new(&n.params(), dir.path()).unwrap().keep_in_memory(is_bias);
        let start = f_memory_allocated(Device::Cpu).unwrap();
        for mb in x.chunk(splits, 0) {
            n.loss(&mb).backward();
            prop_assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start + kept_bytes);
        }
        prop_assert_eq!(offload.stats().stored_bytes, n.param_bytes() - kept_bytes);
        prop_assert_eq!(files_in(dir.path()), depth);
        offload.restore().unwrap();
        let got = host(&n.params().iter().map(Tensor::grad).collect::<Vec<_>>());
        prop_assert_eq!(&got, &expected);
        n.clear_grads();
        drop(offload);
        // With on_complete: each parameter once, with its whole gradient.
        let seen: HandedOver = Arc::default();
        let sink = Arc::clone(&seen);
        let offload = GradOffload::new(&n.params(), dir.path())
            .unwrap()
            .keep_in_memory(is_bias)
            .on_complete(Box::new(move |index, p| {
                let g = Vec::<f32>::try_from(&p.grad().reshape([-1]))?;
                sink.lock().unwrap().push((index, g));
                memsave_sys::tensor::set_grad_none(p)?;
                Ok(())
            }));
        let chunks = x.chunk(splits, 0);
        for (i, mb) in chunks.iter().enumerate() {
            offload.set_last_micro_batch(i + 1 == chunks.len());
            n.loss(mb).backward();
        }
        offload.complete_remaining().unwrap();
        let mut seen = seen.lock().unwrap().clone();
        seen.sort_by_key(|(i, _)| *i);
        prop_assert_eq!(
            seen.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            (0..n.params().len()).collect::<Vec<_>>()
        );
        let got: Vec<Vec<f32>> = seen.into_iter().map(|(_, g)| g).collect();
        prop_assert_eq!(got, expected);
        prop_assert_eq!(f_memory_allocated(Device::Cpu).unwrap(), start);
    }
}

/// A parameter kept in memory that the last micro-batch does not use is handed over
/// by `complete_remaining`, once, with the sum of the earlier micro-batches.
#[test]
#[serial]
fn a_kept_parameter_unused_by_the_last_micro_batch_is_handed_over_after_it() {
    tch::manual_seed(5);
    let used = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let skipped = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    let dir = tempfile::tempdir().unwrap();
    let seen: HandedOver = Arc::default();
    let sink = Arc::clone(&seen);
    let offload = GradOffload::new(&[used.shallow_clone(), skipped.shallow_clone()], dir.path())
        .unwrap()
        .keep_in_memory(|_| true)
        .on_complete(Box::new(move |index, p| {
            let g = Vec::<f32>::try_from(&p.grad().reshape([-1]))?;
            sink.lock().unwrap().push((index, g));
            memsave_sys::tensor::set_grad_none(p)?;
            Ok(())
        }));
    (x.mm(&used).sum(Kind::Float) + x.mm(&skipped).sum(Kind::Float)).backward();
    let expected = Vec::<f32>::try_from(&skipped.grad().reshape([-1])).unwrap();
    offload.set_last_micro_batch(true);
    x.mm(&used).sum(Kind::Float).backward();
    assert_eq!(seen.lock().unwrap().len(), 1);
    offload.complete_remaining().unwrap();
    offload.complete_remaining().unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(seen[1].1, expected);
    assert_eq!(files_in(dir.path()), 0);
}
