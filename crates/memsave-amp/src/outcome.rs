//! What a scaler step did.

/// Whether [`GradScaler::step`](crate::GradScaler::step) ran the optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// All gradients were finite; the optimizer stepped.
    Stepped,
    /// Some gradient held inf or NaN; the optimizer did not run and every parameter is
    /// unchanged. The next `update` backs the scale off.
    SkippedNonFinite,
}

impl StepOutcome {
    /// True when the optimizer did not run.
    pub fn is_skipped(self) -> bool {
        self == StepOutcome::SkippedNonFinite
    }
}
