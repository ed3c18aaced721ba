//! One measured training step (forward, loss, backward), with the same definitions for
//! every strategy, as in `pytorch_suite.py`.
//!
//! - start: allocated when the step begins, gradients set to none (parameters, input);
//! - peak: the highest allocation during the step minus start;
//! - retained after forward: allocated right after the forward (output alive, autocast
//!   weight cache alive) minus start; with micro-batches the largest over them, which
//!   from the second on includes the gradients accumulated so far;
//! - the output is held until its backward has finished, as a Python variable would be.
use crate::models::{self, Model};
use crate::report::TraceEntry;
use crate::strategies::StepConfig;
use memsave_accum::{f_split, free_grads, Split};
use memsave_amp::AutocastGuard;
use memsave_meter::{f_memory_allocated, measure};
use std::time::Instant;
use tch::{Device, Tensor};

/// What one step measured.
#[derive(Debug, Clone, PartialEq)]
pub struct StepMeasurement {
    /// Allocated at the step's start.
    pub start_bytes: u64,
    /// Highest allocation during the step minus `start_bytes`.
    pub peak_bytes: u64,
    /// Allocated right after the forward minus `start_bytes`.
    pub retained_after_forward_bytes: u64,
    /// Wall time of forward, loss and backward.
    pub time_s: f64,
    /// Per-block memory of the (first micro-batch's) forward, when asked for.
    pub trace: Vec<TraceEntry>,
}

/// Runs one step of `model` on `x` as `config` says; errors carry libtorch's text.
///
/// The model's residual update and checkpoint plan must already be set. A strategy
/// that writes into its input gets a copy of `x` (made before the step starts), so
/// the suite's input stays intact for the next case.
pub fn f_step(
    model: &Model,
    x: &Tensor,
    config: &StepConfig,
    device: Device,
    record_trace: bool,
) -> Result<StepMeasurement, String> {
    let params = model.params();
    free_grads(&params).map_err(|e| e.to_string())?;
    let input = if config.residual.writes_input() {
        let mut copy = x.f_empty_like().map_err(|e| e.to_string())?;
        copy.f_copy_(x).map_err(|e| e.to_string())?;
        copy
    } else {
        x.shallow_clone()
    };
    let passes: Vec<(Tensor, Option<f64>)> = match config.micro_batches {
        None => vec![(input.shallow_clone(), None)],
        Some(count) => {
            let batch = *x.size().first().ok_or("the input has no batch dimension")?;
            f_split(batch, Split::Count(count))
                .map_err(|e| e.to_string())?
                .iter()
                .map(|mb| Ok((mb.f_narrow(&input)?, Some(mb.weight))))
                .collect::<Result<_, memsave_accum::AccumError>>()
                .map_err(|e| e.to_string())?
        }
    };
    let mut trace = Vec::new();
    let (result, m) = measure(device, |_| -> Result<(u64, f64), String> {
        let start = f_memory_allocated(device).map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let mut retained = 0;
        for (i, (xin, weight)) in passes.iter().enumerate() {
            let trace_this = record_trace && i == 0;
            let (out, loss) = {
                let _autocast = config
                    .autocast
                    .map(|kind| AutocastGuard::new(device, kind))
                    .transpose()
                    .map_err(|e| e.to_string())?;
                if trace_this {
                    model.ctx.start_trace();
                }
                let out = model.seq.f_forward(xin);
                if trace_this {
                    trace = model.ctx.stop_trace();
                }
                let out = out.map_err(|e| e.to_string())?;
                let now = f_memory_allocated(device).map_err(|e| e.to_string())?;
                retained = retained.max(now.saturating_sub(start));
                let loss = models::loss(&out).map_err(|e| e.to_string())?;
                (out, loss)
            };
            // The unweighted loss is a temporary, as in `(loss * w).backward()`.
            let loss = match weight {
                Some(w) => {
                    let weighted = loss.f_mul_scalar(*w).map_err(|e| e.to_string());
                    drop(loss);
                    weighted?
                }
                None => loss,
            };
            loss.f_backward().map_err(|e| e.to_string())?;
            drop(loss);
            drop(out);
        }
        Ok((retained, t0.elapsed().as_secs_f64()))
    });
    release_step_leftovers(&input, config);
    let (retained, time_s) = result?;
    Ok(StepMeasurement {
        start_bytes: m.start_bytes,
        peak_bytes: m.peak_bytes,
        retained_after_forward_bytes: retained,
        time_s,
        trace,
    })
}

/// Frees what libtorch keeps alive after some steps, so that every step (and the next
/// case) starts from the parameters and the input alone:
///
/// `x += f(x)` on a tensor a layer saved for backward forms a reference cycle (the
/// saved input holds the tensor, whose new `grad_fn` holds the saved input), which leaks
/// the mutated tensor; detaching it in place breaks the cycle.
fn release_step_leftovers(input: &Tensor, config: &StepConfig) {
    if config.residual.writes_input() {
        let mut input = input.shallow_clone();
        let _ = input.f_detach_();
    }
}

/// The gradients of `params`, copied out of libtorch (so that keeping them does not
/// count as allocated device memory); an undefined gradient reads as zeros.
pub fn f_grads(params: &[Tensor]) -> Result<Vec<Vec<f32>>, String> {
    params
        .iter()
        .map(|p| {
            let g = p.grad();
            if !g.defined() {
                return Ok(vec![0.0; p.numel()]);
            }
            Vec::<f32>::try_from(&g.f_reshape([-1]).map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())
        })
        .collect()
}

/// The largest absolute difference between two sets of gradients; NaN when any
/// difference is NaN (a diverged gradient must not look close).
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y))
        .map(|(x, y)| f64::from((x - y).abs()))
        .fold(0.0, |max, d| if d.is_nan() { f64::NAN } else { max.max(d) })
}
