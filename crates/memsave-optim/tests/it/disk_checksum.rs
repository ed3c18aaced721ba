//! State kept on disk (`Placement::Disk`) is checked when read back: a changed byte, a
//! missing byte or an extra byte makes the step fail, naming the file, and leaves the
//! parameter as it was (Trust II, finding 3).
use std::path::{Path, PathBuf};

use memsave_optim::{AdamW, AdamWConfig, OptimError, Options, Placement, Sgd, SgdConfig, State};
use tch::{Device, Kind, Tensor};

fn param(n: i64) -> Tensor {
    let idx = Tensor::arange(n, (Kind::Float, Device::Cpu));
    (idx * 0.61).sin().set_requires_grad(true)
}

fn set_grad(p: &Tensor, step: i64) {
    memsave_sys::tensor::set_grad_none(p).unwrap();
    let idx = Tensor::arange(p.numel() as i64, (Kind::Float, Device::Cpu));
    let g = (idx * 0.83 + step as f64).sin();
    (p * g).sum(Kind::Float).backward();
}

/// An optimizer over one parameter of `n` values with its state in `dir`, stepped once
/// so that the state file exists.
fn stepped(
    n: i64,
    state: State,
    dir: &Path,
    sgd: bool,
) -> (Tensor, Box<dyn FnMut() -> Result<(), OptimError>>) {
    let p = param(n);
    let options = Options {
        state,
        placement: Placement::Disk(dir.to_path_buf()),
        ..Default::default()
    };
    let params = [p.shallow_clone()];
    let mut step: Box<dyn FnMut() -> Result<(), OptimError>> = if sgd {
        let config = SgdConfig {
            momentum: 0.9,
            ..Default::default()
        };
        let mut opt = Sgd::with_options(&params, config, options).unwrap();
        Box::new(move || opt.f_step())
    } else {
        let mut opt = AdamW::with_options(&params, AdamWConfig::default(), options).unwrap();
        Box::new(move || opt.f_step())
    };
    set_grad(&p, 0);
    step().unwrap();
    set_grad(&p, 1);
    (p, step)
}

fn file(dir: &Path) -> PathBuf {
    dir.join("param-0.state")
}

/// Changes the state file with `damage`, steps, and checks the error and that the
/// parameter did not move.
fn assert_refused(n: i64, state: State, sgd: bool, what: &str, damage: impl Fn(&mut Vec<u8>)) {
    let dir = tempfile::tempdir().unwrap();
    let (p, mut step) = stepped(n, state, dir.path(), sgd);
    let path = file(dir.path());
    let mut bytes = std::fs::read(&path).unwrap();
    damage(&mut bytes);
    std::fs::write(&path, &bytes).unwrap();
    let before = p.detach().copy();
    let err = step().expect_err(&format!(
        "n={n} {state:?} sgd={sgd}: a state file with {what} was accepted"
    ));
    let message = err.to_string();
    assert!(
        message.contains(&path.display().to_string()),
        "n={n} {state:?}: the error does not name the file: {message}"
    );
    assert!(
        matches!(err, OptimError::StateFile { .. }),
        "n={n} {state:?}: {what}: {err:?}"
    );
    assert!(
        p.detach().equal(&before),
        "n={n} {state:?} sgd={sgd}: {what} moved the parameter"
    );
}

const SIZES: [i64; 5] = [1, 3, 64, 257, 5000];
const STATES: [State; 3] = [State::F32, State::Bf16, State::Int8Blockwise { block: 64 }];

#[test]
#[serial_test::parallel]
fn a_flipped_byte_anywhere_in_the_state_file_is_refused_naming_the_file() {
    for n in SIZES {
        for state in STATES {
            for sgd in [false, true] {
                let dir = tempfile::tempdir().unwrap();
                let (_, _) = stepped(n, state, dir.path(), sgd);
                let len = std::fs::metadata(file(dir.path())).unwrap().len() as usize;
                // First, last, middle and a few in between.
                let mut positions = vec![0, len - 1, len / 2, len / 3, (2 * len) / 3];
                positions.dedup();
                for at in positions {
                    for mask in [0x01u8, 0x80] {
                        assert_refused(n, state, sgd, &format!("byte {at} ^ {mask:#x}"), |b| {
                            b[at] ^= mask
                        });
                    }
                }
            }
        }
    }
}

#[test]
#[serial_test::parallel]
fn extra_or_missing_bytes_are_refused_naming_the_file() {
    for n in SIZES {
        for state in STATES {
            for sgd in [false, true] {
                for extra in [1usize, 4, 1000] {
                    assert_refused(n, state, sgd, &format!("{extra} extra bytes"), |b| {
                        b.extend(std::iter::repeat_n(0u8, extra))
                    });
                }
                for missing in [1usize, 2] {
                    assert_refused(n, state, sgd, &format!("{missing} bytes missing"), |b| {
                        b.truncate(b.len() - missing)
                    });
                }
                assert_refused(n, state, sgd, "no bytes", |b| b.clear());
            }
        }
    }
}

#[test]
#[serial_test::parallel]
fn an_intact_state_file_still_steps_after_a_refused_one_is_restored() {
    let dir = tempfile::tempdir().unwrap();
    let (p, mut step) = stepped(100, State::Int8Blockwise { block: 64 }, dir.path(), false);
    let path = file(dir.path());
    let good = std::fs::read(&path).unwrap();
    let mut bad = good.clone();
    bad[10] ^= 0x10;
    std::fs::write(&path, &bad).unwrap();
    assert!(step().is_err());
    std::fs::write(&path, &good).unwrap();
    let before = p.detach().copy();
    step().unwrap();
    assert!(!p.detach().equal(&before), "the step moved nothing");
}
