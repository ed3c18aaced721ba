//! The crate's error type: libtorch refused an operation, introspection failed, or
//! tensors were mutated behind a [`VersionGuard`](crate::VersionGuard)'s back.
use crate::version::Mutation;
use std::fmt;

/// Everything that can go wrong in this crate; nothing here panics on bad input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InplaceError {
    /// libtorch rejected the operation (bad shape, dtype or argument); `message` is
    /// libtorch's first line, without the C++ backtrace.
    #[error("{op}: {message}")]
    Torch {
        /// The operation that failed, as this crate names it (`"relu"`, `"add"`, ...).
        op: &'static str,
        /// libtorch's message.
        message: String,
    },
    /// An argument is out of its domain (a dropout probability outside `[0, 1]`).
    #[error("{op}: {message}")]
    InvalidArgument {
        /// The operation that refused the argument.
        op: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// Reading a tensor's reference counts or version counter failed.
    #[error("cannot inspect the tensor: {0}")]
    Introspection(#[from] memsave_sys::Error),
    /// Tensors were mutated in place since their versions were recorded.
    #[error("{}", Mutations(.0))]
    Mutated(Vec<Mutation>),
}

/// Result of this crate's fallible functions.
pub type Result<T, E = InplaceError> = std::result::Result<T, E>;

impl InplaceError {
    /// Wraps a tch error raised by `op`, keeping libtorch's message without its backtrace.
    pub(crate) fn torch(op: &'static str, e: tch::TchError) -> Self {
        InplaceError::Torch {
            op,
            message: first_line(&e.to_string()),
        }
    }
}

/// The first line of a libtorch message: the part a user reads, without
/// "Exception raised from ..." and the frames that follow it.
pub(crate) fn first_line(message: &str) -> String {
    message
        .lines()
        .next()
        .unwrap_or_default()
        .trim_end()
        .to_owned()
}

struct Mutations<'a>(&'a [Mutation]);

impl fmt::Display for Mutations<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} tensor(s) mutated in place: ", self.0.len())?;
        for (i, m) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "{m}")?;
        }
        Ok(())
    }
}
