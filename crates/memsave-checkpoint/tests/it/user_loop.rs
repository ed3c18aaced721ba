//! `checkpoint` in a user's own training loop: blocks that lock a `Mutex` across their
//! forward (the way to share a tch module with a `Send + 'static` closure) or hand work
//! to a thread and join it stay correct over several steps, and a block that panics
//! fails its step with an error naming it and leaves the next step running.
use memsave_checkpoint::{checkpoint, Checkpoint};
use memsave_meter::memory_allocated;
use serial_test::serial;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

const CPU: Device = Device::Cpu;

/// Residual blocks `x + gelu(linear(x))` whose linears sit behind mutexes.
fn locked_blocks(vs: &nn::VarStore, n: usize, h: i64) -> Vec<Arc<Mutex<nn::Linear>>> {
    (0..n)
        .map(|i| {
            let lin = nn::linear(vs.root() / i, h, h, Default::default());
            Arc::new(Mutex::new(lin))
        })
        .collect()
}

/// One step's gradients, each block run through `block`.
fn grads(
    vs: &nn::VarStore,
    x: &Tensor,
    blocks: &[Arc<Mutex<nn::Linear>>],
    block: &dyn Fn(&Tensor, Arc<Mutex<nn::Linear>>) -> Tensor,
) -> Vec<Tensor> {
    for v in vs.trainable_variables() {
        let mut g = v.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
    let mut h = x.shallow_clone();
    for b in blocks {
        h = block(&h, Arc::clone(b));
    }
    h.square().mean(Kind::Float).backward();
    vs.trainable_variables()
        .iter()
        .map(|v| v.grad().copy())
        .collect()
}

/// Four blocks, each holding its lock across its forward (the gelu, the last op that
/// saves a tensor, runs under the guard), over three steps: with early stop on by
/// default, every recomputation unwound through the guard and poisoned all four locks
/// after the first step, and the second step panicked on `lock().unwrap()`.
#[test]
#[serial]
fn a_block_that_locks_a_mutex_across_its_forward_is_never_poisoned() {
    tch::manual_seed(0);
    let vs = nn::VarStore::new(CPU);
    let blocks = locked_blocks(&vs, 4, 16);
    let x = Tensor::rand([8, 16], (Kind::Float, CPU));
    let plain = grads(&vs, &x, &blocks, &|h, lin| {
        let lin = lin.lock().unwrap();
        h + lin.forward(h).gelu("none")
    });
    for step in 0..3 {
        let got = grads(&vs, &x, &blocks, &|h, lin| {
            checkpoint(&[h], move |xs| {
                let lin = lin.lock().unwrap();
                vec![&xs[0] + lin.forward(&xs[0]).gelu("none")]
            })
            .unwrap()
            .remove(0)
        });
        let poisoned = blocks.iter().filter(|b| b.is_poisoned()).count();
        assert_eq!(poisoned, 0, "step {step}: {poisoned} of 4 locks poisoned");
        for (p, g) in plain.iter().zip(&got) {
            assert_eq!(p, g, "step {step}");
        }
    }
}

/// A block that hands work to a thread, then joins it: the worker waits for a message
/// the block sends after its last saving op, and counts the runs it served. Each
/// forward and each recomputation joins its worker, so after backward the count is 2.
/// With early stop, the recomputation unwound before the send and the join, and the
/// worker was left behind (the count stayed 1, 3 of 3 recomputations).
#[test]
#[serial]
fn a_thread_started_and_joined_inside_a_block_is_joined() {
    for n in [1i64, 5, 64] {
        let x = Tensor::rand([n], (Kind::Float, CPU)).set_requires_grad(true);
        let served = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&served);
        let y = checkpoint(&[&x], move |xs| {
            let (send, receive) = mpsc::channel::<()>();
            let counter = Arc::clone(&counter);
            let worker = std::thread::spawn(move || {
                if receive.recv().is_ok() {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            });
            // sin saves x, cos saves sin(x): the last tensor backward needs.
            let h = xs[0].sin().cos();
            send.send(()).unwrap();
            worker.join().unwrap();
            vec![h + 1.0]
        })
        .unwrap();
        assert_eq!(served.load(Ordering::SeqCst), 1);
        y[0].sum(Kind::Float).backward();
        assert_eq!(served.load(Ordering::SeqCst), 2, "n = {n}");
        let expected = -x.detach().sin().sin() * x.detach().cos();
        assert!(x.grad().allclose(&expected, 1e-6, 1e-6, false), "n = {n}");
    }
}

/// Opting in to early stop still stops: the op after the last saving one runs once.
#[test]
#[serial]
fn early_stop_is_an_opt_in() {
    for (early_stop, runs) in [(false, 2), (true, 1)] {
        let x = Tensor::rand([4], (Kind::Float, CPU)).set_requires_grad(true);
        let after = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&after);
        let y = Checkpoint::new()
            .early_stop(early_stop)
            .run(&[&x], move |xs| {
                let h = xs[0].sin().cos();
                counter.fetch_add(1, Ordering::SeqCst);
                vec![h + 1.0]
            })
            .unwrap();
        y[0].sum(Kind::Float).backward();
        assert_eq!(
            after.load(Ordering::SeqCst),
            runs,
            "early_stop {early_stop}"
        );
    }
}

