//! Constants: tensors without a `grad_fn` that outlive the hook scopes they are saved
//! in, recognized when a later scope saves them again.
//!
//! From inside a pack hook a constant a layer holds (a rotary table, a causal mask it
//! caches) looks like a mask the forward made and drops (a dropout mask): no
//! `grad_fn`, the same handle counts. What tells them apart is when they were
//! allocated, which the hook does not see. What it can see is that a tensor saved in a
//! scope that has ended is still alive (its storage, held weakly here) when a later
//! scope on the same thread saves it again: something outside the steps holds it, so
//! packing it would add bytes.
use crate::error::HookError;
use crate::scope::{innermost_scope, scope_is_open};
use memsave_sys::tensor::WeakStorage;
use std::cell::RefCell;
use std::collections::HashMap;
use tch::Tensor;

/// At most this many tensors are remembered per thread; beyond it those not yet found
/// alive are forgotten (they are noted again the next time they are saved).
const CAP: usize = 4096;

/// A tensor without a `grad_fn` saved in a hook scope.
struct Seen {
    storage: WeakStorage,
    /// The scope it was first saved in.
    scope: u64,
    /// Found alive after that scope ended.
    constant: bool,
}

thread_local! {
    /// By data pointer: two live storages never share one, so an entry whose pointer
    /// a new storage reuses was freed and is replaced.
    static SEEN: RefCell<HashMap<usize, Seen>> = RefCell::new(HashMap::new());
}

/// True when `t` (a tensor without a `grad_fn`) uses the storage of a tensor saved in a
/// hook scope on this thread that has ended: it outlived that scope. Otherwise, inside a
/// scope, notes it for the scopes after this one.
pub(crate) fn outlived_a_scope(t: &Tensor) -> Result<bool, HookError> {
    let ptr = t.data_ptr() as usize;
    if ptr == 0 {
        return Ok(false);
    }
    let found = SEEN.try_with(|seen| -> Result<bool, HookError> {
        let mut seen = seen.borrow_mut();
        if let Some(s) = seen.get_mut(&ptr) {
            if s.storage.is_storage_of(t)? {
                if !s.constant && !scope_is_open(s.scope) {
                    s.constant = true;
                }
                return Ok(s.constant);
            }
            seen.remove(&ptr);
        }
        let Some(scope) = innermost_scope() else {
            return Ok(false);
        };
        // A tensor without storage (none the built-ins are given) is simply not noted.
        let Ok(storage) = WeakStorage::new(t) else {
            return Ok(false);
        };
        if seen.len() >= CAP {
            seen.retain(|_, s| s.constant);
            if seen.len() >= CAP {
                seen.clear();
            }
        }
        seen.insert(
            ptr,
            Seen {
                storage,
                scope,
                constant: false,
            },
        );
        Ok(false)
    });
    // Saved while this thread's locals are torn down: nothing to go by.
    found.unwrap_or(Ok(false))
}
