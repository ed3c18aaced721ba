//! `memsave launch` under signals, resource limits and bad options: it ends every rank
//! it started, exits with a code that says why, and never panics.
//!
//! Every process of a launch inherits MEMSAVE_TEST_TAG, so a scan of /proc finds any
//! left behind; each test SIGKILLs whatever it finds when it ends, passed or failed.
use crate::common::launch;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const TAG: &str = "MEMSAVE_TEST_TAG";

fn memsave() -> &'static str {
    env!("CARGO_BIN_EXE_memsave")
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

/// The live processes whose environment holds `TAG=tag`.
fn tagged(tag: &str) -> Vec<u32> {
    let needle = format!("{TAG}={tag}\0").into_bytes();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if environ.windows(needle.len()).any(|w| w == needle) && alive(pid) {
            found.push(pid);
        }
    }
    found
}

/// Polls `done` until it holds or `limit` has passed; whether it held.
fn within(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One launch under test: a temporary directory (`$MEMSAVE_TEST_OUT` of the ranks, and
/// the tag), the launcher's output in files there.
struct Run {
    dir: tempfile::TempDir,
    child: Option<Child>,
}

impl Run {
    fn new() -> Run {
        Run {
            dir: tempfile::tempdir().expect("tempdir"),
            child: None,
        }
    }

    fn tag(&self) -> String {
        self.dir.path().display().to_string()
    }

    fn out(&self) -> &Path {
        self.dir.path()
    }

    /// A directory holding only `sh` and `sleep`: a PATH without `kill`.
    fn path_without_kill(&self) -> OsString {
        let bin = self.out().join("bin");
        std::fs::create_dir(&bin).expect("bin dir");
        for tool in ["sh", "sleep"] {
            let found: PathBuf = ["/usr/bin", "/bin"]
                .iter()
                .map(|d| Path::new(d).join(tool))
                .find(|p| p.exists())
                .unwrap_or_else(|| panic!("{tool} is installed"));
            std::os::unix::fs::symlink(found, bin.join(tool)).expect("symlink");
        }
        bin.into_os_string()
    }

    /// Starts `program args` with the tag and `$MEMSAVE_TEST_OUT`, output to files.
    fn start(&mut self, program: &str, args: &[&str], path: Option<OsString>) {
        let mut command = Command::new(program);
        command
            .args(args)
            .env("MEMSAVE_TEST_OUT", self.out())
            .env(TAG, self.tag())
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(self.out().join("stdout")).expect("stdout file"))
            .stderr(std::fs::File::create(self.out().join("stderr")).expect("stderr file"));
        if let Some(path) = path {
            command.env("PATH", path);
        }
        self.child = Some(command.spawn().expect("start"));
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("started").id()
    }

    /// The exit status if the started process exits within `limit`.
    fn exits_within(&mut self, limit: Duration) -> Option<ExitStatus> {
        let child = self.child.as_mut().expect("started");
        let mut status = None;
        within(limit, || {
            status = child.try_wait().expect("try_wait");
            status.is_some()
        });
        status
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(self.out().join("stderr")).unwrap_or_default()
    }

    fn stdout(&self) -> String {
        std::fs::read_to_string(self.out().join("stdout")).unwrap_or_default()
    }

    /// The pids in the files `rank*.pid` written so far.
    fn rank_pids(&self) -> Vec<u32> {
        std::fs::read_dir(self.out())
            .expect("dir")
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".pid"))
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .filter_map(|t| t.trim().parse().ok())
            .collect()
    }

    /// Asserts that no process of the launch is left `limit` after `since`.
    fn assert_none_left(&self, since: Instant, limit: Duration) {
        let tag = self.tag();
        let gone = within(limit.saturating_sub(since.elapsed()), || {
            tagged(&tag).is_empty()
        });
        assert!(
            gone,
            "processes {:?} of the launch outlived it by {limit:?}; stderr: {}",
            tagged(&tag),
            self.stderr()
        );
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for pid in tagged(&self.tag()) {
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
        }
    }
}

/// Each rank writes its pid and sleeps 1000 s (with a child of its own).
const SLEEPER: &str = r#"echo $$ > "$MEMSAVE_TEST_OUT/rank$RANK.pid"; sleep 1000 & wait"#;

