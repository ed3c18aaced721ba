//! Version checks: record tensors' version counters now, learn later which were
//! mutated in place, at the call site rather than from libtorch's error at backward.
use crate::{InplaceError, Result};
use memsave_sys::tensor::version;
use std::fmt;
use tch::Tensor;

/// A tensor mutated in place since its version was recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mutation {
    /// The label given when the tensor was recorded.
    pub label: String,
    /// Its version counter when recorded.
    pub recorded_version: u64,
    /// Its version counter now.
    pub current_version: u64,
}

impl Mutation {
    /// How many in-place operations touched the tensor (or a view of it) since.
    pub fn versions(&self) -> u64 {
        self.current_version.saturating_sub(self.recorded_version)
    }
}

impl fmt::Display for Mutation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "`{}` was mutated {} time(s) since it was recorded (version {} -> {})",
            self.label,
            self.versions(),
            self.recorded_version,
            self.current_version
        )
    }
}

/// Compares recorded versions with the current ones; the mutated entries, in order.
pub(crate) fn mutations<'a>(
    recorded: impl IntoIterator<Item = (&'a str, &'a Tensor, u64)>,
) -> Result<Vec<Mutation>> {
    let mut mutated = Vec::new();
    for (label, tensor, recorded_version) in recorded {
        let current_version = version(tensor)?;
        if current_version != recorded_version {
            mutated.push(Mutation {
                label: label.to_owned(),
                recorded_version,
                current_version,
            });
        }
    }
    Ok(mutated)
}

/// Records tensors with a label and their version counters; [`verify`](Self::verify)
/// names each one mutated in place since.
///
/// libtorch only notices that a tensor saved for backward was mutated when backward
/// runs ("one of the variables needed for gradient computation has been modified by an
/// inplace operation"), far from the mutation. Track the tensors you hand to code you
/// do not control and verify right after it returns.
///
/// ```
/// use memsave_inplace::{InplaceError, VersionGuard};
/// use tch::{Device, Kind, Tensor};
/// let mut x = Tensor::zeros([3], (Kind::Float, Device::Cpu));
/// let mut guard = VersionGuard::new();
/// guard.track("x", &x)?;
/// x += 1.0;
/// let err = guard.verify().unwrap_err();
/// assert!(err.to_string().contains("`x` was mutated 1 time(s)"), "{err}");
/// # Ok::<(), InplaceError>(())
/// ```
///
/// # Traps
/// The guard keeps a shallow clone of each tensor: it keeps the storage alive and
/// makes the tensor shared, so the copy-on-write helpers never mutate a tracked tensor.
/// Only code that mutates regardless (tch's `_` methods, `+=`, writes through a view)
/// is caught. The version counter is shared by a tensor and its views, and `copy()`
/// starts a new tensor at version 1.
#[derive(Default)]
pub struct VersionGuard {
    tracked: Vec<Tracked>,
}

/// One recorded tensor.
struct Tracked {
    label: String,
    tensor: Tensor,
    version: u64,
}

impl VersionGuard {
    /// A guard that tracks nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `t`'s current version under `label`.
    pub fn track(&mut self, label: impl Into<String>, t: &Tensor) -> Result<&mut Self> {
        let version = version(t)?;
        self.tracked.push(Tracked {
            label: label.into(),
            tensor: t.shallow_clone(),
            version,
        });
        Ok(self)
    }

    /// The tracked tensors mutated since they were recorded, in recording order.
    pub fn mutations(&self) -> Result<Vec<Mutation>> {
        mutations(
            self.tracked
                .iter()
                .map(|t| (t.label.as_str(), &t.tensor, t.version)),
        )
    }

    /// `Ok` when no tracked tensor was mutated; otherwise [`InplaceError::Mutated`]
    /// naming each one and by how many versions.
    pub fn verify(&self) -> Result<()> {
        let mutated = self.mutations()?;
        if mutated.is_empty() {
            Ok(())
        } else {
            Err(InplaceError::Mutated(mutated))
        }
    }

    /// Records the current versions as the new reference, after an intended mutation.
    pub fn rebase(&mut self) -> Result<()> {
        for t in &mut self.tracked {
            t.version = version(&t.tensor)?;
        }
        Ok(())
    }

    /// Number of tracked tensors.
    pub fn len(&self) -> usize {
        self.tracked.len()
    }

    /// True when nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.tracked.is_empty()
    }
}

impl fmt::Debug for VersionGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.tracked.iter().map(|t| (&t.label, t.version)))
            .finish()
    }
}
