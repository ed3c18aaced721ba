//! The launcher (`memsave launch`, the `torchrun` of memsave): starts the ranks of one
//! node as child processes, prefixes their output with the rank, ends them all when one
//! fails, and passes SIGINT, SIGTERM and SIGHUP on to them.
//!
//! Each rank runs in a process group of its own, which the launcher signals as a whole
//! with `killpg(2)` (no external `kill` program), so processes a rank started end with
//! it. A process that leaves its rank's group (`setsid`, a daemon) is out of reach: the
//! launcher does not wait for it, but stops copying output [`OUTPUT_DRAIN`] after the
//! last rank exited, even if that process still holds the rank's stdout.
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use signal_hook::SigId;

use crate::error::{DistError, Result};

/// The most ranks one launcher starts (`-n`). One rank per core or accelerator of the
/// largest machines is far below it; a larger `-n` is a typo, and would run out of
/// processes, threads or open files part way (each rank is a process, a thread of the
/// launcher that waits for it, and two pipes).
pub const MAX_NPROC_PER_NODE: usize = 1024;

/// How long the launcher keeps copying output after the last rank exited. Output a rank
/// wrote before exiting is copied in full long before; this only bounds the wait when a
/// process the rank started outside its process group (`setsid ... &`) still holds the
/// rank's stdout or stderr: what it writes later is not copied.
pub const OUTPUT_DRAIN: Duration = Duration::from_secs(1);

/// The variable the launcher sets to 1 for every rank when a node runs several and the
/// user set no thread count (see [`launch()`]): libtorch's intra-op pool, OpenMP's,
/// reads it when it starts.
pub const RANK_THREADS_VAR: &str = "OMP_NUM_THREADS";

/// How often the launcher looks at signals and the timeout while it waits.
const TICK: Duration = Duration::from_millis(20);

/// How long the launcher waits for ranks to be reaped after SIGKILL before giving up on
/// them (a process stuck in the kernel, say on a dead network file system).
const KILL_WAIT: Duration = Duration::from_secs(5);

/// The signals the launcher passes on to the ranks.
const FORWARDED: [Signal; 3] = [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP];

/// Stack of the launcher's threads: each waits for one process or copies bytes; the
/// default (2 MiB) would cost gigabytes of address space at a thousand ranks.
const WAITER_STACK: usize = 64 * 1024;
const COPIER_STACK: usize = 256 * 1024;

/// A line longer than this is copied in pieces, each with the prefix.
const MAX_LINE: usize = 64 * 1024;

