//! The launcher ends every rank when one dies, names it, and leaves no process behind.
use crate::common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use memsave_dist::{init_process_group, launch, DistError, InitOptions, LaunchConfig};
use tch::Tensor;

fn alive(pid: u32) -> bool {
    // A reaped process has no /proc entry; a zombie would still have one, but its
    // state is 'Z'.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.contains(") Z "))
        .unwrap_or(false)
}

fn read_pids(dir: &Path) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir(dir).expect("output dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "pid") {
            let text = std::fs::read_to_string(&path).expect("pid file");
            pids.push(text.trim().parse().expect("a pid"));
        }
    }
    pids
}

#[test]
#[ignore = "a rank of killing_a_rank_ends_the_others: started by the launcher"]
fn steps_until_killed() {
    let out = common::out_dir();
    let rank = common::env_usize("RANK");
    let options = InitOptions {
        timeout: Duration::from_secs(60),
        ..Default::default()
    };
    let group = init_process_group(&options).expect("join the group");
    std::fs::write(
        out.join(format!("rank{rank}.pid")),
        std::process::id().to_string(),
    )
    .expect("write pid");
    // A process of the rank's own: the launcher must end it too.
    let mut helper = Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("start sleep");
    std::fs::write(
        out.join(format!("helper{rank}.pid")),
        helper.id().to_string(),
    )
    .expect("write pid");
    let mut t = Tensor::ones([1024], (tch::Kind::Float, tch::Device::Cpu));
    // Far more steps than the test waits for: rank 1 dies at step 5, and the launcher
    // ends the others.
    for step in 0..1_000_000 {
        if rank == 1 && step == 5 {
            std::fs::write(out.join("killed"), "rank 1 at step 5").expect("write marker");
            Command::new("kill")
                .args(["-KILL", &std::process::id().to_string()])
                .status()
                .expect("kill");
        }
        group.all_reduce(&t).expect("all_reduce");
        let _ = t.f_div_scalar_(group.world_size() as f64).expect("div");
    }
    let _ = helper.kill();
    let _ = helper.wait();
    panic!("rank {rank} finished every step: rank 1 was never killed");
}

#[test]
fn killing_a_rank_ends_the_others_and_names_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let started = Instant::now();
    let outcome = common::run_ranks("launch::steps_until_killed", 3, dir.path());
    let elapsed = started.elapsed();
    match outcome {
        Err(DistError::RankFailed {
            rank,
            ref status,
            exit_code,
        }) => {
            assert_eq!(rank, 1, "{outcome:?}");
            assert_eq!(status, "killed by signal 9");
            assert_eq!(exit_code, 128 + 9);
        }
        other => panic!("expected rank 1 to fail, got {other:?}"),
    }
    let message = outcome.unwrap_err().to_string();
    assert!(message.contains("rank 1 failed"), "{message}");
    assert!(
        dir.path().join("killed").exists(),
        "rank 1 reached its fifth step"
    );
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
    let pids = read_pids(dir.path());
    assert_eq!(
        pids.len(),
        6,
        "three ranks and three helpers wrote their pids"
    );
    for pid in pids {
        assert!(!alive(pid), "process {pid} outlived the launch");
    }
}

#[test]
#[ignore = "a rank of a launch that fails with exit code 3 on rank 2"]
fn exits_3_on_rank_2() {
    assert_eq!(common::env_usize("WORLD_SIZE"), 3);
    assert_eq!(std::env::var("MASTER_ADDR").as_deref(), Ok("127.0.0.1"));
    if common::env_usize("RANK") == 2 {
        std::process::exit(3);
    }
    // The other ranks would wait forever; the launcher ends them.
    loop {
        std::thread::park();
    }
}

