//! `ZooWorkload`'s layers as ZeRO-3 units: the parameters each layer uses, found by
//! running it (every parameter in exactly one layer of a chain; a tied head's weight in
//! two), and a wrapper every layer's forward runs through.
use memsave_models::{Architecture, LlamaConfig, ResNetConfig, UNetConfig, ZooWorkload};
use memsave_step::{LayerWrapper, Workload};
use serial_test::serial;
use std::sync::{Arc, Mutex};
use tch::{Device, Tensor};

/// How many of `layers` name each of `params`.
fn owners(layers: &[Vec<Tensor>], params: &[Tensor]) -> Vec<usize> {
    params
        .iter()
        .map(|p| {
            layers
                .iter()
                .flatten()
                .filter(|q| q.data_ptr() == p.data_ptr())
                .count()
        })
        .collect()
}

#[test]
#[serial]
fn a_chain_names_every_parameter_in_one_layer_and_runs_each_through_the_wrapper() {
    tch::manual_seed(0);
    let arch = Architecture::ResNet(ResNetConfig {
        depth: 18,
        classes: 4,
        image: [3, 32, 32],
    });
    let model = ZooWorkload::new("resnet", &arch, 2, Device::Cpu).unwrap();
    let stats: Vec<Tensor> = model.buffers().iter().map(Tensor::copy).collect();
    let layers = model.layer_parameters().unwrap().expect("a chain's layers");
    assert_eq!(layers.len(), model.layers().len());
    // The stem (conv1, bn1), 8 basic blocks, the head (fc).
    assert_eq!(layers[0].len(), 3);
    assert_eq!(layers.last().unwrap().len(), 2);
    assert!(layers.iter().all(|l| !l.is_empty()));
    let params = model.parameters();
    assert!(owners(&layers, &params).iter().all(|&n| n == 1));
    // Nothing was left in the gradients, and BatchNorm's statistics did not move.
    assert!(params.iter().all(|p| !p.grad().defined()));
    assert!(!stats.is_empty());
    assert!(model
        .buffers()
        .iter()
        .zip(&stats)
        .all(|(now, before)| now.equal(before)));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let wrapper: LayerWrapper = Arc::new(move |i, forward: &mut dyn FnMut() -> Tensor| {
        log.lock().unwrap().push(i);
        forward()
    });
    assert!(model.set_layer_wrapper(Some(wrapper)));
    let x = model.batch(2).unwrap();
    let _ = model.layers().f_forward_t(&x.input, false).unwrap();
    let n = model.layers().len();
    assert_eq!(*seen.lock().unwrap(), (0..n).collect::<Vec<_>>());
    model.set_layer_wrapper(None);
}

#[test]
#[serial]
fn a_tied_head_is_in_two_layers_and_a_network_of_blocks_gives_none() {
    tch::manual_seed(0);
    let tied = Architecture::Llama(LlamaConfig {
        vocab: 64,
        dim: 16,
        layers: 1,
        heads: 2,
        kv_heads: 2,
        seq: 8,
        tied: true,
        ..LlamaConfig::default()
    });
    let model = ZooWorkload::new("tied", &tied, 2, Device::Cpu).unwrap();
    let layers = model.layer_parameters().unwrap().expect("a chain's layers");
    let params = model.parameters();
    let counts = owners(&layers, &params);
    let embedding = params
        .iter()
        .position(|p| p.size() == [64, 16])
        .expect("the embedding");
    assert_eq!(counts[embedding], 2, "{counts:?}");
    assert!(counts
        .iter()
        .enumerate()
        .all(|(i, &n)| i == embedding || n == 1));
    let unet = Architecture::UNet(UNetConfig {
        image: [3, 16, 16],
        classes: 2,
        base: 4,
        levels: 2,
    });
    let model = ZooWorkload::new("unet", &unet, 2, Device::Cpu).unwrap();
    assert!(model.layer_parameters().unwrap().is_none());
}
