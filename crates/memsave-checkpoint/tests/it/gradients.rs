//! Checkpointed gradients equal the plain baseline's, for every plan.
use crate::common::*;
use memsave_checkpoint::Plan;
use proptest::prelude::*;
use serial_test::serial;
use tch::nn;
use tch::Device;

fn plan_strategy(depth: usize) -> impl Strategy<Value = Plan> {
    prop_oneof![
        Just(Plan::None),
        Just(Plan::EveryLayer),
        (1..=depth).prop_map(Plan::Segments),
        Just(Plan::Nested),
    ]
}

fn case_strategy() -> impl Strategy<Value = (usize, i64, i64, Plan, bool, u64)> {
    (1usize..=16).prop_flat_map(|depth| {
        (
            Just(depth),
            2i64..=12,
            1i64..=4,
            plan_strategy(depth),
            any::<bool>(),
            0u64..1000,
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    #[serial]
    fn plans_give_the_baseline_gradients((depth, width, batch, plan, dropout, seed) in case_strategy()) {
        let vs = nn::VarStore::new(Device::Cpu);
        let mut seq = residual_net(&vs, depth, width, if dropout { 0.3 } else { 0.0 });
        let x = rand(&[batch, width]).set_requires_grad(true);

        tch::manual_seed(seed as i64);
        let mut baseline = step_grads(&seq, &vs, &x);
        baseline.push(x.grad().copy());
        let _ = x.grad().zero_();

        seq.set_plan(plan).unwrap();
        tch::manual_seed(seed as i64);
        let mut planned = step_grads(&seq, &vs, &x);
        planned.push(x.grad().copy());

        let diff = max_rel_diff(&baseline, &planned);
        prop_assert!(diff <= 1e-6, "plan {plan} depth {depth}: relative difference {diff}");
    }
}
