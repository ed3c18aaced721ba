//! Ops that couple the samples of a batch (issue #25: fit must not call micro-batching
//! lossless for a model with BatchNorm in training mode).
use memsave_sys::ops::sample_coupling_op;
use serial_test::parallel;
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};

#[test]
#[parallel]
fn batch_norm_in_training_mode_couples_samples_and_nothing_else_here_does() {
    let vs = nn::VarStore::new(Device::Cpu);
    for c in [1i64, 3, 8] {
        let x4 = Tensor::randn([2, c, 4, 4], (Kind::Float, Device::Cpu));
        let bn2 = nn::batch_norm2d(vs.root() / "bn2" / c, c, Default::default());
        let (_, op) = sample_coupling_op(|| bn2.forward_t(&x4, true)).unwrap();
        assert!(
            op.as_deref().is_some_and(|op| op.contains("batch_norm")),
            "c = {c}: {op:?}"
        );
        let (_, op) = sample_coupling_op(|| bn2.forward_t(&x4, false)).unwrap();
        assert_eq!(op, None, "evaluation mode, c = {c}");

        let x2 = Tensor::randn([5, c], (Kind::Float, Device::Cpu));
        let ln = nn::layer_norm(vs.root() / "ln" / c, vec![c], Default::default());
        let lin = nn::linear(vs.root() / "lin" / c, c, c, Default::default());
        let gn = nn::group_norm(vs.root() / "gn" / c, 1, c, Default::default());
        let (_, op) = sample_coupling_op(|| {
            let y = lin.forward(&ln.forward(&x2)).relu();
            gn.forward(&x4) + y.sum(Kind::Float)
        })
        .unwrap();
        assert_eq!(op, None, "linear, layer and group norm, c = {c}");
    }
    // A functional call with no running statistics trains too.
    let x = Tensor::randn([6, 4], (Kind::Float, Device::Cpu));
    let (_, op) = sample_coupling_op(|| {
        x.batch_norm(
            None::<Tensor>,
            None::<Tensor>,
            None::<Tensor>,
            None::<Tensor>,
            true,
            0.1,
            1e-5,
            false,
        )
    })
    .unwrap();
    assert!(op.is_some_and(|op| op.contains("batch_norm")));
}

#[test]
#[parallel]
fn recorders_nest_and_end_even_when_the_work_panics() {
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = nn::batch_norm1d(vs.root(), 3, Default::default());
    let x = Tensor::randn([4, 3], (Kind::Float, Device::Cpu));
    let ((_, inner), outer) =
        sample_coupling_op(|| sample_coupling_op(|| bn.forward_t(&x, true)).unwrap()).unwrap();
    assert!(inner.is_some_and(|op| op.contains("batch_norm")));
    assert_eq!(outer, None, "the innermost recorder sees the op");
    let panicked =
        std::panic::catch_unwind(|| sample_coupling_op(|| -> Tensor { panic!("work failed") }));
    assert!(panicked.is_err());
    let (_, op) = sample_coupling_op(|| bn.forward_t(&x, true)).unwrap();
    assert!(
        op.is_some_and(|op| op.contains("batch_norm")),
        "a new recorder works after a panic"
    );
}
