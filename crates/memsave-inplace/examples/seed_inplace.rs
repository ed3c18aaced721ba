//! The seed's claims about in-place updates, measured with the exact meter.
//!
//! ```sh
//! cargo run --release -p memsave-inplace --example seed_inplace            # [100,100,512], 4 layers
//! cargo run --release -p memsave-inplace --example seed_inplace -- 4 8 32 3 # B S H layers
//! ```
use anyhow::{anyhow, bail, Result};
use memsave_inplace::{f_relu, f_residual_add, reset_stats, stats, VersionGuard};
use memsave_meter::{empty_cache, measure, memory_allocated, Bytes, Measurement};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

struct Shape {
    batch: i64,
    seq: i64,
    hidden: i64,
    layers: usize,
}

impl Shape {
    fn from_args() -> Result<Self> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        match args.as_slice() {
            [] => Ok(Shape {
                batch: 100,
                seq: 100,
                hidden: 512,
                layers: 4,
            }),
            [b, s, h, l] => Ok(Shape {
                batch: b.parse()?,
                seq: s.parse()?,
                hidden: h.parse()?,
                layers: l.parse()?,
            }),
            _ => bail!("usage: seed_inplace [BATCH SEQ HIDDEN LAYERS]"),
        }
    }

    fn input(&self) -> Tensor {
        Tensor::rand([self.batch, self.seq, self.hidden], (Kind::Float, CPU))
    }

    /// Bytes of one activation: B*S*H f32 values.
    fn activation_bytes(&self) -> u64 {
        (self.batch * self.seq * self.hidden * 4) as u64
    }

    fn layers(&self, vs: &nn::VarStore, bias: bool) -> Vec<nn::Linear> {
        let config = nn::LinearConfig {
            bias,
            ..Default::default()
        };
        (0..self.layers)
            .map(|i| nn::linear(vs.root() / i, self.hidden, self.hidden, config))
            .collect()
    }
}

fn first_line(e: impl ToString) -> String {
    e.to_string().lines().next().unwrap_or_default().to_owned()
}

fn gradients(vs: &nn::VarStore) -> Vec<Tensor> {
    let mut named: Vec<_> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(_, v)| v.grad().copy()).collect()
}

fn clear_gradients(vs: &nn::VarStore) -> Result<()> {
    for v in vs.trainable_variables() {
        memsave_sys::tensor::set_grad_none(&v)?;
    }
    Ok(())
}

fn identical(a: &[Tensor], b: &[Tensor]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.equal(y))
}

fn row(label: &str, m: &Measurement, act: u64) {
    println!(
        "  {label:<34} peak {:>10} ({:.2} act)   retained {:>10} ({:.2} act)",
        Bytes(m.peak_bytes).to_string(),
        m.peak_bytes as f64 / act as f64,
        Bytes(m.retained_bytes().max(0) as u64).to_string(),
        m.retained_bytes() as f64 / act as f64,
    );
}

fn claim_1(shape: &Shape) -> Result<()> {
    println!("\n1. `x += linear(x)` in training");
    let vs = nn::VarStore::new(CPU);
    let net = shape.layers(&vs, true);
    let x0 = shape.input();

    let mut x = x0.copy();
    for (i, layer) in net.iter().enumerate() {
        let fx = layer.forward(&x);
        let mut guard = VersionGuard::new();
        guard.track(format!("input of layer {i}"), &x)?;
        x += fx;
        if i == 0 {
            let at_call_site = guard.verify().err();
            let at_call_site = at_call_site.ok_or_else(|| anyhow!("the guard saw nothing"))?;
            println!("  VersionGuard right after the `+=`: {at_call_site}");
        }
    }
    let at_backward = x.sum(Kind::Float).f_backward().err();
    let at_backward = at_backward.ok_or_else(|| anyhow!("backward unexpectedly worked"))?;
    println!("  backward fails: {}", first_line(at_backward));
    clear_gradients(&vs)?;

    let mut x = x0.shallow_clone();
    for layer in &net {
        x = &x + layer.forward(&x);
    }
    x.sum(Kind::Float).f_backward()?;
    let expected = gradients(&vs);
    clear_gradients(&vs)?;

    reset_stats();
    let mut x = x0.shallow_clone();
    for layer in &net {
        let fx = layer.forward(&x);
        x = f_residual_add(x, &fx)?;
    }
    let counted = stats();
    x.sum(Kind::Float).f_backward()?;
    println!(
        "  residual_add: {counted} (linear saved x, so it copies); gradients identical to \
         `x = x + linear(x)`: {}",
        identical(&gradients(&vs), &expected)
    );
    Ok(())
}

