//! ZeRO-3 with the shards in files (`FsdpConfig::shards_in_files`, `Fsdp::new_in_dir`)
//! on one process: the parameters off the device. The 8 linear layers of `fsdp.rs`
//! train 20 AdamW steps stepped in backward and must end bitwise equal to plain AdamW
//! on one process; damaged files and failed writes fail the step naming the file and
//! leave the last finished step's weights loadable.
use crate::fsdp::{data, flat, layers_of, reference_by_step, sharded, BATCH, CONFIG, DIMS};

use std::path::Path;
use std::sync::{Arc, Mutex};

use memsave_dist::{DistError, Fsdp, FsdpConfig, FsdpUnit, InitOptions, ProcessGroup};
use memsave_meter::{max_memory_allocated, memory_allocated, reset_peak_memory_stats};
use memsave_optim::AdamW;
use serial_test::{parallel, serial};
use tch::{Device, Kind, Tensor};

const STEPS: usize = 20;

/// The layers sharded into files in `dir`, with AdamW stepped in backward.
fn setup(group: &ProcessGroup, dir: &Path) -> (Fsdp, Vec<Arc<Mutex<FsdpUnit>>>) {
    let (_vs, layers) = layers_of(&DIMS, 1);
    let mut fsdp = Fsdp::new_in_dir(group, FsdpConfig::default(), dir).expect("fsdp");
    let units = sharded(&mut fsdp, layers);
    let opt = AdamW::new(&fsdp.parameters(), CONFIG).expect("optimizer");
    fsdp.step_in_backward(opt).expect("step_in_backward");
    (fsdp, units)
}

/// One step: the forward inside `Fsdp::forward`, backward (which steps), and the end of
/// backward (which commits the step's files).
fn step(fsdp: &Fsdp, units: &[Arc<Mutex<FsdpUnit>>], x: &Tensor, y: &Tensor) -> Result<(), String> {
    let loss = loss(fsdp, units, x, y)?;
    loss.f_backward().map_err(|e| e.to_string())?;
    fsdp.f_finish_backward().map_err(|e| e.to_string())
}

/// The chain's mean squared error on `x` and `y`, its forward inside `Fsdp::forward`.
fn loss(
    fsdp: &Fsdp,
    units: &[Arc<Mutex<FsdpUnit>>],
    x: &Tensor,
    y: &Tensor,
) -> Result<Tensor, String> {
    fsdp.forward(|| {
        let mut h = x.shallow_clone();
        for unit in units {
            h = unit.lock().unwrap().f_forward_t(&h, true)?;
        }
        Ok::<_, DistError>(h.mse_loss(y, tch::Reduction::Mean))
    })
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())
}

fn group(dir: &Path) -> ProcessGroup {
    ProcessGroup::new_file(&dir.join("store"), 0, 1, &InitOptions::default())
        .expect("a group of one")
}

/// Values of each unit (weight and bias), from the widths.
fn unit_values() -> Vec<u64> {
    (0..DIMS.len() - 1)
        .map(|i| (DIMS[i] * DIMS[i + 1] + DIMS[i + 1]) as u64)
        .collect()
}

#[test]
#[serial]
fn one_process_with_shards_in_files_trains_bitwise_like_plain_adamw() {
    memsave_meter::install();
    let expected = reference_by_step(STEPS);
    let tmp = tempfile::tempdir().expect("tempdir");
    let group = group(tmp.path());
    let dir = tmp.path().join("weights");
    let (x, y) = data();
    let (fsdp, units) = setup(&group, &dir);
    let values = unit_values();
    let largest = 4 * values.iter().copied().max().unwrap();
    // Between steps this process holds no weight (only the 4-byte NaN) and, after the
    // first step, AdamW's two moments of every value.
    let before = memory_allocated(Device::Cpu);
    let state = 2 * 4 * values.iter().sum::<u64>();
    for (i, want) in expected.iter().enumerate() {
        reset_peak_memory_stats(Device::Cpu);
        fsdp.reset_gathered_peak();
        step(&fsdp, &units, &x, &y).unwrap_or_else(|e| panic!("step {i}: {e}"));
        let held = before + state;
        assert_eq!(
            memory_allocated(Device::Cpu),
            held,
            "step {i} left bytes behind"
        );
        let stats = fsdp.stats();
        assert_eq!(stats.parameter_bytes, 4);
        assert_eq!(stats.file_bytes, 4 * values.iter().sum::<u64>());
        // One unit's weights at a time: read for its forward, freed after it, read
        // again by backward and freed when its gradients have stepped it.
        assert_eq!(stats.gathered_peak_bytes, largest, "step {i}");
        assert!(max_memory_allocated(Device::Cpu) > held);
        let committed = Fsdp::read_parameter_files(&dir).expect("the step's weights");
        assert_eq!(&flat(&committed), want, "step {i}: weights in the files");
    }
    let full = fsdp.f_full_parameters().expect("full parameters");
    assert_eq!(&flat(&full), expected.last().unwrap());
    fsdp.discard();
}

