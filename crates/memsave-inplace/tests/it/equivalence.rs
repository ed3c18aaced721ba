//! Property: over random op sequences with random sharing (other handles, views,
//! detached aliases, tensors saved by autograd), the helpers give exactly the results
//! and gradients of plain out-of-place tch, and take the in-place path if and only if
//! the tensor is exclusive (for ops whose in-place form saves memory at all).
use memsave_inplace::{
    f_add, f_clamp, f_dropout, f_gelu, f_mul, f_relu, f_residual_add, is_exclusive, stats,
};
use proptest::prelude::*;
use serial_test::serial;
use tch::{Device, Kind, Tensor};

const F32: (Kind, Device) = (Kind::Float, Device::Cpu);

/// What else comes to hold the running tensor before the next op.
#[derive(Debug, Clone, Copy)]
enum Share {
    Nothing,
    ShallowClone,
    View,
    Detach,
    /// `t.matmul(weight)` with a weight that requires grad: saves `t` in grad mode only.
    SavedByMatmul,
    /// `t` is replaced by a view of itself; its base is held by the view alone.
    BecomeView,
}

/// The shape of the second operand of `add`/`mul`; each broadcasts into `[3, 4]`.
#[derive(Debug, Clone, Copy)]
enum Operand {
    Full,
    Row,
    One,
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Add(Operand),
    Mul(Operand),
    Relu,
    Gelu,
    Dropout,
    Clamp,
    /// `t + t.matmul(weight)`: the matmul saves `t` in grad mode.
    Residual,
    /// A plain `sigmoid` (no helper): it saves its output in grad mode.
    Sigmoid,
}

impl Op {
    fn is_helper(self) -> bool {
        !matches!(self, Op::Sigmoid)
    }

    /// Whether the in-place form saves memory at all (`gelu_` and `clamp_` make
    /// autograd save a copy of the input in grad mode).
    fn in_place_saves_memory(self, grad: bool) -> bool {
        !(grad && matches!(self, Op::Gelu | Op::Clamp))
    }

    /// Whether autograd saves this op's output, making the next tensor shared.
    fn saves_output(self, grad: bool) -> bool {
        grad && matches!(self, Op::Relu | Op::Sigmoid)
    }
}

fn share() -> impl Strategy<Value = Share> {
    prop_oneof![
        3 => Just(Share::Nothing),
        1 => Just(Share::ShallowClone),
        1 => Just(Share::View),
        1 => Just(Share::Detach),
        1 => Just(Share::SavedByMatmul),
        1 => Just(Share::BecomeView),
    ]
}

fn operand() -> impl Strategy<Value = Operand> {
    prop_oneof![Just(Operand::Full), Just(Operand::Row), Just(Operand::One)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        operand().prop_map(Op::Add),
        operand().prop_map(Op::Mul),
        Just(Op::Relu),
        Just(Op::Gelu),
        Just(Op::Dropout),
        Just(Op::Clamp),
        Just(Op::Residual),
        Just(Op::Sigmoid),
    ]
}

/// What one run produced: the output, the gradients (empty without grad) and, for each
/// helper call, (the model says exclusive, is_exclusive says so, the in-place path ran).
struct Run {
    output: Tensor,
    gradients: Vec<Tensor>,
    decisions: Vec<(bool, bool, bool)>,
}