/// A block that panics on its own in the recomputation (not a stop): the backward
/// fails with an error naming where the block was checkpointed, the graph is freed
/// when its tensors are, the block's lock (taken around its layer call) is not
/// poisoned, and the next step gives the plain gradients.
#[test]
#[serial]
fn a_block_that_panics_fails_its_step_naming_it_and_the_next_step_runs() {
    tch::manual_seed(1);
    let vs = nn::VarStore::new(CPU);
    let lin = locked_blocks(&vs, 1, 8).remove(0);
    let x = Tensor::rand([4, 8], (Kind::Float, CPU));
    let calls = Arc::new(AtomicUsize::new(0));
    let start = memory_allocated(CPU);
    let block = |lin: Arc<Mutex<nn::Linear>>, calls: Arc<AtomicUsize>| {
        move |xs: &[Tensor]| {
            let y = lin.lock().unwrap().forward(&xs[0]);
            if calls.fetch_add(1, Ordering::SeqCst) == 1 {
                panic!("block broke");
            }
            vec![y.gelu("none")]
        }
    };
    let line = line!() + 1;
    let y = checkpoint(&[&x], block(Arc::clone(&lin), Arc::clone(&calls))).unwrap();
    let err = y[0].sum(Kind::Float).f_backward().unwrap_err().to_string();
    let at = format!("checkpointed at {}:{line}:", file!());
    assert!(err.contains(&at), "{err}");
    assert!(
        err.contains("recomputation") && err.contains("block broke"),
        "{err}"
    );
    drop(y);
    assert!(!lin.is_poisoned());
    // Only the gradients the failed backward had already accumulated remain.
    let grads: u64 = vs
        .trainable_variables()
        .iter()
        .map(|v| v.grad())
        .filter(|g| g.defined())
        .map(|g| (g.numel() * 4) as u64)
        .sum();
    assert_eq!(memory_allocated(CPU), start + grads);

    let plain = {
        let lin = lin.lock().unwrap();
        lin.forward(&x).gelu("none").sum(Kind::Float).backward();
        vs.trainable_variables()
            .iter()
            .map(|v| v.grad().copy())
            .collect::<Vec<_>>()
    };
    for v in vs.trainable_variables() {
        let _ = v.grad().zero_();
    }
    let y = checkpoint(&[&x], block(Arc::clone(&lin), calls)).unwrap();
    y[0].sum(Kind::Float).backward();
    for (p, v) in plain.iter().zip(vs.trainable_variables()) {
        assert_eq!(p, &v.grad());
    }
}
