use memsave_meter::Bytes;

/// Errors of checkpointing and planning, with what to do about them.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// libtorch or the checkpointed function failed (in the forward, or the recompute).
    #[error("{0}")]
    Torch(String),
    /// No schedule fits the memory budget. The message gives both budgets in exact bytes
    /// (a figure to copy), the smallest one also in a binary unit rounded up, so that
    /// neither form is below what the planner needs.
    #[error(
        "no schedule fits a budget of {}: the smallest feasible budget for this model and input is {}",
        exact_bytes(*.budget, Rounding::Down),
        exact_bytes(*.smallest_feasible, Rounding::Up)
    )]
    InfeasibleBudget {
        /// The budget asked for.
        budget: Bytes,
        /// The smallest budget the planner can meet.
        smallest_feasible: Bytes,
    },
    /// A plan's parameters do not fit the model (for example zero segments).
    #[error("invalid plan: {0}")]
    InvalidPlan(String),
    /// [`Blocks`](crate::Blocks) used the wrong way (a block outside a forward, a
    /// lever for a block no forward ran); the message says what to do.
    #[error("{0}")]
    Blocks(String),
    /// A forward ran other blocks, or in another order, than the ones its levers were
    /// set for; the message names the first that differs.
    #[error("the forward's blocks changed: {0}")]
    BlocksChanged(String),
    /// A `Budget` plan was used before profiling the model on an example input.
    #[error("the Budget plan needs a profile: call CheckpointedSequential::profile(example, params, loss) before set_plan(Plan::Budget(..))")]
    NotProfiled,
}

#[derive(Clone, Copy)]
enum Rounding {
    Down,
    Up,
}

/// `124969 B (122.05 KiB)`: the exact count, then (from 1 KiB on) two decimals of the
/// largest binary unit, rounded the given way.
fn exact_bytes(bytes: Bytes, rounding: Rounding) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    let n = u128::from(bytes.0);
    let Some(power) = (1..=UNITS.len() as u32)
        .rev()
        .find(|&p| n >= 1u128 << (10 * p))
    else {
        return format!("{n} B");
    };
    let unit = 1u128 << (10 * power);
    let hundredths = match rounding {
        Rounding::Down => n * 100 / unit,
        Rounding::Up => (n * 100).div_ceil(unit),
    };
    format!(
        "{n} B ({}.{:02} {})",
        hundredths / 100,
        hundredths % 100,
        UNITS[power as usize - 1]
    )
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

/// `run`'s result, or a [`CheckpointError::Torch`] saying that a layer panicked while
/// doing `what` (a panic must not cross into libtorch's autograd or the caller).
pub(crate) fn catching_panics<T>(what: &str, run: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|payload| {
        Err(CheckpointError::Torch(format!(
            "{what}: {}",
            memsave_sys::checkpoint::panic_message(&*payload)
        )))
    })
}
