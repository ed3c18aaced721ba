//! `memsave launch`: environment, rank-prefixed output, and a failing rank's exit code.
use crate::common::launch;
use std::time::{Duration, Instant};

#[test]
fn every_rank_gets_its_environment_and_a_prefix() {
    let out = launch(&[
        "-n",
        "2",
        "--",
        "sh",
        "-c",
        "echo rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE addr=$MASTER_ADDR port=$MASTER_PORT",
    ]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for rank in 0..2 {
        let line = stdout
            .lines()
            .find(|l| {
                l.starts_with(&format!(
                    "[rank {rank}] rank={rank} local={rank} world=2 addr=127.0.0.1 port="
                ))
            })
            .unwrap_or_else(|| panic!("no line of rank {rank} in {stdout}"));
        let port: u16 = line.rsplit('=').next().unwrap().parse().expect("a port");
        assert!(port > 0);
    }
}

#[test]
fn a_failing_rank_ends_the_others_and_sets_the_exit_code() {
    let started = Instant::now();
    let out = launch(&[
        "-n",
        "3",
        "--",
        "sh",
        "-c",
        "if [ $RANK = 1 ]; then exit 7; fi; exec sleep 600",
    ]);
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(7), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rank 1 failed (exit code 7)"), "{stderr}");
}

#[test]
fn bad_options_exit_2() {
    let out = launch(&["-n", "0", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let out = launch(&["--nnodes", "2", "-n", "1", "--", "true"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--master-port is required"));
}

#[test]
fn a_launch_past_its_timeout_exits_124_and_leaves_no_rank() {
    let dir = tempfile::tempdir().unwrap();
    let started = Instant::now();
    let script = format!(
        "echo $$ > {}/rank$RANK.pid; exec sleep 600",
        dir.path().display()
    );
    let out = launch(&["--timeout", "2", "-n", "2", "--", "sh", "-c", &script]);
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(124), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("ranks [0, 1] still running after 2s"),
        "{stderr}"
    );
    for rank in 0..2 {
        let pid = std::fs::read_to_string(dir.path().join(format!("rank{rank}.pid")))
            .expect("the rank wrote its pid");
        let alive = std::fs::read_to_string(format!("/proc/{}/stat", pid.trim()))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false);
        assert!(
            !alive,
            "rank {rank} (pid {}) outlived the launch",
            pid.trim()
        );
    }
}

#[test]
fn a_program_that_cannot_start_exits_127_naming_the_rank() {
    let out = launch(&["-n", "2", "--", "/nonexistent/memsave-test-program"]);
    assert_eq!(out.status.code(), Some(127), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rank 0: could not start /nonexistent/memsave-test-program"),
        "{stderr}"
    );
}