fn claim_2(shape: &Shape) -> Result<()> {
    println!("\n2. `torch.add(x, linear(x), out=x)` while something requires grad");
    let vs = nn::VarStore::new(CPU);
    let layer = nn::linear(vs.root(), shape.hidden, shape.hidden, Default::default());
    let x = shape.input();
    let fx = layer.forward(&x);
    match x.f_add_out(&x, &fx) {
        Ok(_) => println!("  unexpectedly worked"),
        Err(e) => println!("  fails at once: {}", first_line(e)),
    }
    Ok(())
}

fn claim_3(shape: &Shape) -> Result<()> {
    println!("\n3. residual layers under no_grad (input kept by the caller)");
    let act = shape.activation_bytes();
    let vs = nn::VarStore::new(CPU);
    let net = shape.layers(&vs, true);
    let x0 = shape.input();
    for depth in 1..=shape.layers {
        for helper in [false, true] {
            reset_stats();
            let (_, m) = measure(CPU, |_| {
                tch::no_grad(|| -> Result<Tensor> {
                    let mut x = x0.shallow_clone();
                    for layer in &net[..depth] {
                        let fx = layer.forward(&x);
                        x = if helper {
                            f_residual_add(x, &fx)?
                        } else {
                            &x + fx
                        };
                    }
                    Ok(x)
                })
            });
            let label = if helper {
                format!(
                    "depth {depth}, residual_add ({} in place)",
                    stats().in_place
                )
            } else {
                format!("depth {depth}, x = x + f(x)")
            };
            row(&label, &m, act);
        }
    }
    Ok(())
}

/// Linear then relu (`f_relu` or out of place), optionally with `sigmoid` in between.
fn linear_relu(net: &[nn::Linear], x0: &Tensor, helper: bool, sigmoid: bool) -> Result<Tensor> {
    let mut x = x0.shallow_clone();
    for layer in net {
        let mut h = layer.forward(&x);
        if sigmoid {
            h = h.sigmoid();
        }
        x = if helper { f_relu(h)? } else { h.relu() };
    }
    Ok(x)
}

fn claim_4(shape: &Shape) -> Result<()> {
    println!("\n4. relu after linear in training, forward pass");
    let act = shape.activation_bytes();
    for (bias, sigmoid, note) in [
        (false, false, "linear without bias"),
        (
            true,
            false,
            "linear with bias (its 3-D output is a view that alone holds its base)",
        ),
        // exp saves its output too (tests/it/seed_claims.rs), but overflows at this size.
        (false, true, "linear, then sigmoid (saves its output)"),
    ] {
        let vs = nn::VarStore::new(CPU);
        let net = shape.layers(&vs, bias);
        let x0 = shape.input();
        println!("  {note}:");
        let mut grads = Vec::new();
        for helper in [false, true] {
            reset_stats();
            let (out, m) = measure(CPU, |_| linear_relu(&net, &x0, helper, sigmoid));
            let counted = stats();
            out?.sum(Kind::Float).f_backward()?;
            grads.push(gradients(&vs));
            clear_gradients(&vs)?;
            let label = if helper {
                format!("  relu ({} in place)", counted.in_place)
            } else {
                "  out of place".to_owned()
            };
            row(&label, &m, act);
        }
        println!(
            "    gradients identical: {}",
            identical(&grads[0], &grads[1])
        );
    }
    Ok(())
}

fn claim_5(shape: &Shape) -> Result<()> {
    println!("\n5. `del h; empty_cache()` while the graph holds h");
    let vs = nn::VarStore::new(CPU);
    let net = shape.layers(&vs, true);
    let start = memory_allocated(CPU);
    let x0 = shape.input();
    let h = net[0].forward(&x0);
    let y = net[1 % net.len()].forward(&h);
    let before = memory_allocated(CPU) - start;
    drop(h);
    empty_cache(CPU);
    let after = memory_allocated(CPU) - start;
    println!(
        "  allocated before drop(h) {}, after drop(h) + empty_cache() {}: freed {}",
        Bytes(before),
        Bytes(after),
        Bytes(before - after)
    );
    drop(y);
    println!(
        "  after dropping y (and with it the graph): {}",
        Bytes(memory_allocated(CPU) - start)
    );
    Ok(())
}

fn main() -> Result<()> {
    memsave_meter::install();
    let shape = Shape::from_args()?;
    println!(
        "shape [{}, {}, {}], {} layers; one activation = {}",
        shape.batch,
        shape.seq,
        shape.hidden,
        shape.layers,
        Bytes(shape.activation_bytes())
    );
    claim_1(&shape)?;
    claim_2(&shape)?;
    claim_3(&shape)?;
    claim_4(&shape)?;
    claim_5(&shape)?;
    Ok(())
}
