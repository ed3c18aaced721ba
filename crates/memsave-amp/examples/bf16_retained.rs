//! The seed network under bf16 autocast: bytes retained for backward after the forward,
//! f32 against bf16, measured with the meter and compared with the exact formulas.
//!
//! `cargo run --release -p memsave-amp --example bf16_retained [B S H L]`
//! (default: the seed's 50 100 512 10).
use memsave_amp::f_autocast;
use memsave_meter::{install, measure, Bytes};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn main() -> anyhow::Result<()> {
    install();
    let args: Vec<i64> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let [b, s, h, l] = match args.as_slice() {
        [] => [50, 100, 512, 10],
        [b, s, h, l] => [*b, *s, *h, *l],
        _ => anyhow::bail!("usage: bf16_retained [B S H L]"),
    };
    let dev = Device::Cpu;
    let vs = nn::VarStore::new(dev);
    let layers: Vec<nn::Linear> = (0..l)
        .map(|i| nn::linear(vs.root() / i, h, h, Default::default()))
        .collect();
    let x = Tensor::randn([b, s, h], (Kind::Float, dev));
    let forward = || {
        let mut y = x.shallow_clone();
        for layer in &layers {
            y = &y + layer.forward(&y);
        }
        y
    };

    let (out, f32_run) = measure(dev, |_| forward());
    drop(out);
    let (out, bf16_run) = measure(dev, |_| f_autocast(dev, Kind::BFloat16, forward));
    drop(out?);

    let activation = b * s * h;
    // f32: every layer saves its f32 input; inputs 1..L and the output are new tensors.
    let f32_formula = l * activation * 4;
    // bf16: every layer saves the bf16 cast of its input; the f32 sums are saved by
    // nobody and die, except the output. Layers 1..L also save the bf16 cast of their
    // weight (needed for the input's gradient); layer 0's input needs no gradient, so
    // its weight cast only lived in the autocast cache, cleared when the scope ended.
    let bf16_formula = l * activation * 2 + activation * 4 + (l - 1) * h * h * 2;
    println!("seed network [B,S,H]=[{b},{s},{h}], {l} layers of x = x + Linear(H,H)(x)");
    println!(
        "retained after forward, f32:            {:>12} = {:>11} bytes (formula L*BSH*4 = {f32_formula})",
        Bytes(f32_run.retained_bytes() as u64).to_string(),
        f32_run.retained_bytes()
    );
    println!(
        "retained after forward, bf16 autocast:  {:>12} = {:>11} bytes (formula L*BSH*2 + BSH*4 + (L-1)*H*H*2 = {bf16_formula})",
        Bytes(bf16_run.retained_bytes() as u64).to_string(),
        bf16_run.retained_bytes()
    );
    println!(
        "peak during forward, f32 / bf16:        {} / {}",
        Bytes(f32_run.peak_bytes),
        Bytes(bf16_run.peak_bytes)
    );
    Ok(())
}
