//! `fit` times every configuration with glibc's `malloc` settled: its mmap threshold
//! raised to the cap, whatever ran before. In a process of its own (this file), so
//! that the state before `fit` is glibc's own.
#[path = "../../memsave-step/tests/it/common.rs"]
#[allow(dead_code)] // the other tests' models
mod common;

use common::Mlp;
use memsave_fit::{fit, FitRequest};
use memsave_sys::alloc::c_mapped_blocks;

/// Whether glibc gives a fresh block of `bytes` a mapping of its own (freeing it raises
/// the threshold to its size if it did).
fn mapped_on_its_own(bytes: usize) -> bool {
    let before = c_mapped_blocks().expect("glibc says how many blocks it maps");
    let block = std::hint::black_box(Vec::<u8>::with_capacity(bytes));
    let during = c_mapped_blocks().unwrap();
    drop(block);
    during == before + 1
}

#[test]
fn after_fit_glibc_serves_blocks_up_to_its_cap_from_the_heap() {
    // Two blocks of width 16 on 8 rows: no tensor anywhere near a MiB.
    let mut model = Mlp::new(2, 16, 8, 1);
    // glibc's own state: a 24 MiB block is mapped (and its free raises the threshold
    // to 24 MiB, no further).
    assert!(mapped_on_its_own(24 << 20), "glibc starts below 24 MiB");
    fit(&mut model, &FitRequest::new(64 << 20)).unwrap();
    // Nothing but `fit`'s settling frees a block near 32 MiB in this process.
    assert!(
        !mapped_on_its_own(31 << 20),
        "a 31 MiB block was given a mapping of its own after fit"
    );
}