/// `memsave launch` of sleepers ended by `signal`; with `ignored`, started by a shell
/// that ignores `signal` first (as a background job of a script ignores SIGINT).
fn signal_ends_the_launch(signal: Signal, without_kill: bool, ignored: bool) {
    let mut run = Run::new();
    let path = without_kill.then(|| run.path_without_kill());
    if ignored {
        let script = format!(
            r#"trap '' {}; exec "$0" launch -n 3 -- sh -c '{SLEEPER}'"#,
            &signal.as_str()[3..]
        );
        run.start("/bin/sh", &["-c", &script, memsave()], path);
    } else {
        run.start(
            memsave(),
            &["launch", "-n", "3", "--", "sh", "-c", SLEEPER],
            path,
        );
    }
    assert!(
        within(Duration::from_secs(30), || run.rank_pids().len() == 3),
        "the ranks wrote their pids: {}",
        run.stderr()
    );
    kill(Pid::from_raw(run.pid() as i32), signal).expect("signal the launcher");
    let sent = Instant::now();
    let status = run.exits_within(Duration::from_secs(10));
    run.assert_none_left(sent, Duration::from_secs(10));
    let status = status.unwrap_or_else(|| panic!("memsave launch still runs 10 s after {signal}"));
    assert_eq!(
        status.code(),
        Some(128 + signal as i32),
        "{status:?}: {}",
        run.stderr()
    );
    let stderr = run.stderr();
    assert!(
        stderr.contains(&format!("memsave launch: error: interrupted by {signal}")),
        "{stderr}"
    );
}

#[test]
fn sigterm_ends_every_rank_and_exits_143() {
    signal_ends_the_launch(Signal::SIGTERM, false, false);
}

#[test]
fn sigint_ends_every_rank_and_exits_130_without_kill_on_path() {
    signal_ends_the_launch(Signal::SIGINT, true, false);
}

#[test]
fn sigint_ends_every_rank_even_when_ignored_at_the_start() {
    signal_ends_the_launch(Signal::SIGINT, false, true);
}

#[test]
fn a_spawn_failure_midway_ends_the_ranks_already_started() {
    // 40 ranks need 83 open files by the launcher's own bound (two pipes a rank, and
    // stdio), so the launch is not refused up front; the seven descriptors the shell
    // opens first make it run out of files part way. No `kill` on PATH. OMP_NUM_THREADS
    // is set so that the launcher prints no notice about threads before its error.
    let mut run = Run::new();
    let path = run.path_without_kill();
    let script = format!(
        r#"ulimit -n 83; exec 3</dev/null 4</dev/null 5</dev/null 6</dev/null 7</dev/null 8</dev/null 9</dev/null; OMP_NUM_THREADS=1 exec {} launch -n 40 -- sh -c '{SLEEPER}'"#,
        memsave()
    );
    run.start("/bin/sh", &["-c", &script], Some(path));
    let status = run
        .exits_within(Duration::from_secs(30))
        .expect("memsave launch ends within 30 s");
    let ended = Instant::now();
    run.assert_none_left(ended, Duration::from_secs(10));
    let stderr = run.stderr();
    assert!(!stderr.contains("panicked"), "{stderr}");
    let message = stderr.trim_end();
    assert_eq!(message.lines().count(), 1, "{stderr}");
    let rank: usize = message
        .strip_prefix("memsave launch: error: rank ")
        .and_then(|rest| rest.split(':').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("the error names a rank: {stderr}"));
    assert!(
        (1..40).contains(&rank),
        "rank {rank} could not start, after others did: {stderr}"
    );
    assert!(message.contains("could not start sh"), "{stderr}");
    assert!(
        !status.success() && status.code().is_some(),
        "{status:?}: {stderr}"
    );
}

#[test]
fn under_a_memory_limit_300_ranks_end_cleanly() {
    // The launch either starts all 300 and --timeout ends them, or one cannot start and
    // the launcher ends those that did; either way with one line and no panic
    // (OMP_NUM_THREADS set: no notice about threads).
    let mut run = Run::new();
    let script = format!(
        r#"ulimit -v 600000; OMP_NUM_THREADS=1 exec {} launch --timeout 5 -n 300 -- sh -c 'echo $$ > "$MEMSAVE_TEST_OUT/rank$RANK.pid"; exec sleep 1000'"#,
        memsave()
    );
    run.start("/bin/sh", &["-c", &script], None);
    let status = run
        .exits_within(Duration::from_secs(120))
        .expect("memsave launch ends within 120 s");
    let ended = Instant::now();
    run.assert_none_left(ended, Duration::from_secs(10));
    let stderr = run.stderr();
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("memsave launch: error: "), "{stderr}");
    assert!(
        matches!(status.code(), Some(1 | 124 | 127)),
        "{status:?}: {stderr}"
    );
}