#[test]
#[serial]
fn a_damaged_shard_file_fails_the_step_naming_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let group = group(tmp.path());
    let dir = tmp.path().join("weights");
    let (x, y) = data();
    let (fsdp, units) = setup(&group, &dir);
    step(&fsdp, &units, &x, &y).expect("a first step");
    let manifest = std::fs::read_to_string(dir.join("weights.manifest")).expect("manifest");
    let name = |unit: usize| {
        manifest
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!("unit {unit} file "))
                    .and_then(|r| r.split(' ').next())
            })
            .expect("the unit's file")
            .to_owned()
    };
    // Changed, truncated, removed: each fails the next step naming the file.
    type Damage = fn(&Path);
    let damage: [(&str, Damage); 3] = [
        ("changed", |p| {
            let mut b = std::fs::read(p).unwrap();
            b[5] ^= 0x40;
            std::fs::write(p, b).unwrap();
        }),
        ("truncated", |p| {
            let b = std::fs::read(p).unwrap();
            std::fs::write(p, &b[..b.len() - 4]).unwrap();
        }),
        ("removed", |p| std::fs::remove_file(p).unwrap()),
    ];
    for (unit, (what, f)) in damage.into_iter().enumerate() {
        let path = dir.join(name(unit + 2));
        let good = std::fs::read(&path).unwrap();
        f(&path);
        let e = step(&fsdp, &units, &x, &y).expect_err(what);
        assert!(e.contains(&path.display().to_string()), "{what}: {e}");
        let e = Fsdp::read_parameter_files(&dir)
            .expect_err(what)
            .to_string();
        assert!(e.contains(&path.display().to_string()), "{what}: {e}");
        // Put back, the next step runs.
        std::fs::write(&path, good).unwrap();
    }
    fsdp.discard();
}

#[test]
#[serial]
fn a_write_that_fails_half_way_leaves_the_last_finished_step_loadable() {
    let expected = reference_by_step(2);
    let tmp = tempfile::tempdir().expect("tempdir");
    let group = group(tmp.path());
    let dir = tmp.path().join("weights");
    let (x, y) = data();
    let (fsdp, units) = setup(&group, &dir);
    step(&fsdp, &units, &x, &y).expect("step 1");
    step(&fsdp, &units, &x, &y).expect("step 2");
    // Step 3 writes each unit's stepped shard as unit-U.3.f32; unit 4's cannot be
    // written (a directory has its name; a full disk fails the same write), after
    // units 7 to 5 were stepped.
    let blocked = dir.join("unit-4.3.f32");
    std::fs::create_dir(&blocked).unwrap();
    let e = step(&fsdp, &units, &x, &y).expect_err("a write failed");
    assert!(e.contains(&blocked.display().to_string()), "{e}");
    let loaded = Fsdp::read_parameter_files(&dir).expect("the last finished step");
    assert_eq!(flat(&loaded), expected[1], "the weights of step 2");
    // The next step writes unit 7's shard again under the same name; that write fails
    // too (its temporary name is taken), and the file the failed step wrote stays
    // whole.
    std::fs::remove_dir(&blocked).unwrap();
    let partial = dir.join("unit-7.3.f32.partial");
    std::fs::create_dir(&partial).unwrap();
    let e = step(&fsdp, &units, &x, &y).expect_err("a rewrite failed");
    assert!(e.contains("unit-7.3.f32"), "{e}");
    // Once the disk takes files again, the next step runs.
    std::fs::remove_dir(&partial).unwrap();
    step(&fsdp, &units, &x, &y).expect("the next step");
    assert!(Fsdp::read_parameter_files(&dir).is_ok());
    fsdp.discard();
}

