//! Process groups: how the ranks find each other (rendezvous) and the collectives.
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use memsave_sys::dist::{GlooGroup, Store};
use memsave_sys::tensor::nbytes;
use tch::{Device, Tensor};

use crate::error::{DistError, Result};

/// The communication library of a group, as PyTorch's `backend=` argument.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// Gloo over TCP, for CPU tensors (the only one built here).
    #[default]
    Gloo,
    /// NCCL, for CUDA tensors: not compiled into memsave's bridge; asking for it is an error.
    Nccl,
}

/// Options of [`init_process_group`] and the explicit constructors.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// The backend (default Gloo).
    pub backend: Backend,
    /// How long to wait for the other ranks to join, and for each collective
    /// (default 5 minutes; PyTorch's is 30). A rank that dies leaves the others
    /// waiting at most this long, unless their connection to it closes first.
    pub timeout: Duration,
    /// The address this rank's transport binds to and the others connect to. `None`:
    /// 127.0.0.1 when the master address is a loopback one, else the `GLOO_HOSTNAME`
    /// environment variable, else this machine's host name.
    pub hostname: Option<String>,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            backend: Backend::Gloo,
            timeout: Duration::from_secs(300),
            hostname: None,
        }
    }
}

/// One rank's handle on a group of processes that run collectives together (PyTorch's
/// `ProcessGroup`). Cheap to clone; the group is left when the last clone is dropped.
///
/// Collectives are blocking: each returns when this rank's part is done, or with an
/// error naming the rank after the group's timeout. Every rank must call the same
/// collectives in the same order with tensors of the same shape and kind, or the
/// group waits until the timeout. Tensors must be contiguous and on the CPU.
#[derive(Clone, Debug)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    // Dropped before the store it rendezvoused through.
    gloo: GlooGroup,
    _store: Store,
    bytes_sent: AtomicU64,
}

/// Joins the group described by the environment, as PyTorch's
/// `torch.distributed.init_process_group` with `init_method="env://"`: `RANK`,
/// `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`, which `memsave launch` sets. Rank 0
/// serves the rendezvous store at `MASTER_ADDR:MASTER_PORT`.
pub fn init_process_group(options: &InitOptions) -> Result<ProcessGroup> {
    let rank = env_usize("RANK")?;
    let world_size = env_usize("WORLD_SIZE")?;
    let addr = env_var("MASTER_ADDR")?;
    let port = env_var("MASTER_PORT")?
        .parse::<u16>()
        .map_err(|e| DistError::Env {
            var: "MASTER_PORT",
            reason: format!("not a port number: {e}"),
        })?;
    ProcessGroup::new_tcp(&addr, port, rank, world_size, options)
}

fn env_var(var: &'static str) -> Result<String> {
    std::env::var(var).map_err(|e| DistError::Env {
        var,
        reason: e.to_string(),
    })
}

fn env_usize(var: &'static str) -> Result<usize> {
    env_var(var)?.parse().map_err(|e| DistError::Env {
        var,
        reason: format!("not a non-negative integer: {e}"),
    })
}

fn is_loopback(addr: &str) -> bool {
    addr == "localhost" || addr.starts_with("127.") || addr == "::1"
}

fn with_rank(rank: usize, what: String, e: memsave_sys::Error) -> DistError {
    DistError::Collective(memsave_sys::Error::new(format!(
        "rank {rank}: {what}: {}",
        e.message()
    )))
}

impl ProcessGroup {
    /// Joins a group whose rendezvous is a TCP store at `master_addr:master_port`,
    /// served by rank 0 (PyTorch's `init_method="tcp://addr:port"`).
    pub fn new_tcp(
        master_addr: &str,
        master_port: u16,
        rank: usize,
        world_size: usize,
        options: &InitOptions,
    ) -> Result<Self> {
        check_options(rank, world_size, options)?;
        let store = Store::tcp(
            master_addr,
            master_port,
            rank == 0,
            world_size,
            options.timeout,
        )
        .map_err(|e| {
            with_rank(
                rank,
                format!("rendezvous store at {master_addr}:{master_port}"),
                e,
            )
        })?;
        let hostname = match &options.hostname {
            Some(h) => h.clone(),
            None if is_loopback(master_addr) => "127.0.0.1".to_owned(),
            None => default_hostname(),
        };
        Self::join(store, rank, world_size, &hostname, options)
    }

