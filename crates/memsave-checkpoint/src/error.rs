use memsave_meter::Bytes;

/// Errors of checkpointing and planning, with what to do about them.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// libtorch or the checkpointed function failed (in the forward, or the recompute).
    #[error("{0}")]
    Torch(String),
    /// No schedule fits the memory budget.
    #[error("no schedule fits a budget of {budget}: the smallest feasible budget for this model and input is {smallest_feasible}")]
    InfeasibleBudget {
        /// The budget asked for.
        budget: Bytes,
        /// The smallest budget the planner can meet.
        smallest_feasible: Bytes,
    },
    /// A plan's parameters do not fit the model (for example zero segments).
    #[error("invalid plan: {0}")]
    InvalidPlan(String),
    /// A `Budget` plan was used before profiling the model on an example input.
    #[error("the Budget plan needs a profile: call CheckpointedSequential::plan_for_budget with an example input first")]
    NotProfiled,
}

impl From<memsave_sys::Error> for CheckpointError {
    fn from(e: memsave_sys::Error) -> Self {
        CheckpointError::Torch(e.message().to_owned())
    }
}

impl From<tch::TchError> for CheckpointError {
    fn from(e: tch::TchError) -> Self {
        CheckpointError::Torch(e.to_string())
    }
}

/// The result of checkpointing calls.
pub type Result<T, E = CheckpointError> = std::result::Result<T, E>;
