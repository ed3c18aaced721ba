//! `fit` on a chain plans its layers as blocks too (issue #35: the chain is the case
//! of a model of blocks whose blocks are its layers): next to the checkpoint solver's
//! schedule, a candidate that keeps, recomputes or offloads each layer on its own
//! (`Plan::PerLayer`). Such a candidate is predicted within 5% of what a trainer built
//! from it measures, stays within the budget, and trains bitwise as the plain chain.
use memsave_checkpoint::{BlockLever, CheckpointedSequential, Plan};
use memsave_fit::{fit, FitRequest};
use memsave_step::config::{PlanChoice, StepConfig};
use memsave_step::step::f_step;
use memsave_step::{Batch, Workload};
use serial_test::serial;
use tch::nn::{self, Module};
use tch::{Device, Kind, TchError, Tensor};

/// Six residual layers `x + sin(gelu(linear(x)))` of width 128 on 96 rows: each saves
/// three activations of its own, cheap to recompute.
struct Chain {
    vs: nn::VarStore,
    layers: CheckpointedSequential,
    data: Tensor,
}

impl Chain {
    fn new() -> Chain {
        tch::manual_seed(0);
        let vs = nn::VarStore::new(Device::Cpu);
        let mut layers = CheckpointedSequential::new();
        for i in 0..6 {
            let lin = nn::linear(vs.root() / i, 128, 128, Default::default());
            layers = layers.add_fn(move |x| x + lin.forward(x).gelu("none").sin());
        }
        Chain {
            vs,
            layers,
            data: Tensor::randn([96, 128], (Kind::Float, Device::Cpu)),
        }
    }
}

