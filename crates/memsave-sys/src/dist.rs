//! libtorch's distributed engine (c10d): a rendezvous store and a Gloo process group
//! with blocking collectives.
//!
//! A [`Store`] is where the processes of a group find each other: a `TCPStore` served
//! by one of them, or a `FileStore` on a file they all see. A [`GlooGroup`] joins the
//! group as one rank and runs collectives over Gloo's TCP transport on CPU tensors.
//! Every collective waits at most the group's timeout; every error message starts with
//! `rank R:` and names the operation, so a failing rank says which one it is.
//!
//! NCCL is not compiled into the bridge: CUDA tensors must be copied to the CPU first.
use crate::error::check;
use crate::{ffi, Result};
use std::ffi::{c_void, CString};
use std::path::Path;
use std::time::Duration;
use tch::Tensor;

fn c_string(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| crate::Error::new(format!("{what} contains a NUL byte: {s:?}")))
}

fn millis(timeout: Duration) -> i64 {
    i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX)
}

fn c_int_of(what: &str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| crate::Error::new(format!("{what} {value} is too large")))
}

/// A c10d key-value store used for rendezvous.
#[derive(Debug)]
pub struct Store {
    ptr: *mut c_void,
}

// SAFETY: c10d stores are used from several threads by libtorch itself (the Gloo
// group's threads share one); the handle is only an owning pointer.
unsafe impl Send for Store {}
// SAFETY: as above; every method of a c10d store is thread-safe.
unsafe impl Sync for Store {}

impl Store {
    /// A `TCPStore` at `host:port`: the server (`is_server`, usually rank 0) listens
    /// there, the others connect and retry until `timeout`.
    pub fn tcp(
        host: &str,
        port: u16,
        is_server: bool,
        world_size: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let host = c_string("host", host)?;
        let world = c_int_of("world size", world_size)?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `host` is a NUL-terminated string alive for the call; `ptr` receives a
        // new handle on success only.
        check(unsafe {
            ffi::ms_dist_store_tcp(
                host.as_ptr(),
                port,
                is_server,
                world,
                millis(timeout),
                &mut ptr,
            )
        })?;
        Ok(Self { ptr })
    }

    /// A `FileStore` on `path`, which every process of the group must see; the file
    /// should not exist before the group starts (a stale file holds a previous run's keys).
    pub fn file(path: &Path, world_size: usize, timeout: Duration) -> Result<Self> {
        let path = c_string("path", &path.to_string_lossy())?;
        let world = c_int_of("world size", world_size)?;
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `path` is a NUL-terminated string alive for the call; `ptr` receives a
        // new handle on success only.
        check(unsafe { ffi::ms_dist_store_file(path.as_ptr(), world, millis(timeout), &mut ptr) })?;
        Ok(Self { ptr })
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from ms_dist_store_* and is freed only here.
        unsafe { ffi::ms_dist_store_free(self.ptr) }
    }
}

/// One rank of a Gloo process group (CPU tensors).
///
/// Collectives run one at a time on the group's worker thread; when one returns, the
/// group holds no reference to its tensors any more (so freeing them is immediate and
/// the memory meter exact).
#[derive(Debug)]
pub struct GlooGroup {
    ptr: *mut c_void,
    rank: usize,
    size: usize,
}

// SAFETY: ProcessGroupGloo is built to be called from several threads (PyTorch's DDP
// calls it from autograd threads); the handle is only an owning pointer.
unsafe impl Send for GlooGroup {}
// SAFETY: as above.
unsafe impl Sync for GlooGroup {}

impl GlooGroup {
    /// Joins the group of `size` ranks as `rank`, through `store`; the transport binds
    /// to `hostname` (an address other ranks can reach: "127.0.0.1" on one machine).
    ///
    /// Waits until every rank has joined, at most `timeout`, and refuses a rank whose
    /// world size differs. `timeout` also bounds every collective.
    pub fn new(
        store: &Store,
        rank: usize,
        size: usize,
        hostname: &str,
        timeout: Duration,
    ) -> Result<Self> {
        let host = c_string("hostname", hostname)?;
        let (r, n) = (c_int_of("rank", rank)?, c_int_of("world size", size)?);
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `store.ptr` is a live store handle (the group keeps its own reference);
        // `host` lives for the call; `ptr` receives a new handle on success only.
        check(unsafe {
            ffi::ms_dist_group_gloo(store.ptr, r, n, host.as_ptr(), millis(timeout), &mut ptr)
        })?;
        Ok(Self { ptr, rank, size })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Sums `t` over the ranks, in place, on every rank.
    pub fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        // SAFETY: `ptr` is live; `t` is a live tch tensor whose storage c10d writes
        // through the shared TensorImpl, as tch's own in-place operations do.
        check(unsafe { ffi::ms_dist_all_reduce_sum(self.ptr, t.as_ptr() as *mut _) })
    }

