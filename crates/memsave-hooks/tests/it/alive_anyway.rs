//! What stays alive anyway is never packed: constants (tensors without a grad_fn that
//! outlive the step) from the second step on, while what the forward makes and drops
//! (a noise mask, a fresh batch) is packed in every step; and `check` counts the saves
//! of what is always kept when it looks for the ops `keep_ops` names.
use memsave_hooks::{
    saved_tensors_hooks, Codec, Compress, DiskOffload, Kept, PolicyError, SavePolicy,
    SavedTensorHooks,
};
use tch::{Device, Kind, Tensor};

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);
const ROWS: i64 = 32;
const COLS: i64 = 64;
/// Bytes of one `[ROWS, COLS]` f32 tensor.
const T: u64 = (ROWS * COLS * 4) as u64;

/// `tanh(x.mm(w) * table * noise)`: mm saves the batch `x` (not `w`: `x` needs no
/// gradient),
/// the first mul the constant `table`, the second the `noise` the forward draws, tanh
/// its output.
fn forward(x: &Tensor, w: &Tensor, table: &Tensor) -> Tensor {
    let noise = Tensor::rand([ROWS, COLS], CPU);
    (x.mm(w) * table * noise).tanh().sum(Kind::Float)
}

/// One step under `hooks`, the writes waited for; backward run.
fn step<H: SavedTensorHooks + Clone>(hooks: &H, x: &Tensor, w: &Tensor, table: &Tensor) {
    let loss = saved_tensors_hooks(hooks.clone(), || forward(x, w, table)).unwrap();
    loss.backward();
}

/// A table held across steps is written in the first step only (a constant from the
/// second on), with a store made fresh for each step (as memsave-step does) or one
/// kept; the noise and a fresh batch are written in every step, a batch refilled in
/// place only in the first.
#[test]
#[serial_test::parallel]
fn a_constant_is_written_in_the_first_step_only_and_what_the_forward_makes_always() {
    let dir = tempfile::tempdir().unwrap();
    for (fresh_store, refilled_batch) in [(true, false), (false, false), (true, true)] {
        let w = Tensor::randn([COLS, COLS], CPU).set_requires_grad(true);
        let table = Tensor::randn([ROWS, COLS], CPU);
        let x = Tensor::randn([ROWS, COLS], CPU);
        let mut kept_store = DiskOffload::new(dir.path()).unwrap().synchronous(true);
        let mut before = kept_store.stats();
        for step_no in 0..3 {
            let x = if refilled_batch {
                x.shallow_clone().copy_(&Tensor::randn([ROWS, COLS], CPU));
                x.shallow_clone()
            } else {
                Tensor::randn([ROWS, COLS], CPU)
            };
            if fresh_store {
                kept_store = DiskOffload::new(dir.path()).unwrap().synchronous(true);
                before = kept_store.stats();
            }
            step(&kept_store, &x, &w, &table);
            let after = kept_store.stats();
            let written = after.written_bytes - before.written_bytes;
            let constants = after.kept.constants - before.kept.constants;
            let case = format!(
                "fresh store {fresh_store}, refilled batch {refilled_batch}, step {step_no}"
            );
            // noise and tanh's output always; the batch unless refilled after the first
            // step; the table in the first step only.
            let expected = match (step_no, refilled_batch) {
                (0, _) => 4 * T,
                (_, false) => 3 * T,
                (_, true) => 2 * T,
            };
            assert_eq!(written, expected, "{case}: {after:?}");
            let expected_constants = match (step_no, refilled_batch) {
                (0, _) => 0,
                (_, false) => 1,
                (_, true) => 2,
            };
            assert_eq!(constants, expected_constants, "{case}: {after:?}");
            before = after;
        }
    }
}

/// Compress keeps a constant too, from the second step on; a policy can still pack it
/// (`pack_if` is told it is a constant).
#[test]
#[serial_test::parallel]
fn compress_keeps_a_constant_from_the_second_step_and_a_policy_may_pack_it() {
    let w = Tensor::randn([COLS, COLS], CPU).set_requires_grad(true);
    let table = Tensor::randn([ROWS, COLS], CPU);
    for pack_constants in [false, true] {
        let mut counts = Vec::new();
        for _ in 0..2 {
            let x = Tensor::randn([ROWS, COLS], CPU);
            let mut int8 = Compress::new(Codec::int8()).excluding(&[x.shallow_clone()]);
            if pack_constants {
                int8 = int8.pack_if(|t| {
                    t.kept_by_default.is_none() || t.kept_by_default == Some(Kept::Constant)
                });
            }
            step(&int8, &x, &w, &table);
            let stats = int8.stats();
            counts.push((stats.tensors, stats.kept.constants));
        }
        // table, noise and tanh's output; then the table kept unless the policy packs it.
        let second = if pack_constants { (3, 0) } else { (2, 1) };
        assert_eq!(
            counts,
            vec![(3, 0), second],
            "pack constants {pack_constants}"
        );
    }
}