    /// Joins a group whose rendezvous is a file every rank can see (PyTorch's
    /// `init_method="file://path"`). Delete the file before starting a new group: a
    /// stale one holds the keys of the previous run.
    pub fn new_file(
        path: &Path,
        rank: usize,
        world_size: usize,
        options: &InitOptions,
    ) -> Result<Self> {
        check_options(rank, world_size, options)?;
        let store = Store::file(path, world_size, options.timeout)
            .map_err(|e| with_rank(rank, format!("rendezvous file {}", path.display()), e))?;
        let hostname = options
            .hostname
            .clone()
            .unwrap_or_else(|| "127.0.0.1".to_owned());
        Self::join(store, rank, world_size, &hostname, options)
    }

    fn join(
        store: Store,
        rank: usize,
        world_size: usize,
        hostname: &str,
        options: &InitOptions,
    ) -> Result<Self> {
        let gloo = GlooGroup::new(&store, rank, world_size, hostname, options.timeout)?;
        Ok(Self {
            inner: Arc::new(Inner {
                gloo,
                _store: store,
                bytes_sent: AtomicU64::new(0),
            }),
        })
    }

    /// This process's rank, in `0..world_size()`.
    pub fn rank(&self) -> usize {
        self.inner.gloo.rank()
    }

    /// Number of processes in the group.
    pub fn world_size(&self) -> usize {
        self.inner.gloo.size()
    }

    /// Bytes this rank has sent so far, as the collectives' algorithms send them
    /// (ring all-reduce, reduce-scatter and all-gather, one-to-all broadcast): counted
    /// from the tensors' sizes, not read from the network, so transport headers and
    /// retransmissions are not included.
    pub fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent.load(Ordering::Relaxed)
    }

    fn count(&self, bytes: u64) {
        self.inner.bytes_sent.fetch_add(bytes, Ordering::Relaxed);
    }

    fn check_tensor(&self, t: &Tensor, what: &'static str) -> Result<()> {
        let reason = if t.device() != Device::Cpu {
            Some(format!(
                "{what} is on {:?}; the Gloo backend takes CPU tensors",
                t.device()
            ))
        } else if !t.is_contiguous() {
            Some(format!("{what} is not contiguous"))
        } else {
            None
        };
        reason.map_or(Ok(()), |reason| {
            Err(DistError::Config {
                rank: self.rank(),
                reason,
            })
        })
    }

    /// Sums `t` over all ranks, in place (`all_reduce` with `ReduceOp.SUM`). A ring
    /// all-reduce sends `2 (N-1) / N` of the tensor's bytes per rank.
    ///
    /// The sum's order is fixed by the world size, so results are the same from run
    /// to run, but not bit-identical to a sum in another order (one process).
    pub fn all_reduce(&self, t: &Tensor) -> Result<()> {
        self.check_tensor(t, "the tensor")?;
        self.inner.gloo.all_reduce_sum(t)?;
        let n = self.world_size() as u64;
        self.count(nbytes(t) * 2 * (n - 1) / n);
        Ok(())
    }

    /// Sums `input` (world size × `output.numel()` values) over the ranks and writes
    /// this rank's slice of the sum into `output` (`reduce_scatter_tensor` with SUM).
    /// Sends `(N-1) / N` of the input's bytes per rank.
    pub fn reduce_scatter(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.check_tensor(output, "the output")?;
        self.check_tensor(input, "the input")?;
        self.inner.gloo.reduce_scatter_sum(output, input)?;
        let n = self.world_size() as u64;
        self.count(nbytes(input) * (n - 1) / n);
        Ok(())
    }

    /// Writes every rank's `input` into `output` (world size × `input.numel()` values,
    /// rank order; `all_gather_into_tensor`). Sends `N-1` times the input's bytes per rank.
    pub fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        self.check_tensor(output, "the output")?;
        self.check_tensor(input, "the input")?;
        self.inner.gloo.all_gather(output, input)?;
        self.count(nbytes(input) * (self.world_size() as u64 - 1));
        Ok(())
    }

    /// Starts [`ProcessGroup::all_gather`] without waiting (PyTorch's `all_gather_into_tensor`
    /// with `async_op=True`): the collective runs on the group's worker thread, after
    /// the collectives issued before it and before those issued after it, while this
    /// thread goes on. [`Work::wait`] waits for it; its bytes are counted in
    /// [`ProcessGroup::bytes_sent`] when it is done (as the blocking one's).
    ///
    /// Traps: do not read `output` or change `input` before the wait returns (the work
    /// holds its own references to both, so dropping them early is safe). Dropping the
    /// `Work` unwaited waits for it (a collective never runs on memory given back).
    pub fn all_gather_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        self.check_tensor(output, "the output")?;
        self.check_tensor(input, "the input")?;
        let work = self.inner.gloo.all_gather_start(output, input)?;
        Ok(Work {
            work: Some(work),
            group: self.clone(),
            bytes: nbytes(input) * (self.world_size() as u64 - 1),
        })
    }

    /// Sends `input_splits[r]` values of `input` (taken in rank order) to rank `r` and
    /// receives `output_splits[r]` values from rank `r` into `output` (in rank order):
    /// PyTorch's `all_to_all_single` with split sizes (Gloo's alltoallv). Each slice
    /// has one entry per rank; `input`'s split sizes on rank `s` must equal the output
    /// split sizes the receivers give for `s`. Sends the values addressed to the other
    /// ranks (its own slice is copied locally).
    pub fn all_to_all_single(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[i64],
        input_splits: &[i64],
    ) -> Result<()> {
        self.check_tensor(output, "the output")?;
        self.check_tensor(input, "the input")?;
        let n = self.world_size();
        if output_splits.len() != n || input_splits.len() != n {
            return Err(DistError::Config {
                rank: self.rank(),
                reason: format!(
                    "all_to_all_single: {} output and {} input split sizes; expected one per rank ({n})",
                    output_splits.len(),
                    input_splits.len()
                ),
            });
        }
        self.inner
            .gloo
            .all_to_all(output, input, output_splits, input_splits)?;
        let elt = input.kind().elt_size_in_bytes() as u64;
        let sent: i64 = input_splits
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != self.rank())
            .map(|(_, &k)| k)
            .sum();
        self.count(sent.max(0) as u64 * elt);
        Ok(())
    }

    /// Copies rank `src`'s `t` into `t` on every rank. The source sends `N-1` copies.
    pub fn broadcast(&self, t: &Tensor, src: usize) -> Result<()> {
        self.check_tensor(t, "the tensor")?;
        self.inner.gloo.broadcast(t, src)?;
        if self.rank() == src {
            self.count(nbytes(t) * (self.world_size() as u64 - 1));
        }
        Ok(())
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        Ok(self.inner.gloo.barrier()?)
    }
}

