//! The launcher (`memsave launch`, the `torchrun` of memsave): starts the ranks of one
//! node as child processes, prefixes their output with the rank, and ends them all
//! when one fails.
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use crate::error::{DistError, Result};

/// What to start, as `torchrun`'s options.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// Processes on this node (`-n`, torchrun's `--nproc-per-node`).
    pub nproc_per_node: usize,
    /// Number of nodes (`--nnodes`); every node runs the launcher with the same value.
    pub nnodes: usize,
    /// This node's index in `0..nnodes` (`--node-rank`).
    pub node_rank: usize,
    /// The address of node 0, where rank 0 serves the rendezvous store (`--master-addr`).
    pub master_addr: String,
    /// The store's port (`--master-port`); `None`: a free port on this machine, which
    /// only works with one node.
    pub master_port: Option<u16>,
    /// Ends every rank and fails when they have not all finished by then (`None`: no limit).
    pub timeout: Option<Duration>,
    /// How long the other ranks get to exit after SIGTERM before SIGKILL.
    pub grace: Duration,
    /// More environment variables for every rank (the launcher's own environment is
    /// inherited too).
    pub env: Vec<(OsString, OsString)>,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        Self {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".to_owned(),
            master_port: None,
            timeout: None,
            grace: Duration::from_secs(5),
            env: Vec::new(),
        }
    }
}

/// A port nobody listens on now (the kernel's choice), for the rendezvous store.
///
/// Another program may take it before rank 0 binds it; the rendezvous then fails with
/// an error naming the port, and a second launch picks another.
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

enum Event {
    Exited {
        rank: usize,
        status: std::io::Result<ExitStatus>,
    },
}

/// Runs `program args...` as ranks `node_rank * nproc_per_node ..` of the group, each
/// with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
/// `MASTER_PORT` set, and their output (stdout and stderr) copied to this process's,
/// each line prefixed by `[rank R] `.
///
/// Returns when every rank has exited with status 0. When one fails (non-zero exit or
/// a signal), the others get SIGTERM, then SIGKILL after [`LaunchConfig::grace`], and
/// the error names the first rank that failed. Each rank runs in its own process
/// group, and that whole group is signalled, so processes a rank started do not
/// outlive it.
///
/// Trap: because each rank has its own process group, a Ctrl-C in the terminal reaches
/// only the launcher, and a launcher that is killed signals nobody: its ranks keep
/// running until they fail or finish. End them with `kill -- -PID` for each rank's PID.
pub fn launch(config: &LaunchConfig, program: &OsStr, args: &[OsString]) -> Result<()> {
    let local = config.nproc_per_node;
    let invalid = |reason: String| DistError::Config { rank: 0, reason };
    if local == 0 || config.nnodes == 0 || config.node_rank >= config.nnodes {
        return Err(invalid(format!(
            "launch: need at least one process per node and node rank < nnodes, got -n {local}, --nnodes {}, --node-rank {}",
            config.nnodes, config.node_rank
        )));
    }
    let port = match config.master_port {
        Some(p) => p,
        None if config.nnodes == 1 => {
            free_port().map_err(|e| invalid(format!("launch: no free port on 127.0.0.1: {e}")))?
        }
        None => {
            return Err(invalid(
                "launch: --master-port is required with more than one node".to_owned(),
            ))
        }
    };
    let world = local * config.nnodes;
    let first_rank = config.node_rank * local;
    let (tx, rx) = mpsc::channel();
    let mut pids: Vec<(usize, u32)> = Vec::new();
    let mut copiers = Vec::new();
    for local_rank in 0..local {
        let rank = first_rank + local_rank;
        let spawned = Command::new(program)
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", local.to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", port.to_string())
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(source) => {
                end_all(&pids, config.grace, &rx);
                return Err(DistError::Spawn {
                    rank,
                    program: program.to_string_lossy().into_owned(),
                    source,
                });
            }
        };
        pids.push((rank, child.id()));
        copiers.extend(watch(rank, child, tx.clone()));
    }
    drop(tx);
    let outcome = wait_all(config, &pids, &rx);
    // Whatever the outcome, no rank's process group outlives the launch; then every
    // pipe is closed and the copiers finish the output.
    if outcome.is_ok() {
        for &(_, pid) in &pids {
            signal_group(Some(pid), "KILL");
        }
    }
    for copier in copiers {
        let _ = copier.join();
    }
    outcome
}

