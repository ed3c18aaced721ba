//! Hook scopes left out of order (Trust II, item 1): a guard handles saves exactly while
//! it lives, whatever order guards are dropped in, and leaves nothing behind.
use memsave_hooks::{hooks_from_fn, HooksError, HooksGuard, SavedTensorHooks};
use proptest::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

fn counting() -> (Arc<AtomicUsize>, impl SavedTensorHooks) {
    let packs = Arc::new(AtomicUsize::new(0));
    let p = packs.clone();
    let hooks = hooks_from_fn(
        move |t: &Tensor| {
            p.fetch_add(1, Ordering::SeqCst);
            Ok(t.shallow_clone())
        },
        |t: &Tensor| Ok(t.shallow_clone()),
    );
    (packs, hooks)
}

/// One op that saves exactly one tensor (tanh saves its output).
fn save_one() {
    let x = Tensor::ones([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let _ = x.tanh();
}

fn counts(packs: &[Arc<AtomicUsize>]) -> Vec<usize> {
    packs.iter().map(|p| p.load(Ordering::SeqCst)).collect()
}

/// Two guards held as struct fields drop in declaration order: the outer one first.
struct TwoScopes {
    _outer: HooksGuard,
    _inner: HooksGuard,
}

#[test]
#[serial_test::parallel]
fn guards_dropped_outer_first_leave_no_hooks_on_the_thread() {
    let (outer_packs, outer) = counting();
    let (inner_packs, inner) = counting();
    let scopes = TwoScopes {
        _outer: HooksGuard::new(outer).unwrap(),
        _inner: HooksGuard::new(inner).unwrap(),
    };
    save_one();
    drop(scopes);
    for _ in 0..9 {
        save_one();
    }
    assert_eq!(counts(&[outer_packs, inner_packs]), vec![0, 1]);
}

#[test]
#[serial_test::parallel]
fn exit_out_of_order_reports_it_and_still_removes_the_scope() {
    let (outer_packs, outer) = counting();
    let (inner_packs, inner) = counting();
    let g1 = HooksGuard::new(outer).unwrap();
    let g2 = HooksGuard::new(inner).unwrap();
    let err = g1.exit().unwrap_err();
    assert!(matches!(err, HooksError::OutOfOrder(_)), "{err}");
    // The newer scope still handles saves while it lives...
    save_one();
    assert_eq!(
        counts(&[outer_packs.clone(), inner_packs.clone()]),
        vec![0, 1]
    );
    g2.exit().unwrap();
    // ...and once it is gone, neither does: the outer one was removed by its exit.
    save_one();
    save_one();
    assert_eq!(counts(&[outer_packs, inner_packs]), vec![0, 1]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Any number of guards dropped in any order: after each drop, one save goes to the
    /// newest guard still alive (none once all are gone).
    #[test]
    #[serial_test::parallel]
    fn the_newest_living_guard_handles_each_save_in_any_drop_order(
        order in (1usize..7).prop_flat_map(|n| Just((0..n).collect::<Vec<_>>()).prop_shuffle()),
        use_exit in proptest::collection::vec(any::<bool>(), 7),
    ) {
        let n = order.len();
        let mut packs = Vec::new();
        let mut guards: Vec<Option<HooksGuard>> = Vec::new();
        for _ in 0..n {
            let (p, h) = counting();
            packs.push(p);
            guards.push(Some(HooksGuard::new(h).unwrap()));
        }
        let mut expected = vec![0usize; n];
        for &i in &order {
            let guard = guards[i].take().unwrap();
            if use_exit[i] {
                let newer_alive = guards[i + 1..].iter().any(Option::is_some);
                let result = guard.exit();
                prop_assert_eq!(result.is_err(), newer_alive);
            } else {
                drop(guard);
            }
            save_one();
            if let Some(newest) = (0..n).rev().find(|&j| guards[j].is_some()) {
                expected[newest] += 1;
            }
            prop_assert_eq!(counts(&packs), expected.clone());
        }
        save_one();
        prop_assert_eq!(counts(&packs), expected);
    }
}