/// What to start, as `torchrun`'s options.
#[derive(Clone, Debug)]
pub struct LaunchConfig {
    /// Processes on this node (`-n`, torchrun's `--nproc-per-node`): at least 1, at
    /// most [`MAX_NPROC_PER_NODE`], and no more than this process's limits on open
    /// files (two a rank) and, for a user other than root, on processes allow.
    pub nproc_per_node: usize,
    /// Number of nodes (`--nnodes`); every node runs the launcher with the same value.
    pub nnodes: usize,
    /// This node's index in `0..nnodes` (`--node-rank`).
    pub node_rank: usize,
    /// The address of node 0, where rank 0 serves the rendezvous store (`--master-addr`).
    pub master_addr: String,
    /// The store's port (`--master-port`); `None` or `Some(0)`: a free port on this
    /// machine (as torchrun does for 0), which only works with one node.
    pub master_port: Option<u16>,
    /// Ends every rank and fails when they have not all finished by then (`None`: no
    /// limit). Zero is refused: it would end the ranks as soon as they start.
    pub timeout: Option<Duration>,
    /// How long the ranks get to exit after SIGTERM (or the signal passed on) before
    /// SIGKILL.
    pub grace: Duration,
    /// More environment variables for every rank (the launcher's own environment is
    /// inherited too).
    pub env: Vec<(OsString, OsString)>,
    /// Whether SIGINT, SIGTERM and SIGHUP to this process, while [`launch()`] runs, are
    /// passed on to every rank (default: yes). See [`launch()`] for what this installs;
    /// turn it off in a program that handles these signals itself.
    pub forward_signals: bool,
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
            forward_signals: true,
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

/// Runs `program args...` as ranks `node_rank * nproc_per_node ..` of the group, each
/// with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and
/// `MASTER_PORT` set, and their output (stdout and stderr) copied to this process's,
/// each line prefixed by `[rank R] `.
///
/// Returns when every rank has exited with status 0. When one fails (non-zero exit or
/// a signal), the others get SIGTERM, then SIGKILL after [`LaunchConfig::grace`], and
/// the error ([`DistError::RankFailed`]) names the first rank that failed. Each rank
/// runs in its own process group, and that whole group is signalled, so processes a
/// rank started do not outlive it.
///
/// Signals: because each rank has its own process group, a Ctrl-C in the terminal
/// reaches only the launcher. With [`LaunchConfig::forward_signals`] (the default),
/// SIGINT, SIGTERM or SIGHUP to this process during the launch is sent on to every
/// rank's group; after the grace period (or at once, on a second signal) the rest get
/// SIGKILL, and the launch fails with [`DistError::Interrupted`], whose caller should
/// exit with 128 + the signal, as `memsave launch` does. To do this, the first launch
/// installs handlers for these three signals (through `signal-hook`) that stay for the
/// life of the process; outside a launch they end the process as the default action
/// would. SIGINT and SIGTERM are caught during a launch even when this process
/// ignored them at the start (a shell's background job starts with SIGINT ignored), as
/// `torchrun` does: they stay ignored outside a launch. SIGHUP ignored at the first
/// launch (`nohup`) stays ignored and is not passed on.
/// SIGKILL to the launcher cannot be caught: its ranks then run on until they fail or
/// finish (end them with `kill -- -PID` for each rank's PID).
///
/// Threads: as `torchrun` does, when this node runs more than one rank and neither
/// this process's environment nor [`LaunchConfig::env`] sets `OMP_NUM_THREADS`, every
/// rank gets `OMP_NUM_THREADS=1` ([`RANK_THREADS_VAR`]), and the launcher says so in
/// one line on stderr. Otherwise each rank's libtorch starts one intra-op thread per
/// core, and N ranks on one machine run N times as many threads as it has cores, which
/// wait on each other. Set `OMP_NUM_THREADS` (or call
/// `tch::set_num_threads` in the rank) to choose another count.
///
/// Nothing is started when the configuration cannot work
/// ([`DistError::InvalidLaunch`], naming the option). When a rank, or a thread of the
/// launcher, cannot be started, the ranks already started are ended as for a failure.
pub fn launch(config: &LaunchConfig, program: &OsStr, args: &[OsString]) -> Result<()> {
    let plan = check(config)?;
    let signals = Signals::watch(config.forward_signals)?;
    let (pipe_tx, pipe_rx) = mpsc::channel();
    let ranks_gone = Arc::new(AtomicBool::new(false));
    let copier = {
        let ranks_gone = Arc::clone(&ranks_gone);
        thread::Builder::new()
            .name("memsave-launch-output".to_owned())
            .stack_size(COPIER_STACK)
            .spawn(move || copy_output(&pipe_rx, &ranks_gone))
            .map_err(|source| DistError::LaunchResource {
                what: "could not start the thread that copies the ranks' output".to_owned(),
                source,
            })?
    };
    let mut ranks = Ranks::new(config.nproc_per_node, config.grace);
    let one_thread = rank_threads_unset(config);
    if one_thread {
        eprintln!(
            "memsave launch: {RANK_THREADS_VAR}=1 for each of the {} ranks on this node \
             (set {RANK_THREADS_VAR} to choose)",
            config.nproc_per_node
        );
    }
    let started = start_ranks(
        config, &plan, one_thread, program, args, &mut ranks, &pipe_tx, &signals,
    );
    drop(pipe_tx);
    let outcome = started.and_then(|()| supervise(config, &mut ranks, &signals));
    // Whatever the outcome, no rank's process group outlives the launch; then the copier
    // finishes the output, waiting at most OUTPUT_DRAIN for pipes held by processes that
    // left their rank's group.
    ranks.signal_all(Signal::SIGKILL);
    // From here on a signal does what it does outside a launch: no rank is left to pass
    // it on to.
    drop(signals);
    ranks_gone.store(true, Ordering::SeqCst);
    let _ = copier.join();
    outcome
}

/// Whether the ranks get [`RANK_THREADS_VAR`]` = 1`: several ranks on this node, and no
/// thread count from the user, in this process's environment or the launch's.
fn rank_threads_unset(config: &LaunchConfig) -> bool {
    config.nproc_per_node > 1
        && std::env::var_os(RANK_THREADS_VAR).is_none()
        && !config.env.iter().any(|(k, _)| k == RANK_THREADS_VAR)
}

/// What [`check`] worked out.
struct Plan {
    port: u16,
    world: usize,
    first_rank: usize,
}

/// Refuses a configuration that cannot work, before anything starts.
fn check(config: &LaunchConfig) -> Result<Plan> {
    let invalid = |reason: String| DistError::InvalidLaunch { reason };
    let local = config.nproc_per_node;
    if local == 0 {
        return Err(invalid(
            "-n 0: need at least one process per node".to_owned(),
        ));
    }
    if config.nnodes == 0 {
        return Err(invalid("--nnodes 0: need at least one node".to_owned()));
    }
    if config.node_rank >= config.nnodes {
        return Err(invalid(format!(
            "--node-rank {} is not below --nnodes {} (node ranks count from 0)",
            config.node_rank, config.nnodes
        )));
    }
    if local > MAX_NPROC_PER_NODE {
        return Err(invalid(format!(
            "-n {local}: more ranks than one launcher starts (at most {MAX_NPROC_PER_NODE} per node)"
        )));
    }
    check_limits(local)?;
    if config.timeout == Some(Duration::ZERO) {
        return Err(invalid(
            "--timeout 0 would end the ranks as they start: give at least 1 second, or no timeout"
                .to_owned(),
        ));
    }
    let world = local.checked_mul(config.nnodes).ok_or_else(|| {
        invalid(format!(
            "-n {local} times --nnodes {} ranks is more than this machine can count",
            config.nnodes
        ))
    })?;
    let port = match config.master_port {
        Some(p) if p != 0 => p,
        _ if config.nnodes == 1 => free_port()
            .map_err(|e| invalid(format!("no free port on 127.0.0.1 for the store: {e}")))?,
        _ => {
            return Err(invalid(
                "--master-port is required with more than one node, and cannot be 0: every node must name the same port"
                    .to_owned(),
            ))
        }
    };
    Ok(Plan {
        port,
        world,
        first_rank: config.node_rank * local,
    })
}

/// Refuses more ranks than this process's limits let it start: two open files a rank
/// (the read ends of its stdout and stderr) plus stdio, and, unless root (whom the
/// kernel does not hold to it), a process and a thread a rank under the process limit.
/// These are lower bounds: files or processes already in use can still run out part
/// way, which then ends the ranks started.
fn check_limits(local: usize) -> Result<()> {
    let invalid = |reason: String| DistError::InvalidLaunch { reason };
    if let Ok((files, _)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let needed = 2 * local as u64 + 3;
        if files != RLIM_INFINITY && needed > files {
            return Err(invalid(format!(
                "-n {local}: needs {needed} open files (two pipes a rank), over this process's limit of {files}; raise it (ulimit -n) or start fewer ranks"
            )));
        }
    }
    if !nix::unistd::geteuid().is_root() {
        if let Ok((procs, _)) = getrlimit(Resource::RLIMIT_NPROC) {
            let needed = 2 * local as u64 + 1;
            if procs != RLIM_INFINITY && needed > procs {
                return Err(invalid(format!(
                    "-n {local}: needs {needed} processes and threads (a rank and the thread that waits for it), over this user's limit of {procs}; raise it (ulimit -u) or start fewer ranks"
                )));
            }
        }
    }
    Ok(())
}

/// Starts every rank, each with a thread that waits for it; on a failure (or a signal)
/// ends those started.
#[allow(clippy::too_many_arguments)]
fn start_ranks(
    config: &LaunchConfig,
    plan: &Plan,
    one_thread: bool,
    program: &OsStr,
    args: &[OsString],
    ranks: &mut Ranks,
    pipes: &mpsc::Sender<Pipe>,
    signals: &Signals,
) -> Result<()> {
    for local_rank in 0..config.nproc_per_node {
        if let Some(signal) = signals.take() {
            return Err(ranks.interrupt(signal, signals));
        }
        let rank = plan.first_rank + local_rank;
        // The waiter first, so that a process is never started without a thread to reap
        // it: a thread that cannot start only stops the launch.
        let (child_tx, child_rx) = mpsc::channel::<Child>();
        let events = ranks.events_tx.clone();
        let waiter = thread::Builder::new()
            .name(format!("memsave-launch-rank{rank}"))
            .stack_size(WAITER_STACK)
            .spawn(move || {
                if let Ok(mut child) = child_rx.recv() {
                    let status = child.wait();
                    let _ = events.send(Exited { rank, status });
                }
            });
        if let Err(source) = waiter {
            ranks.end(Signal::SIGTERM, signals);
            return Err(DistError::LaunchResource {
                what: format!("could not start the thread that waits for rank {rank}"),
                source,
            });
        }
        let mut command = Command::new(program);
        if one_thread {
            command.env(RANK_THREADS_VAR, "1");
        }
        let spawned = command
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("WORLD_SIZE", plan.world.to_string())
            .env("LOCAL_WORLD_SIZE", config.nproc_per_node.to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", plan.port.to_string())
            .envs(config.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(source) => {
                // Dropping child_tx lets the waiter end.
                ranks.end(Signal::SIGTERM, signals);
                return Err(DistError::Spawn {
                    rank,
                    program: program.to_string_lossy().into_owned(),
                    source,
                });
            }
        };
        ranks.started(rank, child.id());
        for (stream, to_stderr) in [
            (child.stdout.take().map(OwnedFd::from), false),
            (child.stderr.take().map(OwnedFd::from), true),
        ] {
            if let Some(fd) = stream {
                let _ = pipes.send(Pipe::new(rank, to_stderr, fd));
            }
        }
        // The waiter is running and holds child_rx, so this cannot fail.
        let _ = child_tx.send(child);
    }
    Ok(())
}

/// Waits for the ranks: all exit 0, one fails, a signal comes, or the timeout passes.
fn supervise(config: &LaunchConfig, ranks: &mut Ranks, signals: &Signals) -> Result<()> {
    let deadline = config.timeout.map(|t| Instant::now() + t);
    loop {
        if let Some(signal) = signals.take() {
            return Err(ranks.interrupt(signal, signals));
        }
        if ranks.running() == 0 {
            return Ok(());
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            let running = ranks.running_ranks();
            ranks.end(Signal::SIGTERM, signals);
            return Err(DistError::LaunchTimeout {
                running,
                timeout: config.timeout.unwrap_or_default(),
            });
        }
        let wait = deadline.map_or(TICK, |d| {
            TICK.min(d.saturating_duration_since(Instant::now()))
        });
        // One exit at a time, in the order the waiters saw them, so that the first
        // failure is the one named.
        let Ok(event) = ranks.events_rx.recv_timeout(wait) else {
            continue;
        };
        if let Some(failure) = ranks.exited(event) {
            if let Some(signal) = signals.take() {
                return Err(ranks.interrupt(signal, signals));
            }
            ranks.end(Signal::SIGTERM, signals);
            return Err(failure);
        }
    }
}

/// A rank's process has exited (or could not be waited for).
struct Exited {
    rank: usize,
    status: std::io::Result<ExitStatus>,
}

/// The ranks started so far: their process groups, and the exits their waiters report.
struct Ranks {
    /// (rank, process id = process group id, exited) in the order started.
    started: Vec<(usize, u32, bool)>,
    events_tx: mpsc::Sender<Exited>,
    events_rx: mpsc::Receiver<Exited>,
    grace: Duration,
}

impl Ranks {
    fn new(capacity: usize, grace: Duration) -> Ranks {
        let (events_tx, events_rx) = mpsc::channel();
        Ranks {
            started: Vec::with_capacity(capacity),
            events_tx,
            events_rx,
            grace,
        }
    }

    fn started(&mut self, rank: usize, pid: u32) {
        self.started.push((rank, pid, false));
    }

    fn running(&self) -> usize {
        self.started.iter().filter(|r| !r.2).count()
    }

    fn running_ranks(&self) -> Vec<usize> {
        self.started.iter().filter(|r| !r.2).map(|r| r.0).collect()
    }

    /// Records an exit; the failure it is, if any.
    fn exited(&mut self, event: Exited) -> Option<DistError> {
        if let Some(entry) = self.started.iter_mut().find(|r| r.0 == event.rank) {
            entry.2 = true;
        }
        let (status, exit_code) = match event.status {
            Ok(s) if s.success() => return None,
            Ok(s) => describe(s),
            Err(e) => (format!("could not be waited for: {e}"), 1),
        };
        Some(DistError::RankFailed {
            rank: event.rank,
            status,
            exit_code,
        })
    }

    /// Sends `signal` to every rank's process group, those of ranks that exited too
    /// (processes they started may remain). A group that is gone is not an error.
    fn signal_all(&self, signal: Signal) {
        for &(_, pid, _) in &self.started {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = killpg(Pid::from_raw(pid), signal);
            }
        }
    }

    /// `first` to every rank's group, SIGKILL to all after the grace period (at once on
    /// a signal to the launcher meanwhile), then waits a bounded time for the exits.
    fn end(&mut self, first: Signal, signals: &Signals) {
        self.signal_all(first);
        let deadline = Instant::now() + self.grace;
        while self.running() > 0 && Instant::now() < deadline && signals.take().is_none() {
            self.wait_one(deadline);
        }
        self.signal_all(Signal::SIGKILL);
        let deadline = Instant::now() + KILL_WAIT;
        while self.running() > 0 && Instant::now() < deadline {
            self.wait_one(deadline);
        }
    }

    /// Sends the signal the launcher received on to the ranks and ends them.
    fn interrupt(&mut self, signal: Signal, signals: &Signals) -> DistError {
        self.end(signal, signals);
        DistError::Interrupted {
            signal: signal as i32,
            name: signal.as_str(),
        }
    }

    fn wait_one(&mut self, deadline: Instant) {
        let wait = TICK.min(deadline.saturating_duration_since(Instant::now()));
        if let Ok(event) = self.events_rx.recv_timeout(wait) {
            let _ = self.exited(event);
        }
    }
}

fn describe(status: ExitStatus) -> (String, i32) {
    match (status.code(), status.signal()) {
        (Some(code), _) => (format!("exit code {code}"), code),
        (None, Some(signal)) => (format!("killed by signal {signal}"), 128 + signal),
        (None, None) => (status.to_string(), 1),
    }
}

/// The signals this process received during one launch, through handlers installed once
/// per process.
struct Signals {
    /// The last signal received and not yet taken, 0 for none.
    received: Arc<AtomicUsize>,
    ids: Vec<SigId>,
    counted: bool,
}

/// True while no launch runs: the handlers then do what the default action does.
static IDLE: AtomicBool = AtomicBool::new(true);
/// Launches running now (threads may run several).
static ACTIVE: Mutex<usize> = Mutex::new(0);
/// The signals with a handler: FORWARDED, less SIGHUP when ignored at the first launch.
static WATCHED: OnceLock<Vec<Signal>> = OnceLock::new();

impl Signals {
    fn watch(enabled: bool) -> Result<Signals> {
        let mut signals = Signals {
            received: Arc::new(AtomicUsize::new(0)),
            ids: Vec::new(),
            counted: false,
        };
        if !enabled {
            return Ok(signals);
        }
        let watched = WATCHED.get_or_init(|| {
            let ignored = ignored_signals();
            FORWARDED
                .into_iter()
                .filter(|&s| {
                    if ignored & (1u64 << (s as i32 - 1)) == 0 {
                        signal_hook::flag::register_conditional_default(s as i32, &IDLE).is_ok()
                    } else {
                        // Ignored outside a launch, as before: signal-hook's handler with
                        // no action does nothing. SIGHUP stays ignored altogether (nohup).
                        s != Signal::SIGHUP
                    }
                })
                .collect()
        });
        for &signal in watched {
            let id = signal_hook::flag::register_usize(
                signal as i32,
                Arc::clone(&signals.received),
                signal as usize,
            )
            .map_err(|source| DistError::LaunchResource {
                what: format!("could not install a handler for {signal}"),
                source,
            })?;
            signals.ids.push(id);
        }
        let mut active = ACTIVE.lock().unwrap_or_else(|e| e.into_inner());
        *active += 1;
        IDLE.store(false, Ordering::SeqCst);
        signals.counted = true;
        Ok(signals)
    }