fn wait_all(
    config: &LaunchConfig,
    pids: &[(usize, u32)],
    rx: &mpsc::Receiver<Event>,
) -> Result<()> {
    let deadline = config.timeout.map(|t| Instant::now() + t);
    let mut running: Vec<usize> = pids.iter().map(|&(rank, _)| rank).collect();
    while !running.is_empty() {
        let event = match deadline {
            Some(d) => match rx.recv_timeout(d.saturating_duration_since(Instant::now())) {
                Ok(e) => e,
                Err(_) => {
                    let still = running.clone();
                    end_all(pids, config.grace, rx);
                    return Err(DistError::LaunchTimeout {
                        running: still,
                        timeout: config.timeout.unwrap_or_default(),
                    });
                }
            },
            None => match rx.recv() {
                Ok(e) => e,
                Err(_) => break,
            },
        };
        let Event::Exited { rank, status } = event;
        running.retain(|&r| r != rank);
        let failure = match status {
            Ok(s) if s.success() => None,
            Ok(s) => Some(describe(s)),
            Err(e) => Some((format!("could not be waited for: {e}"), 1)),
        };
        if let Some((status, exit_code)) = failure {
            end_all(pids, config.grace, rx);
            return Err(DistError::RankFailed {
                rank,
                status,
                exit_code,
            });
        }
    }
    Ok(())
}

fn describe(status: ExitStatus) -> (String, i32) {
    match (status.code(), status.signal()) {
        (Some(code), _) => (format!("exit code {code}"), code),
        (None, Some(signal)) => (format!("killed by signal {signal}"), 128 + signal),
        (None, None) => (status.to_string(), 1),
    }
}

/// Starts copying the child's output with the rank prefix, and reports its exit as
/// soon as it happens (a process it started may keep the pipes open longer).
fn watch(rank: usize, mut child: Child, tx: mpsc::Sender<Event>) -> Vec<thread::JoinHandle<()>> {
    let out = child.stdout.take().map(|s| copy_prefixed(rank, s, false));
    let err = child.stderr.take().map(|s| copy_prefixed(rank, s, true));
    thread::spawn(move || {
        let status = child.wait();
        let _ = tx.send(Event::Exited { rank, status });
    });
    [out, err].into_iter().flatten().collect()
}

fn copy_prefixed(
    rank: usize,
    stream: impl Read + Send + 'static,
    to_stderr: bool,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        while matches!(reader.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            let mut prefixed = format!("[rank {rank}] ").into_bytes();
            prefixed.extend_from_slice(&line);
            let _ = if to_stderr {
                std::io::stderr().lock().write_all(&prefixed)
            } else {
                std::io::stdout().lock().write_all(&prefixed)
            };
            line.clear();
        }
    })
}

/// SIGTERM to every rank's process group, SIGKILL to those still running after
/// `grace`, then waits until every watcher has reported.
fn end_all(pids: &[(usize, u32)], grace: Duration, rx: &mpsc::Receiver<Event>) {
    for &(_, pid) in pids {
        signal_group(Some(pid), "TERM");
    }
    let deadline = Instant::now() + grace;
    let mut killed = false;
    loop {
        let wait = if killed {
            grace.max(Duration::from_secs(1))
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        match rx.recv_timeout(wait) {
            Ok(_) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
            Err(mpsc::RecvTimeoutError::Timeout) if !killed => {
                for &(_, pid) in pids {
                    signal_group(Some(pid), "KILL");
                }
                killed = true;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => return,
        }
    }
}

/// Signals the process group led by `pid` (each rank leads its own) with `kill(1)`;
/// a group that is already gone is not an error.
fn signal_group(pid: Option<u32>, signal: &str) {
    if let Some(pid) = pid {
        let _ = Command::new("kill")
            .arg("-s")
            .arg(signal)
            .arg("--")
            .arg(format!("-{pid}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}