    /// Writes into `output` the sum over ranks of this rank's slice of `input`
    /// (`input` has `size × output.numel()` values; rank `r` gets slice `r`).
    pub fn reduce_scatter_sum(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        // SAFETY: `ptr` is live; both tensors are live tch tensors.
        check(unsafe {
            ffi::ms_dist_reduce_scatter_sum(
                self.ptr,
                output.as_ptr() as *mut _,
                input.as_ptr() as *mut _,
            )
        })
    }

    /// Writes every rank's `input` into `output` (`size × input.numel()` values), in
    /// rank order.
    pub fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<()> {
        // SAFETY: `ptr` is live; both tensors are live tch tensors.
        check(unsafe {
            ffi::ms_dist_all_gather(
                self.ptr,
                output.as_ptr() as *mut _,
                input.as_ptr() as *mut _,
            )
        })
    }

    /// Starts [`GlooGroup::all_gather`] without waiting for it (PyTorch's
    /// `async_op=True`): the collective runs on the group's worker thread, after those
    /// issued before it, and the returned [`Work`] says when it is done.
    ///
    /// Trap: do not read `output` or change `input` before [`Work::wait`] returns. The
    /// work holds its own references to both tensors, so dropping them early is safe.
    pub fn all_gather_start(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: `ptr` is live; both tensors are live tch tensors, which the started
        // work keeps referenced (not borrowed) until it is done; `ptr` receives a new
        // work handle on success only.
        check(unsafe {
            ffi::ms_dist_all_gather_start(
                self.ptr,
                output.as_ptr() as *mut _,
                input.as_ptr() as *mut _,
                &mut ptr,
            )
        })?;
        Ok(Work { ptr })
    }

    /// Sends `input_counts[r]` values of `input` (taken in rank order) to rank `r`, and
    /// receives `output_counts[r]` values from rank `r` into `output` (in rank order):
    /// c10d's `alltoall_base`. Both count slices have one entry per rank.
    pub fn all_to_all(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_counts: &[i64],
        input_counts: &[i64],
    ) -> Result<()> {
        if output_counts.len() != input_counts.len() {
            return Err(crate::Error::new(format!(
                "all_to_all: {} output split sizes but {} input split sizes",
                output_counts.len(),
                input_counts.len()
            )));
        }
        let n = c_int_of("number of split sizes", output_counts.len())?;
        // SAFETY: `ptr` is live; both tensors are live tch tensors; the count slices
        // have `n` entries each and outlive the call, which only reads them.
        check(unsafe {
            ffi::ms_dist_all_to_all(
                self.ptr,
                output.as_ptr() as *mut _,
                input.as_ptr() as *mut _,
                output_counts.as_ptr(),
                input_counts.as_ptr(),
                n,
            )
        })
    }

    /// Copies rank `src`'s `t` into `t` on every rank.
    pub fn broadcast(&self, t: &Tensor, src: usize) -> Result<()> {
        let src = c_int_of("source rank", src)?;
        // SAFETY: `ptr` is live; `t` is a live tch tensor.
        check(unsafe { ffi::ms_dist_broadcast(self.ptr, t.as_ptr() as *mut _, src) })
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<()> {
        // SAFETY: `ptr` is live.
        check(unsafe { ffi::ms_dist_barrier(self.ptr) })
    }
}

impl Drop for GlooGroup {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from ms_dist_group_gloo and is freed only here.
        unsafe { ffi::ms_dist_group_free(self.ptr) }
    }
}

/// A collective started by [`GlooGroup::all_gather_start`] (c10d's `Work`).
///
/// Dropping it without [`Work::wait`] waits for the collective (at most the group's
/// timeout) and drops its error: a collective never runs on memory given back.
#[derive(Debug)]
pub struct Work {
    ptr: *mut c_void,
}

// SAFETY: a c10d work may be waited on from any thread; the handle is only an owning
// pointer.
unsafe impl Send for Work {}

impl Work {
    /// Waits until the collective is done (at most the group's timeout); an error
    /// names the rank.
    pub fn wait(self) -> Result<()> {
        // SAFETY: `ptr` is a live work handle; it is freed (without waiting again) when
        // `self` drops at the end of this call.
        check(unsafe { ffi::ms_dist_work_wait(self.ptr) })
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from ms_dist_all_gather_start and is freed only here; the
        // call waits first when the work was not waited.
        unsafe { ffi::ms_dist_work_free(self.ptr) }
    }
}

/// Sets the gradient of the leaf `t` to `grad` (PyTorch's `t.grad = grad`); the two
/// share storage afterwards.
pub fn set_grad(t: &Tensor, grad: &Tensor) -> Result<()> {
    // SAFETY: both are live tch tensors; mutable_grad() is changed through the shared
    // TensorImpl, as `tensor::set_grad_none` does.
    check(unsafe { ffi::ms_dist_set_grad(t.as_ptr() as *mut _, grad.as_ptr().cast()) })
}