    /// The signal received since the last call, if any.
    fn take(&self) -> Option<Signal> {
        match self.received.swap(0, Ordering::SeqCst) {
            0 => None,
            s => Signal::try_from(s as i32).ok(),
        }
    }
}

impl Drop for Signals {
    fn drop(&mut self) {
        // Default action back on before this launch's handler goes, so that no signal
        // falls between the two.
        if self.counted {
            let mut active = ACTIVE.lock().unwrap_or_else(|e| e.into_inner());
            *active -= 1;
            if *active == 0 {
                IDLE.store(true, Ordering::SeqCst);
            }
        }
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// The signals this process ignores (bit `s - 1` for signal `s`), from /proc; none
/// where that cannot be read.
fn ignored_signals() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("SigIgn:"))?;
            u64::from_str_radix(line["SigIgn:".len()..].trim(), 16).ok()
        })
        .unwrap_or(0)
}

/// One rank's stdout or stderr, read by the copier.
struct Pipe {
    rank: usize,
    to_stderr: bool,
    file: File,
    /// Bytes after the last newline, held until the line ends.
    partial: Vec<u8>,
    open: bool,
}

impl Pipe {
    fn new(rank: usize, to_stderr: bool, fd: OwnedFd) -> Pipe {
        Pipe {
            rank,
            to_stderr,
            file: File::from(fd),
            partial: Vec::new(),
            open: true,
        }
    }

