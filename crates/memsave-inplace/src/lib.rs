//! In-place operations that are provably safe, and version checks.
//!
//! An in-place update such as `x += f(x)` is safe exactly when nobody else holds the
//! tensor's storage: no other handle, no view, and autograd did not save it (as an
//! input or as an output) for backward. libtorch counts all three, and
//! [`is_exclusive`] reads the counts. The helpers here work like `Rc::make_mut`: they
//! take the tensor by value, mutate it in place when it is exclusive (and the result
//! keeps its shape and dtype, and it is not a leaf that requires grad), and otherwise
//! compute out of place and return the new tensor. Results and gradients are the same
//! either way; only the memory differs. [`stats`] counts which path was taken.
//!
//! When something else must not mutate a tensor, a [`VersionGuard`] (or
//! [`check_unmutated`]) names the culprit at the call site, instead of libtorch failing
//! later at backward.
//!
//! ```
//! use memsave_inplace::{f_residual_add, is_exclusive, reset_stats, stats};
//! use tch::{nn, nn::Module, Device, Kind, Tensor};
//!
//! let vs = nn::VarStore::new(Device::Cpu);
//! let layer = nn::linear(vs.root(), 16, 16, Default::default());
//! reset_stats();
//!
//! // Training: the linear saved `x` for backward, so the update copies.
//! let x = Tensor::rand([4, 16], (Kind::Float, Device::Cpu));
//! let fx = layer.forward(&x);
//! assert!(!is_exclusive(&x)?);
//! let y = f_residual_add(x, &fx)?;
//! y.sum(Kind::Float).backward(); // works: nothing saved was mutated
//! assert_eq!((stats().in_place, stats().copied), (0, 1));
//!
//! // Inference: nothing is saved, so the update happens in place, in x's own memory.
//! let _no_grad = tch::no_grad_guard();
//! let x = Tensor::rand([4, 16], (Kind::Float, Device::Cpu));
//! let fx = layer.forward(&x);
//! let before = x.data_ptr();
//! let y = f_residual_add(x, &fx)?;
//! assert_eq!(y.data_ptr(), before);
//! assert_eq!(stats().in_place, 1);
//! assert_eq!(stats().bytes_saved, 4 * 16 * 4);
//! # Ok::<(), memsave_inplace::InplaceError>(())
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod cow;
mod debug;
mod error;
mod exclusive;
mod fits;
mod ops;
mod stats;
mod version;

pub use cow::{f_inplace_or, inplace_or};
pub use debug::{check_unmutated, debug_assert_unmutated};
pub use error::{InplaceError, Result};
pub use exclusive::{can_mutate_in_place, is_exclusive, sharing, Sharing};
pub use ops::{
    add, clamp, dropout, f_add, f_clamp, f_dropout, f_gelu, f_mul, f_relu, f_residual_add, gelu,
    mul, relu, residual_add,
};
pub use stats::{reset_stats, stats, InplaceStats};
pub use version::{Mutation, VersionGuard};