fn run(helpers: bool, grad: bool, seed: i64, steps: &[(Share, Op)]) -> Run {
    tch::manual_seed(seed);
    let w = Tensor::randn([3, 4], F32).set_requires_grad(true);
    let weight = Tensor::randn([4, 4], F32).set_requires_grad(true);
    let full = Tensor::randn([3, 4], F32);
    let row = Tensor::randn([4], F32);
    let one = Tensor::randn([1], F32);
    let guard = (!grad).then(tch::no_grad_guard);
    let mut t = &w * 1.0;
    let mut shared = false;
    let mut keep = Vec::new();
    let mut decisions = Vec::new();
    for &(share, op) in steps {
        match share {
            Share::Nothing => {}
            Share::ShallowClone => keep.push(t.shallow_clone()),
            Share::View => keep.push(t.narrow(0, 0, 1)),
            Share::Detach => keep.push(t.detach()),
            Share::SavedByMatmul => keep.push(t.matmul(&weight)),
            Share::BecomeView => t = t.view([3, 4]),
        }
        shared |= match share {
            // The old `t` lives on only as the new view's base: nobody else holds it.
            Share::Nothing | Share::BecomeView => false,
            Share::SavedByMatmul => grad,
            _ => true,
        };
        let operand = |o| match o {
            Operand::Full => &full,
            Operand::Row => &row,
            Operand::One => &one,
        };
        if helpers && op.is_helper() {
            let saved_by_residual = matches!(op, Op::Residual) && grad;
            let model_exclusive = !shared && !saved_by_residual;
            let before = stats();
            let ptr = t.data_ptr();
            let (next, exclusive) = match op {
                Op::Residual => {
                    let fx = t.matmul(&weight);
                    let exclusive = is_exclusive(&t).unwrap();
                    (f_residual_add(t, &fx).unwrap(), exclusive)
                }
                _ => {
                    let exclusive = is_exclusive(&t).unwrap();
                    let next = match op {
                        Op::Add(o) => f_add(t, operand(o)),
                        Op::Mul(o) => f_mul(t, operand(o)),
                        Op::Relu => f_relu(t),
                        Op::Gelu => f_gelu(t, "none"),
                        Op::Dropout => f_dropout(t, 0.5, true),
                        Op::Clamp => f_clamp(t, -0.5, 0.5),
                        Op::Residual | Op::Sigmoid => unreachable!("handled above"),
                    };
                    (next.unwrap(), exclusive)
                }
            };
            t = next;
            let counted = stats().since(&before);
            let in_place = counted.in_place == 1;
            assert_eq!(counted.in_place + counted.copied, 1);
            assert_eq!(in_place, t.data_ptr() == ptr);
            let expected = model_exclusive && op.in_place_saves_memory(grad);
            decisions.push((
                expected,
                exclusive && op.in_place_saves_memory(grad),
                in_place,
            ));
        } else {
            t = match op {
                Op::Add(o) => &t + operand(o),
                Op::Mul(o) => &t * operand(o),
                Op::Relu => t.relu(),
                Op::Gelu => t.gelu("none"),
                Op::Dropout => t.dropout(0.5, true),
                Op::Clamp => t.clamp(-0.5, 0.5),
                Op::Residual => &t + t.matmul(&weight),
                Op::Sigmoid => t.sigmoid(),
            };
        }
        shared = op.saves_output(grad);
    }
    drop(guard);
    let mut gradients = Vec::new();
    if grad {
        (&t * &t).sum(Kind::Float).backward();
        gradients.push(w.grad());
        gradients.push(weight.grad());
    }
    Run {
        output: t.detach(),
        gradients,
        decisions,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    #[serial]
    fn helpers_match_out_of_place_and_go_in_place_iff_exclusive(
        grad in any::<bool>(),
        seed in 0i64..10_000,
        steps in prop::collection::vec((share(), op()), 1..10),
    ) {
        let plain = run(false, grad, seed, &steps);
        let helped = run(true, grad, seed, &steps);
        prop_assert!(helped.output.equal(&plain.output));
        prop_assert_eq!(helped.gradients.len(), plain.gradients.len());
        for (h, p) in helped.gradients.iter().zip(&plain.gradients) {
            prop_assert_eq!(h.defined(), p.defined());
            if p.defined() {
                prop_assert!(h.equal(p));
            }
        }
        for (i, &(model, observed, in_place)) in helped.decisions.iter().enumerate() {
            prop_assert_eq!(model, observed, "step {}: the model of who holds t disagrees with is_exclusive", i);
            prop_assert_eq!(in_place, model, "step {}: in place iff exclusive", i);
        }
    }
}
