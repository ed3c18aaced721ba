//! Helpers of the multi-process tests: the ranks are this test binary itself, started
//! by the launcher with `--exact <module>::<worker> --ignored`.
#![allow(dead_code)]
use std::ffi::OsString;
use std::path::Path;
use std::time::Duration;

use memsave_dist::{launch, DistError, LaunchConfig};

/// Runs the ignored test `worker` of this binary as `n` ranks, with `out` in
/// `MEMSAVE_TEST_OUT`. `worker` is the test's full path (`parity::parity_worker`):
/// `--exact` matches nothing otherwise, and the ranks would pass having run nothing.
pub fn run_ranks(worker: &str, n: usize, out: &Path) -> Result<(), DistError> {
    let exe = std::env::current_exe().expect("the test binary's path");
    let args: Vec<OsString> = [
        worker,
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads",
        "1",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    let config = LaunchConfig {
        nproc_per_node: n,
        timeout: Some(Duration::from_secs(120)),
        env: vec![("MEMSAVE_TEST_OUT".into(), out.as_os_str().to_owned())],
        ..Default::default()
    };
    launch(&config, exe.as_os_str(), &args)
}

/// The directory the launching test passed down.
pub fn out_dir() -> std::path::PathBuf {
    std::env::var_os("MEMSAVE_TEST_OUT")
        .expect("MEMSAVE_TEST_OUT is set by the launching test; run this worker through it")
        .into()
}

pub fn env_usize(var: &str) -> usize {
    std::env::var(var)
        .unwrap_or_else(|_| panic!("{var} is set by the launcher"))
        .parse()
        .unwrap_or_else(|_| panic!("{var} is a number"))
}