#[test]
fn a_failing_rank_ends_ranks_that_would_wait_forever() {
    let dir = tempfile::tempdir().expect("tempdir");
    let started = Instant::now();
    let outcome = common::run_ranks("launch::exits_3_on_rank_2", 3, dir.path());
    assert!(
        matches!(
            outcome,
            Err(DistError::RankFailed {
                rank: 2,
                exit_code: 3,
                ..
            })
        ),
        "{outcome:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

// ---------------------------------------------------------------------------------------
// The launcher as a process of its own: this test binary, re-run as the ignored test
// `launcher_of_scripts`, launches `sh -c "$MEMSAVE_TEST_SCRIPT"` as its ranks. The tests
// below signal it, take `kill` off its PATH and leave a process holding its output, and
// then look for any process of the launch left behind: every process started under it
// inherits MEMSAVE_TEST_TAG, so a scan of /proc finds them all, setsid'd ones included.

/// The environment variable that marks every process of one test's launch.
const TAG: &str = "MEMSAVE_TEST_TAG";

#[test]
#[ignore = "the launcher of the tests below: started by them as a process of its own"]
fn launcher_of_scripts() {
    let script = std::env::var("MEMSAVE_TEST_SCRIPT").expect("MEMSAVE_TEST_SCRIPT is set");
    let config = memsave_dist::LaunchConfig {
        nproc_per_node: common::env_usize("MEMSAVE_TEST_RANKS"),
        timeout: Some(Duration::from_secs(120)),
        ..Default::default()
    };
    let outcome = memsave_dist::launch(&config, "sh".as_ref(), &["-c".into(), script.into()]);
    match outcome {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("launch: {e}");
            match e {
                DistError::Interrupted { signal, .. } => std::process::exit(128 + signal),
                _ => std::process::exit(1),
            }
        }
    }
}

/// The processes (not zombies) whose environment holds `TAG=tag`.
fn tagged(tag: &str) -> Vec<u32> {
    let needle = format!("{TAG}={tag}\0").into_bytes();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc") {
        let Ok(entry) = entry else { continue };
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

/// SIGKILLs every process of the launch when the test ends, passed or failed, so that a
/// failing test leaves nothing behind either.
struct KillTagged(String);

impl Drop for KillTagged {
    fn drop(&mut self) {
        for pid in tagged(&self.0) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
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

/// A directory holding only `sh`, `sleep` and `setsid`: a PATH without `kill`.
fn path_without_kill(dir: &Path) -> std::ffi::OsString {
    let bin = dir.join("bin");
    std::fs::create_dir(&bin).expect("bin dir");
    for tool in ["sh", "sleep", "setsid"] {
        let found = ["/usr/bin", "/bin"]
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("{tool} is installed"));
        std::os::unix::fs::symlink(found, bin.join(tool)).expect("symlink");
    }
    assert!(!bin.join("kill").exists());
    bin.into_os_string()
}

struct Launcher {
    child: std::process::Child,
    dir: tempfile::TempDir,
    _cleanup: KillTagged,
}

impl Launcher {
    /// Starts the launcher of `ranks` ranks running `script` (which finds its
    /// directory in `$MEMSAVE_TEST_OUT`), with `path` as PATH if given.
    fn start(ranks: usize, script: &str, path: Option<std::ffi::OsString>) -> Launcher {
        Launcher::start_after(ranks, script, path, None)
    }

    /// As `start`, with `shell` run first by `sh` in the launcher's process, which then
    /// execs the launcher.
    fn start_after(
        ranks: usize,
        script: &str,
        path: Option<std::ffi::OsString>,
        shell: Option<&str>,
    ) -> Launcher {
        let dir = tempfile::tempdir().expect("tempdir");
        let tag = dir.path().display().to_string();
        let exe = std::env::current_exe().expect("this test binary");
        let mut command = match shell {
            Some(shell) => {
                let mut c = Command::new("/bin/sh");
                c.args(["-c", &format!(r#"{shell}; exec "$0" "$@""#)])
                    .arg(exe);
                c
            }
            None => Command::new(exe),
        };
        command
            .args([
                "launch::launcher_of_scripts",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("MEMSAVE_TEST_OUT", dir.path())
            .env("MEMSAVE_TEST_RANKS", ranks.to_string())
            .env("MEMSAVE_TEST_SCRIPT", script)
            .env(TAG, &tag)
            .stdin(std::process::Stdio::null())
            .stdout(std::fs::File::create(dir.path().join("stdout")).expect("stdout file"))
            .stderr(std::fs::File::create(dir.path().join("stderr")).expect("stderr file"));
        if let Some(path) = path {
            command.env("PATH", path);
        }
        let child = command.spawn().expect("start the launcher");
        Launcher {
            child,
            dir,
            _cleanup: KillTagged(tag),
        }
    }

    fn out(&self) -> &Path {
        self.dir.path()
    }

    fn tag(&self) -> String {
        self.dir.path().display().to_string()
    }

    /// The pids in the files `names` of the output directory, once all are written.
    fn wait_for_pids(&self, names: &[String]) -> Vec<u32> {
        let mut pids = Vec::new();
        let written = within(Duration::from_secs(60), || {
            pids = names
                .iter()
                .filter_map(|n| std::fs::read_to_string(self.out().join(n)).ok())
                .filter_map(|t| t.trim().parse().ok())
                .collect();
            pids.len() == names.len()
        });
        assert!(written, "the ranks wrote {pids:?} of {names:?}");
        pids
    }

    /// The launcher's exit status if it exits within `limit`.
    fn exits_within(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let mut status = None;
        within(limit, || {
            status = self.child.try_wait().expect("try_wait");
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
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Each rank writes its pid, starts a child of its own (in the rank's process group) and
/// waits for it: 1000 s unless someone ends them.
const SLEEPERS: &str = r#"echo $$ > "$MEMSAVE_TEST_OUT/rank$RANK.pid"; sleep 1000 & echo $! > "$MEMSAVE_TEST_OUT/child$RANK.pid"; wait"#;

fn sleeper_files(ranks: usize) -> Vec<String> {
    (0..ranks)
        .flat_map(|r| [format!("rank{r}.pid"), format!("child{r}.pid")])
        .collect()
}

fn signal_ends_every_rank(signal: nix::sys::signal::Signal, path: Option<std::ffi::OsString>) {
    signal_ends_every_rank_after(signal, path, None);
}

/// As `signal_ends_every_rank`, with `shell` run first in the launcher's process.
fn signal_ends_every_rank_after(
    signal: nix::sys::signal::Signal,
    path: Option<std::ffi::OsString>,
    shell: Option<&str>,
) {
    let mut launcher = Launcher::start_after(3, SLEEPERS, path, shell);
    let pids = launcher.wait_for_pids(&sleeper_files(3));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(launcher.child.id() as i32),
        signal,
    )
    .expect("signal the launcher");
    let sent = Instant::now();
    let status = launcher.exits_within(Duration::from_secs(10));
    let tag = launcher.tag();
    let gone = within(
        Duration::from_secs(10).saturating_sub(sent.elapsed()),
        || tagged(&tag).is_empty(),
    );
    let left = tagged(&tag);
    assert!(
        gone,
        "processes {left:?} of the launch (ranks and their children {pids:?}) outlived {signal} to the launcher by 10 s"
    );
    for pid in &pids {
        assert!(!alive(*pid), "process {pid} outlived the launch");
    }
    let status = status.unwrap_or_else(|| panic!("the launcher still runs 10 s after {signal}"));
    assert_eq!(
        status.code(),
        Some(128 + signal as i32),
        "{status:?}: {}",
        launcher.stderr()
    );
    let stderr = launcher.stderr();
    assert!(
        stderr.contains(&format!("interrupted by {signal}")),
        "{stderr}"
    );
}

#[test]
fn sigterm_to_the_launcher_ends_every_rank_and_its_children() {
    signal_ends_every_rank(nix::sys::signal::Signal::SIGTERM, None);
}

#[test]
fn sigint_to_the_launcher_ends_every_rank_without_kill_on_path() {
    let bin = tempfile::tempdir().expect("tempdir");
    signal_ends_every_rank(
        nix::sys::signal::Signal::SIGINT,
        Some(path_without_kill(bin.path())),
    );
}

#[test]
fn sigint_ignored_when_the_launcher_starts_still_ends_every_rank() {
    // A background job of a non-interactive shell starts with SIGINT ignored (so does
    // `cargo test` run as one); the launcher catches it anyway, as torchrun does.
    signal_ends_every_rank_after(nix::sys::signal::Signal::SIGINT, None, Some("trap '' INT"));
}

#[test]
fn sighup_to_the_launcher_ends_every_rank() {
    signal_ends_every_rank(nix::sys::signal::Signal::SIGHUP, None);
}

#[test]
fn a_failing_rank_ends_the_others_without_kill_on_path() {
    let bin = tempfile::tempdir().expect("tempdir");
    let script = r#"if [ $RANK = 1 ]; then exit 3; fi; echo $$ > "$MEMSAVE_TEST_OUT/rank$RANK.pid"; exec sleep 1000"#;
    let mut launcher = Launcher::start(2, script, Some(path_without_kill(bin.path())));
    let status = launcher.exits_within(Duration::from_secs(30));
    let tag = launcher.tag();
    assert!(
        within(Duration::from_secs(10), || tagged(&tag).is_empty()),
        "processes {:?} outlived the launch",
        tagged(&tag)
    );
    let status = status.expect("the launcher ends within 30 s of rank 1's failure");
    assert_eq!(status.code(), Some(1), "{status:?}");
    let stderr = launcher.stderr();
    assert!(stderr.contains("rank 1 failed (exit code 3)"), "{stderr}");
}

#[test]
fn a_setsid_grandchild_holding_stdout_does_not_keep_the_launcher_alive() {
    // The grandchild leaves the rank's process group and session, so no signal of the
    // launcher reaches it; it keeps the write end of the rank's stdout and stderr open
    // for 1000 s. Every rank exits 0 at once.
    let script = r#"setsid sleep 1000 & echo $! > "$MEMSAVE_TEST_OUT/grandchild$RANK.pid"; echo rank $RANK done"#;
    let mut launcher = Launcher::start(2, script, None);
    let grandchildren =
        launcher.wait_for_pids(&["grandchild0.pid".into(), "grandchild1.pid".into()]);
    let status = launcher.exits_within(Duration::from_secs(10));
    let stdout = launcher.stdout();
    for pid in &grandchildren {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(*pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let status = status.expect("the launcher exits within 10 s of its ranks");
    assert!(status.success(), "{status:?}: {}", launcher.stderr());
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("[rank {rank}] rank {rank} done\n")),
            "{stdout}"
        );
    }
}

/// Bit `s - 1` of a signal mask in /proc/PID/status.
fn mask_has(pid: u32, field: &str, signal: nix::sys::signal::Signal) -> bool {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{field} in {status}"));
    let mask = u64::from_str_radix(line[field.len()..].trim(), 16).expect("a hex mask");
    mask & (1u64 << (signal as i32 - 1)) != 0
}

#[test]
fn a_signal_ignored_when_the_launch_starts_stays_ignored() {
    use nix::sys::signal::Signal;
    // As under `nohup`: SIGHUP ignored. The launcher must not catch it (a hang-up would
    // then end the ranks nohup was meant to keep), but still catches SIGINT and SIGTERM.
    let mut launcher = Launcher::start_after(2, SLEEPERS, None, Some("trap '' HUP"));
    launcher.wait_for_pids(&sleeper_files(2));
    let pid = launcher.child.id();
    assert!(mask_has(pid, "SigIgn:", Signal::SIGHUP));
    assert!(!mask_has(pid, "SigCgt:", Signal::SIGHUP));
    assert!(mask_has(pid, "SigCgt:", Signal::SIGTERM));
    assert!(mask_has(pid, "SigCgt:", Signal::SIGINT));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), Signal::SIGTERM)
        .expect("signal the launcher");
    let status = launcher
        .exits_within(Duration::from_secs(10))
        .expect("the launcher ends within 10 s of SIGTERM");
    assert_eq!(status.code(), Some(128 + 15), "{}", launcher.stderr());
}

/// A configuration for `sh -c 'touch $MEMSAVE_TEST_OUT/started...'`.
fn marking(dir: &Path, config: LaunchConfig) -> LaunchConfig {
    LaunchConfig {
        env: vec![("MEMSAVE_TEST_OUT".into(), dir.as_os_str().to_owned())],
        ..config
    }
}

#[test]
fn a_launch_that_cannot_work_is_refused_before_anything_starts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let script: Vec<std::ffi::OsString> = vec![
        "-c".into(),
        r#"touch "$MEMSAVE_TEST_OUT/started$RANK""#.into(),
    ];
    let too_many = memsave_dist::MAX_NPROC_PER_NODE + 1;
    let cases = [
        (
            LaunchConfig {
                nproc_per_node: 0,
                ..Default::default()
            },
            "-n 0: ".to_owned(),
        ),
        (
            LaunchConfig {
                nproc_per_node: too_many,
                ..Default::default()
            },
            format!("-n {too_many}: "),
        ),
        (
            LaunchConfig {
                nnodes: 0,
                ..Default::default()
            },
            "--nnodes 0: ".to_owned(),
        ),
        (
            LaunchConfig {
                nnodes: 2,
                node_rank: 2,
                master_port: Some(29500),
                ..Default::default()
            },
            "--node-rank 2 is not below --nnodes 2".to_owned(),
        ),
        (
            LaunchConfig {
                nnodes: 2,
                ..Default::default()
            },
            "--master-port is required".to_owned(),
        ),
        (
            LaunchConfig {
                nnodes: 2,
                master_port: Some(0),
                ..Default::default()
            },
            "--master-port is required".to_owned(),
        ),
        (
            LaunchConfig {
                timeout: Some(Duration::ZERO),
                ..Default::default()
            },
            "--timeout 0 ".to_owned(),
        ),
    ];
    for (config, start) in cases {
        let described = format!("{config:?}");
        match launch(&marking(dir.path(), config), "sh".as_ref(), &script) {
            Err(DistError::InvalidLaunch { reason }) => {
                assert!(reason.starts_with(&start), "{described}: {reason}");
                assert_eq!(reason.lines().count(), 1, "{reason}");
            }
            other => panic!("{described}: expected InvalidLaunch, got {other:?}"),
        }
    }
    let started: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
    assert!(started.is_empty(), "ranks started: {started:?}");
}

#[test]
fn master_port_0_is_a_free_port_shared_by_every_rank() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = marking(
        dir.path(),
        LaunchConfig {
            nproc_per_node: 3,
            master_port: Some(0),
            ..Default::default()
        },
    );
    let script: Vec<std::ffi::OsString> = vec![
        "-c".into(),
        r#"echo $MASTER_PORT > "$MEMSAVE_TEST_OUT/port$RANK""#.into(),
    ];
    launch(&config, "sh".as_ref(), &script).expect("launch");
    let ports: Vec<u16> = (0..3)
        .map(|r| {
            std::fs::read_to_string(dir.path().join(format!("port{r}")))
                .expect("each rank wrote its port")
                .trim()
                .parse()
                .expect("a port")
        })
        .collect();
    assert_ne!(ports[0], 0);
    assert!(ports.iter().all(|&p| p == ports[0]), "{ports:?}");
}

#[test]
#[ignore = "a rank of ranks_on_one_node_get_one_thread_unless_told_otherwise"]
fn writes_its_thread_count() {
    let rank = common::env_usize("RANK");
    let var = std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| "unset".to_owned());
    std::fs::write(
        common::out_dir().join(format!("threads{rank}")),
        format!("{var} {}", tch::get_num_threads()),
    )
    .expect("write the thread count");
}

/// What each of `n` ranks of `writes_its_thread_count` saw, launched with `env`.
fn rank_threads(n: usize, env: &[(&str, &str)]) -> Vec<String> {
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("the test binary's path");
    let args: Vec<std::ffi::OsString> = [
        "launch::writes_its_thread_count",
        "--exact",
        "--ignored",
        "--test-threads",
        "1",
    ]
    .iter()
    .map(Into::into)
    .collect();
    let mut vars = vec![("MEMSAVE_TEST_OUT".into(), dir.path().as_os_str().to_owned())];
    vars.extend(env.iter().map(|(k, v)| ((*k).into(), (*v).into())));
    let config = LaunchConfig {
        nproc_per_node: n,
        timeout: Some(Duration::from_secs(60)),
        env: vars,
        ..Default::default()
    };
    launch(&config, exe.as_os_str(), &args).expect("launch");
    (0..n)
        .map(|r| std::fs::read_to_string(dir.path().join(format!("threads{r}"))).expect("read"))
        .collect()
}

#[test]
fn ranks_on_one_node_get_one_thread_unless_told_otherwise() {
    // As torchrun: several ranks on a node each get one intra-op thread, unless the
    // user set OMP_NUM_THREADS (here or in the launch's environment).
    let expected = match std::env::var("OMP_NUM_THREADS") {
        Ok(own) => format!("{own} {own}"),
        Err(_) => "1 1".to_owned(),
    };
    assert_eq!(rank_threads(2, &[]), vec![expected.clone(), expected]);
    assert_eq!(
        rank_threads(2, &[("OMP_NUM_THREADS", "2")]),
        vec!["2 2".to_owned(), "2 2".to_owned()]
    );
    // One rank: the machine is its own; nothing is set.
    let own = std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| "unset".to_owned());
    let alone = rank_threads(1, &[]);
    assert!(alone[0].starts_with(&format!("{own} ")), "{alone:?}");
}
