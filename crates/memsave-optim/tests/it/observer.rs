//! What an optimizer shows its observer: every gradient it reads, and each parameter's
//! state tensors while they are in memory (also when they live on disk between steps
//! or are created inside backward).

use crate::common::net;
use memsave_optim::{AdamW, AdamWConfig, Observer, Options, Placement, State};
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// What the observer saw: `(index, gradient's address)` and `(index, bytes of state)`.
#[derive(Default)]
struct Seen {
    gradients: Mutex<Vec<(usize, usize)>>,
    states: Mutex<Vec<(usize, u64)>>,
}

impl Observer for Seen {
    fn gradient(&self, index: usize, grad: &Tensor) {
        self.gradients
            .lock()
            .unwrap()
            .push((index, grad.data_ptr() as usize));
    }

    fn state(&self, index: usize, tensors: &[Tensor]) {
        let bytes = tensors
            .iter()
            .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
            .sum();
        self.states.lock().unwrap().push((index, bytes));
    }
}

fn bytes(tensors: &[Tensor]) -> u64 {
    tensors
        .iter()
        .map(|t| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}

/// The net's parameters: l1 8 -> 33, l2 33 -> 17, l3 17 -> 2 (weights, then biases).
const NUMELS: [u64; 6] = [33 * 8, 33, 17 * 33, 17, 2 * 17, 2];

#[test]
#[serial_test::parallel]
fn state_on_the_device_is_listed_and_shown_once_per_update() {
    let model = net(3);
    let params = model.params();
    let numels: Vec<u64> = params.iter().map(|p| p.numel() as u64).collect();
    let mut sorted = numels.clone();
    sorted.sort_unstable();
    let mut expected = NUMELS.to_vec();
    expected.sort_unstable();
    assert_eq!(sorted, expected);
    let mut opt = AdamW::new(&params, AdamWConfig::default()).unwrap();
    assert!(
        opt.state_tensors().is_empty(),
        "no state before the first step"
    );
    let seen = Arc::new(Seen::default());
    opt.set_observer(Some(seen.clone()));
    model.backward(0);
    let grads: Vec<usize> = params
        .iter()
        .map(|p| p.grad().data_ptr() as usize)
        .collect();
    opt.step();
    // Two f32 moments per value.
    let total: u64 = NUMELS.iter().sum::<u64>() * 2 * 4;
    assert_eq!(bytes(&opt.state_tensors()), total);
    assert_eq!(opt.state_bytes(), total);
    let gradients = seen.gradients.lock().unwrap().clone();
    assert_eq!(gradients, grads.into_iter().enumerate().collect::<Vec<_>>());
    let states = seen.states.lock().unwrap().clone();
    let per_param: Vec<(usize, u64)> = numels.iter().map(|n| n * 2 * 4).enumerate().collect();
    assert_eq!(
        states, per_param,
        "once per parameter: the state stays where it is"
    );
    opt.set_observer(None);
    model.backward(1);
    opt.step();
    assert_eq!(seen.states.lock().unwrap().len(), params.len());
}

#[test]
#[serial_test::parallel]
fn state_on_disk_is_shown_while_in_memory_and_gradients_inside_backward() {
    let dir = tempfile::tempdir().unwrap();
    let model = net(4);
    let params = model.params();
    let options = Options {
        state: State::Int8Blockwise { block: 16 },
        placement: Placement::Disk(dir.path().to_path_buf()),
        ..Default::default()
    };
    let mut opt = AdamW::with_options(&params, AdamWConfig::default(), options).unwrap();
    let seen = Arc::new(Seen::default());
    opt.set_observer(Some(seen.clone()));
    let fused = opt.step_in_backward(&params).unwrap();
    for step in 0..2 {
        model.loss(step).backward();
    }
    assert!(
        fused.optimizer().state_tensors().is_empty(),
        "on disk between steps"
    );
    assert_eq!(fused.optimizer().state_bytes(), 0);
    // Each step shows every gradient once, from inside backward (freed right after).
    let gradients = seen.gradients.lock().unwrap().clone();
    assert_eq!(gradients.len(), 2 * params.len());
    assert!(params.iter().all(|p| !p.grad().defined()));
    // Each update shows the parameter's state: two buffers of one code byte per value
    // and one f32 scale per 16 values.
    let mut states = seen.states.lock().unwrap().clone();
    states.sort_unstable();
    let mut expected: Vec<(usize, u64)> = params
        .iter()
        .map(|p| p.numel() as u64)
        .map(|n| 2 * (n + 4 * n.div_ceil(16)))
        .enumerate()
        .flat_map(|e| [e, e])
        .collect();
    expected.sort_unstable();
    assert_eq!(states, expected);
}
