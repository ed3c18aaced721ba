//! Issue #25: `fit` on the zoo's ResNet-18 at half its plain step's peak: the step
//! couples samples (BatchNorm in training), so a split into micro-batches is never
//! offered as lossless; the choice's measured peak is within the budget; and the
//! parameters, buffers and random stream afterwards are bitwise what they were.
use memsave_fit::{fit, FitRequest};
use memsave_models::{Architecture, ResNetConfig, ZooWorkload};
use memsave_step::{f_step, StepConfig, Workload};
use tch::{Device, Kind, Tensor};

#[test]
fn fit_on_resnet18_keeps_the_model_and_never_calls_a_split_lossless() {
    memsave_meter::install();
    tch::manual_seed(0);
    let arch = Architecture::ResNet(ResNetConfig {
        depth: 18,
        classes: 5,
        image: [3, 32, 32],
    });
    let mut model = ZooWorkload::new("resnet18", &arch, 8, Device::Cpu).unwrap();
    let batch = model.batch(8).unwrap();
    let plain = f_step(
        &model,
        &batch,
        &StepConfig::baseline(),
        Device::Cpu,
        false,
        None,
    )
    .unwrap();
    let budget = plain.peak_bytes / 2;
    let params: Vec<Tensor> = model.parameters().iter().map(Tensor::copy).collect();
    let buffers: Vec<Tensor> = model.buffers().iter().map(Tensor::copy).collect();
    tch::manual_seed(7);
    let report = fit(&mut model, &FitRequest::new(budget)).unwrap();
    let after_fit = Tensor::randn([16], (Kind::Float, Device::Cpu));
    tch::manual_seed(7);
    let expected = Tensor::randn([16], (Kind::Float, Device::Cpu));
    assert!(after_fit.equal(&expected), "fit moved the random stream");
    for (i, (a, b)) in model.parameters().iter().zip(&params).enumerate() {
        assert!(a.equal(b), "parameter {i} changed");
    }
    for (i, (a, b)) in model.buffers().iter().zip(&buffers).enumerate() {
        assert!(a.equal(b), "buffer {i} changed");
    }
    assert!(report.sample_coupling_op.is_some(), "{}", report.to_text());
    let choice = &report.choice;
    assert!(
        choice.micro_batches == 1 || !choice.is_lossless(),
        "{}",
        report.to_text()
    );
    assert!(choice.is_lossless(), "{}", report.to_text());
    assert!(
        report.measured_peak_bytes <= budget,
        "measured {} over the budget {budget}",
        report.measured_peak_bytes
    );
}
