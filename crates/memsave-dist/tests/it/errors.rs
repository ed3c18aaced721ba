//! Bad input: each failure is an `Err` that names the rank and the cause. Ranks are
//! threads of this process here, joined over a file store or TCP on 127.0.0.1.
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use memsave_dist::{
    free_port, Backend, DdpConfig, DistError, DistributedDataParallel, InitOptions, ProcessGroup,
};
use serial_test::parallel;
use tch::{Device, Kind, Tensor};

fn options(seconds: u64) -> InitOptions {
    InitOptions {
        timeout: Duration::from_secs(seconds),
        ..Default::default()
    }
}

/// Runs `body(rank)` on `sizes.len()` threads, rank `r` believing the world has
/// `sizes[r]` ranks; returns each thread's result as text.
fn ranks<T: Send + 'static>(
    sizes: &[usize],
    path: &Path,
    body: impl Fn(ProcessGroup) -> Result<T, DistError> + Send + Sync + Copy + 'static,
) -> Vec<Result<T, String>> {
    let handles: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(rank, &size)| {
            let path = path.to_owned();
            thread::spawn(move || {
                ProcessGroup::new_file(&path, rank, size, &options(3))
                    .and_then(body)
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("no panic"))
        .collect()
}

#[test]
#[parallel]
fn an_unreachable_store_is_an_error_naming_the_rank_and_address() {
    let port = free_port().expect("a free port");
    let started = Instant::now();
    let err = ProcessGroup::new_tcp("127.0.0.1", port, 1, 2, &options(2))
        .expect_err("nobody serves the store");
    let message = err.to_string();
    assert!(
        message.starts_with("rank 1: rendezvous store at 127.0.0.1:"),
        "{message}"
    );
    assert!(message.contains(&port.to_string()), "{message}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

#[test]
#[parallel]
fn a_world_size_that_does_not_match_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let results = ranks(&[2, 3], &dir.path().join("store"), |_| Ok(()));
    let rank0 = results[0].as_ref().expect_err("rank 0 sees the mismatch");
    assert!(
        rank0.contains("rank 0: rendezvous: world size mismatch: this rank has 2, rank 1 has 3"),
        "{rank0}"
    );
    let rank1 = results[1]
        .as_ref()
        .expect_err("rank 1 waits for a rank 2 that never comes");
    assert!(
        rank1.starts_with("rank 1: rendezvous: ranks [2] did not join"),
        "{rank1}"
    );
}

#[test]
#[parallel]
fn mismatched_parameter_shapes_are_refused_at_the_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let results = ranks(&[2, 2], &dir.path().join("store"), |group| {
        let n = if group.rank() == 0 { 4 } else { 5 };
        let p = Tensor::zeros([n], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        DistributedDataParallel::new(&group, &[p], DdpConfig::default()).map(|_| ())
    });
    let rank0 = results[0].as_ref().expect_err("shapes differ");
    assert_eq!(
        rank0,
        "rank 0: parameter shapes differ from rank 1's: 1 tensors of 4 values here, 1 tensors of 5 values there"
    );
    let rank1 = results[1].as_ref().expect_err("shapes differ");
    assert!(
        rank1.starts_with("rank 1: parameter shapes differ from rank 0's"),
        "{rank1}"
    );
}

#[test]
#[parallel]
fn a_collective_that_a_rank_never_joins_times_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store");
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let other = {
        let path = path.clone();
        thread::spawn(move || {
            // Rank 1 stays in the group but never joins the all-reduce; it leaves once
            // rank 0 has given up, so that rank 0 sees a timeout and not a closed peer.
            let group = ProcessGroup::new_file(&path, 1, 2, &options(3)).expect("rank 1 joins");
            let _ = done_rx.recv();
            drop(group);
        })
    };
    let group = ProcessGroup::new_file(&path, 0, 2, &options(3)).expect("rank 0 joins");
    let started = Instant::now();
    let err = group
        .all_reduce(&Tensor::ones([4], (Kind::Float, Device::Cpu)))
        .expect_err("rank 1 never joins");
    let elapsed = started.elapsed();
    done_tx.send(()).expect("rank 1 waits");
    other.join().expect("rank 1 ends");
    let message = err.to_string();
    assert!(message.starts_with("rank 0: all_reduce:"), "{message}");
    assert!(message.to_lowercase().contains("timed out"), "{message}");
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
}

#[test]
#[parallel]
fn nccl_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let options = InitOptions {
        backend: Backend::Nccl,
        ..Default::default()
    };
    let err = ProcessGroup::new_file(&dir.path().join("store"), 0, 1, &options)
        .expect_err("NCCL is not built");
    assert!(
        err.to_string()
            .starts_with("rank 0: the NCCL backend is not built"),
        "{err}"
    );
}