    /// Reads what is there (the pipe is readable) and copies the complete lines.
    fn read_some(&mut self, chunk: &mut [u8]) {
        match self.file.read(chunk) {
            Ok(0) => self.close(),
            Ok(n) => {
                self.partial.extend_from_slice(&chunk[..n]);
                let end = match self.partial.iter().rposition(|&b| b == b'\n') {
                    Some(i) => i + 1,
                    None if self.partial.len() >= MAX_LINE => self.partial.len(),
                    None => return,
                };
                let lines: Vec<u8> = self.partial.drain(..end).collect();
                self.emit(&lines);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => self.close(),
        }
    }

    /// Copies what is held, ending it with a newline, and stops reading.
    fn close(&mut self) {
        let rest = std::mem::take(&mut self.partial);
        self.emit(&rest);
        self.open = false;
    }

    fn emit(&self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let prefix = format!("[rank {}] ", self.rank);
        let mut out = Vec::with_capacity(bytes.len() + prefix.len() * 4);
        for line in bytes.split_inclusive(|&b| b == b'\n') {
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(line);
            if !line.ends_with(b"\n") {
                out.push(b'\n');
            }
        }
        // A closed stdout (`memsave launch ... | head`) is not the ranks' failure.
        let _ = if self.to_stderr {
            std::io::stderr().lock().write_all(&out)
        } else {
            std::io::stdout().lock().write_all(&out)
        };
    }
}

/// Copies the ranks' output, prefixed, until every pipe is closed and no more will
/// come, or until OUTPUT_DRAIN after `ranks_gone`.
fn copy_output(new_pipes: &mpsc::Receiver<Pipe>, ranks_gone: &AtomicBool) {
    let mut pipes: Vec<Pipe> = Vec::new();
    let mut more_coming = true;
    let mut chunk = vec![0u8; MAX_LINE];
    let mut until: Option<Instant> = None;
    loop {
        while more_coming {
            match new_pipes.try_recv() {
                Ok(pipe) => pipes.push(pipe),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => more_coming = false,
            }
        }
        if pipes.is_empty() {
            if !more_coming {
                return;
            }
            // Nothing to read yet: wait for the first rank's pipes (or the end of the
            // starting) rather than polling nothing.
            match new_pipes.recv() {
                Ok(pipe) => pipes.push(pipe),
                Err(_) => more_coming = false,
            }
            continue;
        }
        if until.is_none() && ranks_gone.load(Ordering::SeqCst) {
            until = Some(Instant::now() + OUTPUT_DRAIN);
        }
        if until.is_some_and(|u| Instant::now() >= u) {
            break;
        }
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd> = pipes
                .iter()
                .map(|p| PollFd::new(p.file.as_fd(), PollFlags::POLLIN))
                .collect();
            match poll(&mut fds, PollTimeout::from(50u16)) {
                Ok(_) => fds.iter().map(|f| f.any().unwrap_or(true)).collect(),
                Err(Errno::EINTR) => continue,
                Err(_) => break,
            }
        };
        for (pipe, ready) in pipes.iter_mut().zip(ready) {
            if ready {
                pipe.read_some(&mut chunk);
            }
        }
        pipes.retain(|p| p.open);
    }
    for pipe in &mut pipes {
        pipe.close();
    }
}