impl Workload for Chain {
    fn name(&self) -> &str {
        "chain"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn layers(&self) -> &CheckpointedSequential {
        &self.layers
    }
    fn layers_mut(&mut self) -> &mut CheckpointedSequential {
        &mut self.layers
    }
    fn parameters(&self) -> Vec<Tensor> {
        self.vs.trainable_variables()
    }
    fn global_batch(&self) -> i64 {
        self.data.size()[0]
    }
    fn batch(&self, size: i64) -> Result<Batch, TchError> {
        Ok(Batch::input(self.data.f_narrow(0, 0, size)?))
    }
}

/// The peak of one whole-batch step under `plan`, as `fit` counts it (the whole device).
fn peak(model: &mut Chain, plan: Plan) -> u64 {
    let outside = crate::device::outside(&*model);
    let x = model.batch(model.global_batch()).unwrap();
    let mut config = StepConfig::baseline();
    config.plan = PlanChoice::Fixed(plan);
    memsave_step::plan::apply_plan(model, &x, &config, Device::Cpu).unwrap();
    let m = f_step(model, &x, &config, Device::Cpu, false, None).unwrap();
    memsave_accum::free_grads(&model.parameters()).unwrap();
    crate::device::peak(&m, &outside)
}

fn host(ts: &[Tensor]) -> Vec<Vec<f32>> {
    ts.iter()
        .map(|t| Vec::<f32>::try_from(t.flatten(0, -1)).unwrap())
        .collect()
}

#[test]
#[serial]
fn fit_plans_a_chain_layer_by_layer_and_its_per_layer_candidates_hold_as_predicted() {
    memsave_meter::install();
    let mut model = Chain::new();
    let kept = peak(&mut model, Plan::None);
    let every = peak(&mut model, Plan::EveryLayer);
    assert!(every < kept, "{every} vs {kept}");
    let budget = (kept + every) / 2;
    let report = fit(&mut model, &FitRequest::new(budget)).unwrap();
    let text = report.to_text();
    assert!(report.measured_peak_bytes <= budget, "{text}");
    assert_eq!(report.tries, 1, "{text}");
    // The layers as blocks: candidates with a lever per layer, keyed `layer i`.
    let per_layer: Vec<_> = report
        .candidates
        .iter()
        .filter(|c| c.choice.block_levers().is_some() && c.predicted_fits)
        .collect();
    assert!(
        !per_layer.is_empty(),
        "no fitting per-layer candidate\n{text}"
    );
    // Trained from the report, a fresh chain steps within the budget, as predicted,
    // and its weights after two SGD-free steps' gradients are the plain chain's.
    let plain = Chain::new();
    let x = plain.batch(96).unwrap();
    let mut config = StepConfig::baseline();
    config.plan = PlanChoice::Fixed(Plan::None);
    f_step(&plain, &x, &config, Device::Cpu, false, None).unwrap();
    let expected = host(
        &plain
            .parameters()
            .iter()
            .map(|p| p.grad())
            .collect::<Vec<_>>(),
    );
    for c in per_layer {
        let levers = c.choice.block_levers().unwrap();
        assert!(levers
            .iter()
            .all(|(k, l)| k.name.starts_with("layer ") && l.is_lossless()));
        assert!(
            levers.iter().any(|(_, l)| !matches!(l, BlockLever::Keep)),
            "{}",
            c.choice.strategy
        );
        let mut fresh = Chain::new();
        let outside = crate::device::outside(&fresh);
        let mut trainer = c.choice.trainer_builder(None).build(&mut fresh).unwrap();
        assert_eq!(trainer.model().layers().plan(), Plan::PerLayer);
        let m = trainer.step(&x).unwrap();
        let measured = crate::device::peak(&m, &outside);
        assert!(
            measured <= budget,
            "{}: {measured} > {budget}\n{text}",
            c.choice.strategy
        );
        let predicted = c.predicted_peak_bytes.unwrap();
        let error = predicted as f64 / measured as f64 - 1.0;
        assert!(
            error.abs() <= 0.05,
            "{}: {error:+.3}\n{text}",
            c.choice.strategy
        );
        let ran: Vec<String> = trainer
            .model()
            .layers()
            .blocks()
            .last_forward()
            .into_iter()
            .map(|r| r.lever)
            .collect();
        let chosen: Vec<String> = levers.iter().map(|(_, l)| l.name()).collect();
        assert_eq!(ran, chosen, "{}", c.choice.strategy);
        let grads = host(
            &trainer
                .model()
                .parameters()
                .iter()
                .map(|p| p.grad())
                .collect::<Vec<_>>(),
        );
        assert!(grads == expected, "{}: gradients differ", c.choice.strategy);
    }
}

/// A fit that fails leaves the chain as it found it: its schedule, not the last
/// candidate's levers per layer.
#[test]
#[serial]
fn a_fit_that_fails_leaves_the_chain_s_schedule_as_it_was() {
    memsave_meter::install();
    let mut model = Chain::new();
    let every = peak(&mut model, Plan::EveryLayer);
    model.layers_mut().set_plan(Plan::Segments(2)).unwrap();
    let before = model.layers().schedule().clone();
    // Below what every layer recomputed needs, above what any step holds before
    // building: fit searches (per layer too), then finds nothing.
    let Err(err) = fit(&mut model, &FitRequest::new(every / 2)) else {
        panic!("a configuration fits half of every layer recomputed");
    };
    // It searched: the error names the least memory it found.
    assert!(err.to_string().contains("the least memory found"), "{err}");
    assert_eq!(model.layers().schedule(), &before);
    assert_eq!(model.layers().plan(), Plan::Segments(2));
    // A schedule set by hand (the plan is left as it was), and levers per layer set
    // before any forward: both as they were.
    let every_layer = memsave_checkpoint::Schedule::every_layer(6);
    model
        .layers_mut()
        .set_schedule(every_layer.clone())
        .unwrap();
    let plan = model.layers().plan();
    assert!(fit(&mut model, &FitRequest::new(every / 2)).is_err());
    assert_eq!(model.layers().schedule(), &every_layer);
    assert_eq!(model.layers().plan(), plan);
    model.layers_mut().set_plan(Plan::PerLayer).unwrap();
    let key = memsave_checkpoint::BlockKey::new("layer 1", 0);
    model
        .layers()
        .blocks()
        .set(key.clone(), BlockLever::Recompute)
        .unwrap();
    assert!(fit(&mut model, &FitRequest::new(every / 2)).is_err());
    assert_eq!(model.layers().plan(), Plan::PerLayer);
    assert_eq!(model.layers().blocks().lever(&key).name(), "recompute");
}