#[test]
#[serial]
fn a_directory_holding_another_run_s_weights_is_refused_and_kept() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let group = group(tmp.path());
    let dir = tmp.path().join("weights");
    let (x, y) = data();
    let (fsdp, units) = setup(&group, &dir);
    step(&fsdp, &units, &x, &y).expect("a step");
    let before = flat(&Fsdp::read_parameter_files(&dir).unwrap());
    let e = Fsdp::new_in_dir(&group, FsdpConfig::default(), &dir)
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("weights.manifest") && e.contains("another Fsdp"),
        "{e}"
    );
    assert_eq!(flat(&Fsdp::read_parameter_files(&dir).unwrap()), before);
    fsdp.discard();
}

#[test]
#[parallel]
fn a_damaged_manifest_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let manifest = tmp.path().join("weights.manifest");
    for text in [
        "not a manifest\n",
        "memsave fsdp shard files 1\nrank 0 world 1\nunit 0 file u values -1 crc 0 shapes s2x2\n",
        "memsave fsdp shard files 1\nrank 0 world 1\nunit 0 file u values 4 crc 0 shapes s9223372036854775807x4\n",
        "memsave fsdp shard files 1\nrank 1 world 2\n",
    ] {
        std::fs::write(&manifest, text).unwrap();
        let e = Fsdp::read_parameter_files(tmp.path())
            .expect_err(text)
            .to_string();
        assert!(e.contains("weights.manifest"), "{text:?}: {e}");
    }
}

#[test]
#[parallel]
fn a_directory_that_takes_no_files_is_refused_naming_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let group = group(tmp.path());
    // A file where the directory should be: no file can be made in it, as root too.
    let dir = tmp.path().join("not-a-dir");
    std::fs::write(&dir, b"x").unwrap();
    let e = Fsdp::new_in_dir(&group, FsdpConfig::default(), &dir.join("weights"))
        .expect_err("refused")
        .to_string();
    assert!(e.contains("not-a-dir"), "{e}");
}

/// One rank's share of 10 steps with AdamW stepped in backward, its shards in files
/// (`files`) or in memory, with 2 micro-batches (summed in files, or in the shards'
/// `.grad` with the optimizer after backward); writes the full weights.
fn train_share(group: &ProcessGroup, files: bool, out: &Path) {
    let (rank, n) = (group.rank() as i64, group.world_size() as i64);
    let (x, y) = data();
    let local = BATCH / n;
    let (x, y) = (
        x.narrow(0, rank * local, local),
        y.narrow(0, rank * local, local),
    );
    let (_vs, layers) = layers_of(&DIMS, 1);
    let dir = out.join(format!("shards-rank{rank}"));
    let mut fsdp = if files {
        Fsdp::new_in_dir(group, FsdpConfig::default(), &dir).expect("fsdp in files")
    } else {
        Fsdp::new(group, FsdpConfig::default()).expect("fsdp")
    };
    let units = sharded(&mut fsdp, layers);
    let opt = AdamW::new(&fsdp.parameters(), CONFIG).expect("optimizer");
    let (mut after, _hooked) = if files {
        (
            None,
            Some(fsdp.step_in_backward(opt).expect("step_in_backward")),
        )
    } else {
        (Some(opt), None)
    };
    for _ in 0..10 {
        accumulated_step(&fsdp, &units, &x, &y, false);
        if let Some(opt) = after.as_mut() {
            opt.f_step().expect("step");
            opt.zero_grad(true);
        }
    }
    let full = fsdp.f_full_parameters().expect("full parameters");
    let bytes: Vec<u8> = flat(&full).iter().flat_map(|v| v.to_le_bytes()).collect();
    let tag = if files { "files" } else { "memory" };
    std::fs::write(out.join(format!("{tag}-rank{rank}.params")), bytes).expect("write");
    fsdp.discard();
}

#[test]
#[ignore = "a rank of fsdp_files::on_two_ranks_shards_in_files_train_bitwise_like_shards_in_memory: started by the launcher"]
fn fsdp_files_worker() {
    let out = crate::common::out_dir();
    let options = InitOptions {
        timeout: std::time::Duration::from_secs(60),
        ..Default::default()
    };
    let group = memsave_dist::init_process_group(&options).expect("join the group");
    for files in [false, true] {
        train_share(&group, files, &out);
    }
}