/// A collective started by [`ProcessGroup::all_gather_async`] (c10d's `Work`).
///
/// Wait with [`Work::wait`] to see its error. Dropped unwaited, it waits for the
/// collective (at most the group's timeout), counts its bytes if it succeeded and drops
/// its error.
#[derive(Debug)]
#[must_use = "a started collective is waited for when dropped; keep it to overlap"]
pub struct Work {
    work: Option<memsave_sys::dist::Work>,
    group: ProcessGroup,
    /// Bytes this rank sends, counted once the collective is done.
    bytes: u64,
}

impl Work {
    /// Waits until the collective is done (at most the group's timeout); an error
    /// names the rank.
    pub fn wait(mut self) -> Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> Result<()> {
        match self.work.take() {
            Some(work) => {
                work.wait()?;
                self.group.count(self.bytes);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // The error is dropped: wait to see it.
        let _ = self.finish();
    }
}

fn check_options(rank: usize, world_size: usize, options: &InitOptions) -> Result<()> {
    let reason = match options.backend {
        Backend::Nccl => Some(
            "the NCCL backend is not built into memsave's bridge; use Backend::Gloo with CPU tensors"
                .to_owned(),
        ),
        Backend::Gloo if world_size == 0 => Some("world size must be at least 1".to_owned()),
        Backend::Gloo if rank >= world_size => Some(format!(
            "rank must be below the world size {world_size}"
        )),
        Backend::Gloo => None,
    };
    reason.map_or(Ok(()), |reason| Err(DistError::Config { rank, reason }))
}

fn default_hostname() -> String {
    std::env::var("GLOO_HOSTNAME").unwrap_or_else(|_| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_owned())
            .unwrap_or_else(|_| "127.0.0.1".to_owned())
    })
}
