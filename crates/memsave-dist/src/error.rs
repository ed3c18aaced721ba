//! The errors of distributed training: each names the rank that saw it and the cause.
use std::time::Duration;

/// What went wrong, on which rank.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// An environment variable the launcher sets is missing or malformed.
    #[error("environment variable {var}: {reason} (start the process with `memsave launch`, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")]
    Env {
        /// The variable.
        var: &'static str,
        /// Why it cannot be used.
        reason: String,
    },
    /// A configuration that cannot work, refused before any communication.
    #[error("rank {rank}: {reason}")]
    Config {
        /// The rank that refused it.
        rank: usize,
        /// What is wrong and what to do.
        reason: String,
    },
    /// The rendezvous store or the process group could not be set up, or a collective
    /// failed or timed out (libtorch's message, starting with the rank).
    #[error("{0}")]
    Collective(#[from] memsave_sys::Error),
    /// Ranks disagree about something that must be the same everywhere.
    #[error("rank {rank}: {what} differ from rank {other}'s: {detail}")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The first rank found to differ.
        other: usize,
        /// What differs ("parameter shapes").
        what: &'static str,
        /// The two sides.
        detail: String,
    },
    /// A tensor operation failed.
    #[error("rank {rank}: {context}: {source}")]
    Tensor {
        /// This rank.
        rank: usize,
        /// What was being done.
        context: &'static str,
        /// libtorch's error.
        source: tch::TchError,
    },
    /// A parameter shard file of an [`crate::Fsdp`] with shards in files could not be
    /// written or read, or was changed, truncated or removed after it was written.
    #[error("rank {rank}: parameter shard file {}: {reason}", path.display())]
    ShardFile {
        /// This rank.
        rank: usize,
        /// The file (or its directory).
        path: std::path::PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The sharded optimizer failed.
    #[error("rank {rank}: optimizer: {source}")]
    Optim {
        /// This rank.
        rank: usize,
        /// The optimizer's error.
        source: memsave_optim::OptimError,
    },
    /// A launched rank failed; the launcher ended the others.
    #[error("rank {rank} failed ({status}); ended the other ranks")]
    RankFailed {
        /// The first rank that failed.
        rank: usize,
        /// How it ended ("exit code 3", "killed by signal 9").
        status: String,
        /// The exit code the launcher should end with.
        exit_code: i32,
    },
    /// The launched ranks did not all finish within the timeout; the launcher ended them.
    #[error("ranks {running:?} still running after {timeout:?}; ended them")]
    LaunchTimeout {
        /// Ranks that were still running.
        running: Vec<usize>,
        /// The timeout.
        timeout: Duration,
    },
    /// A launch refused before anything started: options that cannot work together,
    /// or more ranks than this machine lets the launcher start. The message names the
    /// option (as `memsave launch` spells it) and no rank: nothing ran.
    #[error("{reason}")]
    InvalidLaunch {
        /// What is wrong and what to do.
        reason: String,
    },
    /// The launcher got SIGINT, SIGTERM or SIGHUP: it sent the signal on to every rank
    /// and ended them. Exit with 128 + `signal`, as shells do.
    #[error("interrupted by {name}; sent it on to every rank and ended them")]
    Interrupted {
        /// The signal's number.
        signal: i32,
        /// Its name ("SIGTERM").
        name: &'static str,
    },
    /// The launcher could not start something of its own (a thread) or install its
    /// signal handlers; it ended the ranks it had started.
    #[error("launch: {what}: {source}; ended the ranks already started")]
    LaunchResource {
        /// What could not be done.
        what: String,
        /// The operating system's error.
        source: std::io::Error,
    },
    /// A rank could not be started; the launcher ended the ranks it had started.
    #[error("rank {rank}: could not start {program}: {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The command.
        program: String,
        /// The operating system's error.
        source: std::io::Error,
    },
}

/// The result of a distributed operation.
pub type Result<T, E = DistError> = std::result::Result<T, E>;