/// A table dropped after a step is forgotten: a new one (likely at the same address)
/// is written. A tensor saved in a scope still open (an outer one) is not a constant
/// for a scope inside it.
#[test]
#[serial_test::parallel]
fn a_freed_table_and_a_tensor_of_a_scope_still_open_are_not_constants() {
    let dir = tempfile::tempdir().unwrap();
    let w = Tensor::randn([COLS, COLS], CPU).set_requires_grad(true);
    let x = Tensor::randn([ROWS, COLS], CPU);
    let store = || {
        DiskOffload::new(dir.path())
            .unwrap()
            .synchronous(true)
            .excluding(&[x.shallow_clone()])
    };
    let table = Tensor::randn([ROWS, COLS], CPU);
    let first = store();
    step(&first, &x, &w, &table);
    assert_eq!(first.stats().written_bytes, 3 * T);
    drop(table);
    let table = Tensor::randn([ROWS, COLS], CPU);
    let second = store();
    step(&second, &x, &w, &table);
    let stats = second.stats();
    assert_eq!((stats.written_bytes, stats.kept.constants), (3 * T, 0));

    // Nested: the outer scope saves a new table, the inner one saves it again.
    let table = Tensor::randn([ROWS, COLS], CPU);
    let (outer, inner) = (store(), store());
    let loss = saved_tensors_hooks(outer.clone(), || {
        let a = (x.mm(&w) * &table).sum(Kind::Float);
        let b = saved_tensors_hooks(inner.clone(), || (x.mm(&w) * &table).sum(Kind::Float));
        a + b.unwrap()
    })
    .unwrap();
    let (o, i) = (outer.stats(), inner.stats());
    assert_eq!((o.written_bytes, o.kept.constants), (T, 0), "{o:?}");
    assert_eq!((i.written_bytes, i.kept.constants), (T, 0), "{i:?}");
    loss.backward();
    // Both scopes have ended: the next step keeps the table.
    let next = store();
    step(&next, &x, &w, &table);
    let stats = next.stats();
    assert_eq!((stats.written_bytes, stats.kept.constants), (2 * T, 1));
}

/// The policy's own account: `SavePolicy::keeps` says `Constant` for a tensor an ended
/// scope saved, and `None` for one no scope saved.
#[test]
#[serial_test::parallel]
fn keeps_names_a_constant_once_a_scope_has_saved_it() {
    let w = Tensor::randn([COLS, COLS], CPU).set_requires_grad(true);
    let x = Tensor::randn([ROWS, COLS], CPU);
    let table = Tensor::randn([ROWS, COLS], CPU);
    let other = Tensor::randn([ROWS, COLS], CPU);
    let policy = SavePolicy::exact();
    assert_eq!(policy.keeps(&table, None).unwrap(), None);
    let int8 = Compress::new(Codec::int8()).excluding(&[x.shallow_clone()]);
    step(&int8, &x, &w, &table);
    assert_eq!(policy.keeps(&table, None).unwrap(), Some(Kept::Constant));
    assert_eq!(policy.keeps(&other, None).unwrap(), None);
}

/// A name of `keep_ops` that matched only saves of what is always kept (mm saved the
/// excluded batch and the parameter) was seen: `check` passes.
#[test]
#[serial_test::parallel]
fn check_counts_saves_of_parameters_and_excluded_tensors() {
    let w = Tensor::randn([COLS, COLS], CPU).set_requires_grad(true);
    let x = Tensor::randn([ROWS, COLS], CPU);
    let int8 = Compress::new(Codec::int8())
        .excluding(&[x.shallow_clone()])
        .keep_ops(&["aten::mm"]);
    assert!(int8.check().is_err());
    let loss = saved_tensors_hooks(int8.clone(), || x.mm(&w).sum(Kind::Float)).unwrap();
    assert_eq!(int8.stats().kept.excluded, 1);
    assert!(int8.check().is_ok(), "{:?}", int8.check());
    loss.backward();
}

/// `check` after a step lists the names never seen, with the names seen that look
/// like them (the aten op that saved, the node that produced).
#[test]
#[serial_test::parallel]
fn check_lists_unseen_names_with_similar_names_seen() {
    let w = Tensor::randn([COLS, COLS], CPU).set_requires_grad(true);
    let x = Tensor::randn([ROWS, COLS], CPU);
    let dir = tempfile::tempdir().unwrap();
    let store = DiskOffload::new(dir.path())
        .unwrap()
        .policy(SavePolicy::exact().keep_ops(&["MmBackward", "aten::pow", "aten::no_such_op"]))
        .excluding(&[x.shallow_clone()]);
    let loss = saved_tensors_hooks(store.clone(), || {
        // mm saves x and w; pow (square) saves the mm output, made by MmBackward0.
        x.mm(&w).square().sum(Kind::Float)
    })
    .unwrap();
    let err = store.check().unwrap_err();
    assert_eq!(
        err,
        PolicyError::UnseenOps {
            names: vec!["MmBackward".into(), "aten::no_such_op".into()],
            near: vec!["MmBackward0".into(), "aten::mm".into()],
        }
    );
    let text = err.to_string();
    assert!(
        text.contains("MmBackward, aten::no_such_op") && text.contains("MmBackward0, aten::mm"),
        "{text}"
    );
    assert!(!text.contains('\n'), "{text}");
    loss.backward();
}