#[test]
#[serial]
fn on_two_ranks_shards_in_files_train_bitwise_like_shards_in_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    crate::common::run_ranks("fsdp_files::fsdp_files_worker", 2, dir.path())
        .expect("every rank succeeds");
    let read = |name: &str| std::fs::read(dir.path().join(name)).expect(name);
    let memory = read("memory-rank0.params");
    assert_eq!(read("memory-rank1.params"), memory, "the ranks agree");
    assert_eq!(
        read("files-rank0.params"),
        memory,
        "rank 0, shards in files"
    );
    assert_eq!(
        read("files-rank1.params"),
        memory,
        "rank 1, shards in files"
    );
}

/// One step of two micro-batches, each unit's gradients summed in its file until the
/// second (with the shards in memory, in their `.grad`); `stop_after_first`: the step fails after the first micro-batch's backward
/// (nothing after it runs).
fn accumulated_step(
    fsdp: &Fsdp,
    units: &[Arc<Mutex<FsdpUnit>>],
    x: &Tensor,
    y: &Tensor,
    stop_after_first: bool,
) {
    let half = x.size()[0] / 2;
    for m in 0..2 {
        fsdp.set_accumulate(m == 0).expect("set_accumulate");
        let (xm, ym) = (x.narrow(0, m * half, half), y.narrow(0, m * half, half));
        (loss(fsdp, units, &xm, &ym).expect("forward") * 0.5).backward();
        if stop_after_first {
            return;
        }
    }
    fsdp.f_finish_backward().expect("finish_backward");
}

/// A step that fails after its first micro-batch left each unit's gradient sum in a
/// file; `f_discard_unfinished_step` drops them, and the next step's weights are those
/// of a run where the failed step never happened.
#[test]
#[serial]
fn a_failed_step_s_gradient_sums_do_not_reach_the_next_step() {
    let (x, y) = data();
    let run = |fail_between: bool| {
        let tmp = tempfile::tempdir().expect("tempdir");
        let group = group(tmp.path());
        let (fsdp, units) = setup(&group, &tmp.path().join("weights"));
        accumulated_step(&fsdp, &units, &x, &y, false);
        if fail_between {
            accumulated_step(&fsdp, &units, &x, &y, true);
            fsdp.f_discard_unfinished_step().expect("discard");
        }
        accumulated_step(&fsdp, &units, &x, &y, false);
        let weights = flat(&fsdp.f_full_parameters().expect("weights"));
        fsdp.discard();
        weights
    };
    assert_eq!(run(true), run(false));
}

/// A parameter of more than 64 Ki values is one optimizer tensor with the shards in
/// memory and two with them in files: a checkpoint saved one way is refused the other
/// way, saying so.
#[test]
#[serial]
fn a_checkpoint_of_shards_in_memory_is_refused_with_shards_in_files_saying_why() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let group = group(tmp.path());
    let dims = [300, 300];
    let x = Tensor::randn([4, 300], (Kind::Float, Device::Cpu));
    let train = |fsdp: &mut Fsdp| {
        let (_vs, layers) = layers_of(&dims, 1);
        let units = sharded(fsdp, layers);
        let opt = AdamW::new(&fsdp.parameters(), CONFIG).expect("optimizer");
        let loss = fsdp
            .forward(|| {
                let y = units[0]
                    .lock()
                    .unwrap()
                    .f_forward_t(&x, true)
                    .expect("unit");
                y.square().mean(Kind::Float)
            })
            .expect("forward");
        loss.backward();
        fsdp.f_finish_backward().expect("finish");
        opt
    };
    let mut memory = Fsdp::new(&group, FsdpConfig::default()).expect("fsdp");
    let mut opt = train(&mut memory);
    opt.f_step().expect("step");
    let checkpoint = tmp.path().join("checkpoint");
    memory.save_sharded(&checkpoint, &opt, 1).expect("saved");
    memory.discard();
    let mut files = Fsdp::new_in_dir(&group, FsdpConfig::default(), &tmp.path().join("w"))
        .expect("fsdp in files");
    let (_vs, layers) = layers_of(&dims, 1);
    let _units = sharded(&mut files, layers);
    let mut chunks = AdamW::new(&files.parameters(), CONFIG).expect("optimizer");
    assert_eq!(
        files.parameters().len(),
        3,
        "the weight in two chunks, the bias"
    );
    let e = files
        .load_sharded(&checkpoint, &mut chunks)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("saved with the shards in memory"), "{e}");
    files.discard();
}
