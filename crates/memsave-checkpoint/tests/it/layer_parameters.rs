//! `CheckpointedSequential::f_layer_parameters`: which parameters each layer of a chain
//! uses, found from each layer's output alone (ZeRO-3's units for a chain whose
//! variables are not named by layer).
use memsave_checkpoint::CheckpointedSequential;
use serial_test::parallel;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

#[test]
#[parallel]
fn each_layer_gets_the_parameters_its_output_depends_on() {
    let vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let a = nn::linear(&root / "a", 4, 4, Default::default());
    let b = nn::linear(&root / "b", 4, 4, Default::default());
    // A weight the last layer shares with the first (tied), and one no layer uses.
    let tied = a.ws.shallow_clone();
    let _unused = root.var("unused", &[3], nn::Init::Const(1.0));
    // Read without autograd: not found (the documented trap).
    let scale = root.var("scale", &[1], nn::Init::Const(2.0));
    let seq = CheckpointedSequential::new()
        .add_fn(move |x| a.forward(x).tanh())
        .add_fn(move |x| x * 3.0) // no parameter
        .add_fn(move |x| b.forward(x))
        .add_fn(move |x| x.matmul(&tied.tr()) * scale.detach());
    let x = Tensor::randn([2, 4], (Kind::Float, Device::Cpu));
    let mut params: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    params.sort_by(|p, q| p.0.cmp(&q.0));
    let (names, tensors): (Vec<String>, Vec<Tensor>) = params.into_iter().unzip();
    let lists = seq.f_layer_parameters(&x, &tensors, false).unwrap();
    let named: Vec<Vec<&str>> = lists
        .iter()
        .map(|list| {
            list.iter()
                .map(|t| {
                    let i = tensors
                        .iter()
                        .position(|p| p.data_ptr() == t.data_ptr())
                        .unwrap();
                    names[i].as_str()
                })
                .collect()
        })
        .collect();
    assert_eq!(
        named,
        vec![
            vec!["a.bias", "a.weight"],
            vec![],
            vec!["b.bias", "b.weight"],
            vec!["a.weight"],
        ]
    );
    // Nothing accumulated into the parameters' gradients.
    assert!(tensors.iter().all(|p| !p.grad().defined()));
}

#[test]
#[parallel]
fn a_panicking_layer_is_an_error_naming_it() {
    let seq = CheckpointedSequential::new()
        .add_fn(|x| x + 1.0)
        .add_fn(|_| panic!("broken layer"));
    let x = Tensor::zeros([2], (Kind::Float, Device::Cpu));
    let e = seq
        .f_layer_parameters(&x, &[], false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 1") && e.contains("broken layer"), "{e}");
}
