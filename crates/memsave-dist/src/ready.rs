//! Post-accumulate-grad hooks that tell a reducer which parameter's gradient is
//! complete, shared by data parallel and ZeRO-2.
use std::sync::{Arc, Mutex};

use memsave_sys::grad_hooks::{register_post_accumulate_grad_hook, GradHookHandle};
use tch::Tensor;

use crate::error::{DistError, Result};

/// One hook per parameter calling `ready(state, index)` once its gradient is
/// accumulated; keep the handles for as long as the hooks should run.
pub(crate) fn ready_hooks<T: Send + 'static>(
    params: &[Tensor],
    state: &Arc<Mutex<T>>,
    rank: usize,
    ready: fn(&mut T, usize) -> Result<()>,
) -> Result<Vec<GradHookHandle>> {
    let mut hooks = Vec::with_capacity(params.len());
    for (index, p) in params.iter().enumerate() {
        let shared = Arc::clone(state);
        let hook = register_post_accumulate_grad_hook(
            p,
            Box::new(move |_| {
                let mut s = shared.lock().unwrap_or_else(|e| e.into_inner());
                ready(&mut s, index).map_err(Into::into)
            }),
        )
        .map_err(|e| DistError::Config {
            rank,
            reason: format!("parameter {index}: {e}"),
        })?;
        hooks.push(hook);
    }
    Ok(hooks)
}
