//! Learning-rate schedules for the [`Trainer`](crate::Trainer): a rate for each step,
//! set on the optimizer before the step runs ([`Trainer::set_lr_scheduler`](crate::Trainer::set_lr_scheduler)).

/// The learning rate of each step, as PyTorch's `torch.optim.lr_scheduler` gives it:
/// [`lr`](Self::lr) is asked once before step `step` (0 for the first) and its answer
/// set on every parameter group. Any `FnMut(u64) -> f64` is one, e.g.
/// `|step| 1e-3 * 0.95f64.powi(step as i32)` (PyTorch's `ExponentialLR`).
pub trait LRScheduler: Send {
    /// The learning rate of step `step` (counted from 0).
    fn lr(&mut self, step: u64) -> f64;
}

impl<F: FnMut(u64) -> f64 + Send> LRScheduler for F {
    fn lr(&mut self, step: u64) -> f64 {
        self(step)
    }
}

/// Linear warmup: `lr * (step + 1) / warmup_steps` for the first `warmup_steps` steps,
/// then `lr`: the full rate from step `warmup_steps - 1` on (PyTorch's
/// `LinearLR(start_factor=1/warmup_steps, total_iters=warmup_steps - 1)`; with
/// `LinearLR`'s default `total_iters` the ramp is one step longer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinearWarmup {
    /// The rate after warmup.
    pub lr: f64,
    /// Steps of warmup; 0 means none.
    pub warmup_steps: u64,
}

impl LRScheduler for LinearWarmup {
    fn lr(&mut self, step: u64) -> f64 {
        if step < self.warmup_steps {
            self.lr * (step + 1) as f64 / self.warmup_steps as f64
        } else {
            self.lr
        }
    }
}

/// Linear warmup then cosine decay from `lr` to `min_lr` at `total_steps` (PyTorch's
/// `CosineAnnealingLR` after a warmup); `min_lr` from then on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CosineDecay {
    /// The rate at the end of warmup.
    pub lr: f64,
    /// The rate at `total_steps` and after.
    pub min_lr: f64,
    /// Steps of linear warmup (as [`LinearWarmup`]).
    pub warmup_steps: u64,
    /// The step at which the decay reaches `min_lr`, warmup included.
    pub total_steps: u64,
}

impl LRScheduler for CosineDecay {
    fn lr(&mut self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return LinearWarmup {
                lr: self.lr,
                warmup_steps: self.warmup_steps,
            }
            .lr(step);
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps);
        if step >= self.total_steps || span == 0 {
            return self.min_lr;
        }
        let t = (step - self.warmup_steps) as f64 / span as f64;
        self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_decay() {
        let mut w = LinearWarmup {
            lr: 0.4,
            warmup_steps: 4,
        };
        let rates: Vec<f64> = (0..6).map(|s| w.lr(s)).collect();
        assert_eq!(rates, [0.1, 0.2, 0.30000000000000004, 0.4, 0.4, 0.4]);
        let mut c = CosineDecay {
            lr: 1.0,
            min_lr: 0.0,
            warmup_steps: 2,
            total_steps: 6,
        };
        let rates: Vec<f64> = (0..8).map(|s| c.lr(s)).collect();
        // Halfway through the decay (step 4 of 2..6) the rate is half; cos(pi/4) at 3.
        assert_eq!(rates[..3], [0.5, 1.0, 1.0]);
        assert!((rates[3] - (0.5 + 0.5 * std::f64::consts::FRAC_1_SQRT_2)).abs() < 1e-15);
        assert!((rates[4] - 0.5).abs() < 1e-15);
        assert_eq!(rates[6..], [0.0, 0.0]);
        let mut f = |step: u64| 2.0 * step as f64;
        assert_eq!(LRScheduler::lr(&mut f, 3), 6.0);
    }
}
