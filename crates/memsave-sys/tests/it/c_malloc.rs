//! `c_mapped_blocks` counts the blocks glibc's `malloc` maps on their own: one above
//! its 32 MiB cap always is, from its allocation to its free.
use memsave_sys::alloc::c_mapped_blocks;
use serial_test::serial;

#[test]
#[serial]
fn a_block_above_glibcs_cap_is_counted_while_it_lives() {
    let before = c_mapped_blocks().expect("glibc says how many blocks it maps");
    let block = std::hint::black_box(Vec::<u8>::with_capacity(64 << 20));
    let during = c_mapped_blocks().unwrap();
    drop(block);
    let after = c_mapped_blocks().unwrap();
    assert_eq!(during, before + 1);
    assert_eq!(after, before);
}
