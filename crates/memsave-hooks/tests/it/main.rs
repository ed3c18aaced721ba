//! The integration tests of memsave-hooks, built as one test binary (one libtorch link instead
//! of one per file). Tests that measure memory, set a memory limit or seed the global
//! generator are `#[serial]`; the others are `#[parallel]` (they never run alongside a
//! serial one).
mod alive_anyway;
mod bn_stacks;
mod codecs;
mod grad_offload;
mod hooks;
mod levers;
mod norm_offsets;
mod offload;
mod pytorch_hooks;
mod resnet_blocks_offload;
mod save_policy;
mod saved_layouts;
mod scope_order;
mod written_attention;
