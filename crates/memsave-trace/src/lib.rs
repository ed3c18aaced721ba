//! Where the bytes go: every allocation and free of a training step, with its role.
//!
//! The meter (`memsave-meter`) says how many bytes a step holds; this crate says
//! whose they are. [`Recorder::record`] runs a step with the counting allocator's
//! event recorder on and returns a [`Trace`]: every allocation and free, each with its
//! size, time, [`Phase`] (forward, backward, optimizer), the mark open at that moment,
//! and a [`Category`]: `parameter`, `gradient`, `optimizer_state`, `saved_activation`
//! (with the autograd node that saved it, `AddmmBackward0`, and the layer's mark),
//! `recompute` (allocated by a checkpoint's recomputation in backward, when the step
//! says when those run), `temporary`, `input` or `other`. At every event the
//! categories add up to `memory_allocated` exactly; what the recorder cannot place is
//! `other`, counted, never dropped. A trace
//! exports to PyTorch's memory snapshot ([`Trace::to_snapshot_pickle`], for
//! `torch.cuda._memory_viz`), a self-contained HTML timeline ([`Trace::to_html`]) and
//! a text summary in the spirit of `memory_summary()` ([`Trace::summary`]).
//!
//! The seed question, answered: in `x = x + Linear(x)` every layer's input is a
//! `saved_activation` of `AddmmBackward0` (the previous layer's add produced the
//! tensor; the Linear's `AddmmBackward0` node saved it, to compute the weight's
//! gradient), so the forward's memory grows by one input per layer.
//!
//! ```
//! use memsave_trace::{Category, Phase, Recorder};
//! use tch::nn::{self, Module};
//! use tch::{Device, Kind, Tensor};
//!
//! // First thing: the meter counts only storages allocated after it is installed.
//! memsave_meter::install();
//! let vs = nn::VarStore::new(Device::Cpu);
//! let layers: Vec<_> = (0..3).map(|i| nn::linear(vs.root() / i, 64, 64, Default::default())).collect();
//! let x = Tensor::randn([8, 64], (Kind::Float, Device::Cpu));
//! let params = vs.trainable_variables();
//! let (_, trace) = Recorder::new(Device::Cpu)
//!     .parameters(&params)
//!     .inputs(&[x.shallow_clone()])
//!     .record(|s| {
//!         s.phase(Phase::Forward);
//!         let mut h = x.shallow_clone();
//!         for (i, layer) in layers.iter().enumerate() {
//!             s.mark(format!("layer {i}"));
//!             h = &h + layer.forward(&h);
//!         }
//!         s.mark("end of forward");
//!         let loss = h.square().mean(Kind::Float);
//!         s.phase(Phase::Backward);
//!         loss.backward();
//!     })
//!     .unwrap();
//! // Layers 1 and 2 keep their inputs (8 x 64 floats each; layer 0's is the caller's
//! // input), and the loss keeps the output: a storage has one role for its whole life.
//! let forward = trace.bytes_at_mark("end of forward").unwrap();
//! assert_eq!(forward[Category::SavedActivation], 3 * 8 * 64 * 4);
//! assert_eq!(forward[Category::Input], 8 * 64 * 4);
//! // After backward: one gradient per parameter, as large as the parameters.
//! let end = trace.end_bytes();
//! assert_eq!(end[Category::Gradient], 3 * (64 * 64 + 64) * 4);
//! assert_eq!(end[Category::Gradient], end[Category::Parameter]);
//! // Who keeps them: the node that saved them, named as PyTorch names it.
//! let saved = trace
//!     .blocks
//!     .iter()
//!     .find(|b| b.category == Category::SavedActivation && b.mark.as_deref() == Some("layer 1"))
//!     .unwrap();
//! assert_eq!(saved.role(), "saved_activation of AddmmBackward0");
//! // The categories add up to the meter at every event.
//! for (bytes, event) in trace.timeline().iter().zip(&trace.events) {
//!     assert_eq!(bytes.total(), event.allocated_after);
//! }
//! println!("{}", trace.summary(5));
//! ```
#![forbid(unsafe_code)]

mod bridge;
mod category;
mod error;
mod html;
mod leak;
mod note;
mod recorder;
mod snapshot;
mod summary;
mod trace;

pub use bridge::{block_runs, OptimizerRoles};
pub use category::{Category, CategoryBytes, Phase};
pub use error::TraceError;
pub use leak::{detect_leak, LeakError, LeakTrace, LeftBehind};
pub use recorder::{record, Recorder, Session};
pub use trace::{Block, BlockRecomputation, Event, Recomputation, Trace, TraceMark};
