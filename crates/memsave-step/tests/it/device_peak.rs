//! A step's reported peak is the device's: `device_peak_bytes` equals the meter's
//! absolute maximum during the step (`max_memory_allocated` after a reset), not a
//! difference from the step's start; and what the step began with (the parameters,
//! the input, the optimizer's state) is in it.
use crate::common::Mlp;
use memsave_step::optimizer::CaseOptimizer;
use memsave_step::step::f_step_with;
use memsave_step::{OptimizerSpec, StepConfig, Workload};
use serial_test::serial;
use tch::{Device, Kind, Tensor};

#[test]
#[serial]
fn a_step_s_device_peak_is_the_meter_s_absolute_maximum_during_it() {
    memsave_meter::install();
    let model = Mlp::new(3, 64, 8, 16);
    let params = model.parameters();
    let parameter_bytes: u64 = params.iter().map(|p| p.numel() as u64 * 4).sum();
    let mut adamw = CaseOptimizer::build(&OptimizerSpec::default(), &params).unwrap();
    // Something else the process holds: counted by the device, not by the step.
    let other = Tensor::zeros([1000], (Kind::Float, Device::Cpu));
    let x = model.batch(8).unwrap();
    let mut offloaded = StepConfig::baseline();
    offloaded.offload_grads = Some(memsave_step::GradsAfter::Restored);
    for (i, config) in [StepConfig::baseline(), StepConfig::baseline(), offloaded]
        .iter()
        .enumerate()
    {
        memsave_meter::reset_peak_memory_stats(Device::Cpu);
        let m = f_step_with(
            &model,
            &x,
            config,
            Device::Cpu,
            false,
            None,
            Some(&mut adamw),
        )
        .unwrap();
        let max = memsave_meter::max_memory_allocated(Device::Cpu);
        assert_eq!(m.device_peak_bytes(), max, "step {i}");
        // The parameters, the tensor held besides them and (after the first step)
        // AdamW's two moments were there before the step began, so they are in the
        // peak; `peak_bytes` alone leaves them out.
        let before = parameter_bytes + 4000 + if i == 0 { 0 } else { 2 * parameter_bytes };
        assert!(
            m.start_bytes >= before,
            "step {i}: {} < {before}",
            m.start_bytes
        );
    }
    drop(other);
}