#[test]
fn more_ranks_than_the_machine_can_run_is_a_usage_error() {
    let out = launch(&["-n", "100000", "--", "true"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("memsave launch: error: -n 100000: "),
        "{stderr}"
    );
}

#[test]
fn a_zero_timeout_is_a_usage_error() {
    let started = Instant::now();
    let out = launch(&["--timeout", "0", "-n", "1", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(started.elapsed() < Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--timeout"), "{stderr}");
}

#[test]
fn master_port_0_is_a_free_port() {
    let out = launch(&[
        "--master-port",
        "0",
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        "echo port=$MASTER_PORT",
    ]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ports: Vec<u16> = stdout
        .lines()
        .filter_map(|l| l.split("port=").nth(1))
        .map(|p| p.parse().expect("a port"))
        .collect();
    assert_eq!(ports.len(), 2, "{stdout}");
    assert_ne!(ports[0], 0, "{stdout}");
    assert_eq!(
        ports[0], ports[1],
        "every rank gets the same port: {stdout}"
    );
}

#[test]
fn usage_errors_name_no_rank() {
    for args in [
        &["-n", "0", "--", "true"][..],
        &["--nnodes", "2", "--node-rank", "2", "--", "true"],
        &["--nnodes", "2", "--master-port", "0", "--", "true"],
    ] {
        let out = launch(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.starts_with("memsave launch: error: ") && !stderr.contains("rank 0:"),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn a_setsid_grandchild_holding_stdout_does_not_keep_the_launch_alive() {
    let mut run = Run::new();
    let script = r#"setsid sleep 1000 & echo $! > "$MEMSAVE_TEST_OUT/grandchild$RANK.pid"; echo rank $RANK done"#;
    run.start(
        memsave(),
        &["launch", "-n", "2", "--", "sh", "-c", script],
        None,
    );
    let status = run.exits_within(Duration::from_secs(10));
    let grandchildren = run.rank_pids();
    for pid in &grandchildren {
        let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
    }
    let status = status.expect("memsave launch exits within 10 s of its ranks");
    assert!(status.success(), "{status:?}: {}", run.stderr());
    let stdout = run.stdout();
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("[rank {rank}] rank {rank} done\n")),
            "{stdout}"
        );
    }
    assert_eq!(grandchildren.len(), 2, "each rank started a grandchild");
}

/// `memsave bench` interrupted while a world_size case's ranks run: the ranks end, and
/// so does the run, with 128 + SIGINT, instead of going on to its next case.
#[test]
fn sigint_to_bench_during_a_distributed_case_ends_the_ranks_and_the_run() {
    let mut run = Run::new();
    let suite = run.dir.path().join("long.yaml");
    std::fs::write(
        &suite,
        "suite: long\nseed: 0\nthreads: 1\nwarmup: 0\nrepeats: 20000\nworld_size: 2\nmodels:\n  \
         - {name: lin, kind: residual_linear, layers: 8, hidden: 256, batch: [64]}\nstrategies:\n  \
         - {name: ddp, with: [{optimizer: {kind: adamw}}]}\n  \
         - {name: zero1, with: [{zero: 1}, {optimizer: {kind: adamw}}]}\n",
    )
    .expect("suite file");
    let suite = suite.display().to_string();
    run.start(memsave(), &["bench", &suite], None);
    let tag = run.tag();
    // The bench process and its two ranks.
    assert!(
        within(Duration::from_secs(120), || tagged(&tag).len() >= 3),
        "the ranks never started; stderr: {}",
        run.stderr()
    );
    kill(Pid::from_raw(run.pid() as i32), Signal::SIGINT).expect("SIGINT");
    let since = Instant::now();
    let status = run
        .exits_within(Duration::from_secs(15))
        .expect("bench exits after SIGINT");
    assert_eq!(status.code(), Some(130), "stderr: {}", run.stderr());
    run.assert_none_left(since, Duration::from_secs(10));
    let stderr = run.stderr();
    assert_eq!(
        stderr.matches("interrupted by SIGINT").count(),
        1,
        "{stderr}"
    );
}

/// `memsave fit --world-size` interrupted while its ranks run: the ranks end, and so
/// does fit, with 128 + SIGINT and the interruption said once (it was said twice).
#[test]
fn sigint_to_fit_on_ranks_ends_them_and_says_so_once() {
    let mut run = Run::new();
    let suite = run.dir.path().join("fit.yaml");
    std::fs::write(
        &suite,
        "suite: fit\nseed: 0\nthreads: 1\nmodels:\n  \
         - {name: lin, kind: residual_linear, layers: 8, hidden: 256, batch: [64]}\nstrategies:\n  \
         - {name: ddp, with: [{optimizer: {kind: adamw}}]}\n",
    )
    .expect("suite file");
    let suite = suite.display().to_string();
    run.start(
        memsave(),
        &[
            "fit",
            &suite,
            "--model",
            "lin",
            "--budget",
            "1GiB",
            "--world-size",
            "2",
            "--exhaustive",
        ],
        None,
    );
    let tag = run.tag();
    assert!(
        within(Duration::from_secs(120), || tagged(&tag).len() >= 3),
        "the ranks never started; stderr: {}",
        run.stderr()
    );
    kill(Pid::from_raw(run.pid() as i32), Signal::SIGINT).expect("SIGINT");
    let since = Instant::now();
    let status = run
        .exits_within(Duration::from_secs(15))
        .expect("fit exits after SIGINT");
    assert_eq!(status.code(), Some(130), "stderr: {}", run.stderr());
    run.assert_none_left(since, Duration::from_secs(10));
    let stderr = run.stderr();
    assert_eq!(
        stderr.matches("interrupted by SIGINT").count(),
        1,
        "{stderr}"
    );
}
