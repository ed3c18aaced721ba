//! Measuring each layer once: the bytes and times the budget solver plans with.
use crate::error::{catching_panics, CheckpointError, Result};
use crate::function::Checkpoint;
use crate::layers::SharedLayer;
use memsave_meter::measure;
use memsave_sys::tensor::{backward_with_grads, nbytes, set_grad_none};
use std::time::Instant;
use tch::Tensor;

/// What one layer costs, measured with the meter and a clock.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerProfile {
    /// Bytes of the layer's input.
    pub input_bytes: u64,
    /// Bytes of the layer's output.
    pub output_bytes: u64,
    /// Bytes a forward with grad leaves allocated while its output is held: the output
    /// plus what the layer saved for backward beyond its input.
    pub retained_bytes: u64,
    /// Peak of a forward with grad above its start.
    pub forward_peak_bytes: u64,
    /// Peak of a forward without grad above its start.
    pub nograd_peak_bytes: u64,
    /// Peak of the layer's backward above its start (saved tensors and output gradient
    /// present), including the input and parameter gradients it creates.
    pub backward_peak_bytes: u64,
    /// Bytes of the parameter gradients the layer's backward creates.
    pub param_grad_bytes: u64,
    /// True when autograd saved the layer's output for its backward (as `relu` or `exp`
    /// do), so the output lives until the layer's backward has run.
    pub saves_output: bool,
    /// Seconds of a forward with grad.
    pub forward_time_s: f64,
    /// Seconds of a forward without grad.
    pub nograd_time_s: f64,
    /// Seconds of the layer's backward.
    pub backward_time_s: f64,
}

/// The profile of a chain: one entry per layer, then the loss as a last element.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainProfile {
    /// Layers in order, the loss ("head") last.
    pub elements: Vec<LayerProfile>,
    /// Bytes a checkpoint itself holds while alive: the stashed RNG state (5,056 bytes
    /// for the CPU generator) when the RNG is preserved, else 0.
    pub checkpoint_overhead_bytes: u64,
}

impl ChainProfile {
    /// Number of layers, the loss not included.
    pub fn layers(&self) -> usize {
        self.elements.len() - 1
    }
}

fn grad_bytes(params: &[Tensor]) -> u64 {
    params
        .iter()
        .map(|p| p.grad())
        .filter(|g| g.defined())
        .map(|g| nbytes(&g))
        .sum()
}

fn clear_grads(params: &[Tensor]) -> Result<()> {
    for p in params {
        set_grad_none(p)?;
    }
    Ok(())
}

fn min_time(runs: usize, mut f: impl FnMut()) -> f64 {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Profiles one element: forward without grad (its output feeds the next element),
/// forward with grad, backward with a gradient of ones.
fn profile_element(
    forward: &dyn Fn(&Tensor) -> Tensor,
    x: &Tensor,
    input_requires_grad: bool,
    params: &[Tensor],
) -> Result<(LayerProfile, Tensor)> {
    let device = x.device();
    clear_grads(params)?;
    let (y, nograd) = measure(device, |_| tch::no_grad(|| forward(x)));
    let nograd_time_s = min_time(2, || {
        let _ = tch::no_grad(|| forward(x));
    });
    let xi = x
        .detach()
        .set_requires_grad(input_requires_grad && x.is_floating_point());
    let start = Instant::now();
    let (out, fwd) = measure(device, |_| forward(&xi));
    let forward_time_s = start.elapsed().as_secs_f64();
    // A saved output shares the output's storage: its use count rises above one.
    let saves_output = memsave_sys::tensor::storage_use_count(&out)? > 1;
    let grad = out.ones_like();
    let start = Instant::now();
    let (result, bwd) = measure(device, |_| {
        if out.requires_grad() {
            backward_with_grads(&[out.shallow_clone()], &[grad.shallow_clone()], false)
        } else {
            Ok(())
        }
    });
    let backward_time_s = start.elapsed().as_secs_f64();
    result?;
    let profile = LayerProfile {
        input_bytes: nbytes(x),
        output_bytes: nbytes(&y),
        retained_bytes: fwd.retained_bytes().max(0) as u64,
        forward_peak_bytes: fwd.peak_bytes,
        nograd_peak_bytes: nograd.peak_bytes,
        backward_peak_bytes: bwd.peak_bytes,
        param_grad_bytes: grad_bytes(params),
        saves_output,
        forward_time_s,
        nograd_time_s,
        backward_time_s,
    };
    clear_grads(params)?;
    Ok((profile, y))
}

/// Bytes one checkpoint keeps alive besides its input and output: the RNG state when it
/// is preserved. The probe saves a tensor for backward and draws a random number, the
/// worst case: a checkpoint whose function saves nothing keeps nothing at all, and one
/// whose function draws no random number keeps no RNG state.
fn checkpoint_overhead(x: &Tensor, options: Checkpoint) -> Result<u64> {
    let x = x.detach().set_requires_grad(true);
    let (out, m) = measure(x.device(), |_| {
        options.run(&[&x], |xs| vec![xs[0].tanh().dropout(0.5, true)])
    });
    let out = out?;
    let output_bytes = out.iter().map(nbytes).sum::<u64>();
    let bytes = (m.retained_bytes().max(0) as u64).saturating_sub(output_bytes);
    drop(out);
    Ok(bytes)
}

/// Profiles every layer on `example` and the loss on the chain's output. The first
/// layer's input requires grad only if `example` does; the others' always do.
pub(crate) fn profile_chain(
    layers: &[SharedLayer],
    example: &Tensor,
    params: &[Tensor],
    loss: &dyn Fn(&Tensor) -> Tensor,
    options: Checkpoint,
) -> Result<ChainProfile> {
    let run = || -> Result<ChainProfile> {
        let mut elements = Vec::with_capacity(layers.len() + 1);
        let mut x = example.detach();
        let mut input_requires_grad = example.requires_grad();
        for layer in layers {
            let forward = |t: &Tensor| layer.forward_t(t, true);
            let (p, y) = profile_element(&forward, &x, input_requires_grad, params)?;
            elements.push(p);
            x = y;
            input_requires_grad = true;
        }
        let (head, _) = profile_element(loss, &x, input_requires_grad, params)?;
        elements.push(head);
        let checkpoint_overhead_bytes = checkpoint_overhead(&x, options)?;
        Ok(ChainProfile {
            elements,
            checkpoint_overhead_bytes,
        })
    };
    // A profile is not a training step: BatchNorm's running statistics stay as they were.
    memsave_sys::checkpoint::with_running_stats_preserved(|| {
        catching_panics("a layer panicked while profiling", run)
    })
    .map_err(|e| CheckpointError::Torch(e.to_string()))?
}
