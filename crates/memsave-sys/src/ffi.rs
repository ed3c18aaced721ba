//! Raw declarations of the C++ bridge (`cpp/*.cpp`). Use the safe modules instead.
#![allow(dead_code)]

use std::ffi::{c_char, c_int, c_void};

/// libtorch's tensor handle, as tch passes it (`torch_sys::C_tensor`, behind
/// `Tensor::as_ptr`); opaque, and cast at the boundary with tch. Declared here rather
/// than taken from torch-sys so that this crate need not depend on torch-sys, whose
/// build script would otherwise have to finish before this crate's starts.
#[repr(C)]
pub struct CTensor {
    _opaque: [u8; 0],
}

/// Callback that runs a checkpointed closure on `inputs`, reporting via `ms_outputs_*`.
pub type RunFn =
    unsafe extern "C" fn(ctx: *mut c_void, inputs: *const *mut CTensor, n: usize, out: *mut c_void);
/// Callback that drops a checkpointed closure or a hook context.
pub type DropFn = unsafe extern "C" fn(ctx: *mut c_void);
/// Saved-tensor pack hook: stores `t`, writes an opaque handle to `packed`; non-zero
/// status after writing a message with `ms_error_sink_set(error, ..)`.
pub type HookPackFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    t: *const CTensor,
    saved_by: *const c_char,
    packed: *mut *mut c_void,
    error: *mut c_void,
) -> c_int;
/// Saved-tensor unpack hook: writes the tensor for `packed` with `ms_tensor_assign(out, ..)`.
pub type HookUnpackFn = unsafe extern "C" fn(
    ctx: *mut c_void,
    packed: *mut c_void,
    out: *mut CTensor,
    error: *mut c_void,
) -> c_int;
/// Frees a handle written by the pack hook (called once per successful pack).
pub type HookFreeFn = unsafe extern "C" fn(ctx: *mut c_void, packed: *mut c_void);
/// One event of the CPU allocator's recorder (`cpp/allocator.cpp`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct MsAllocEvent {
    pub addr: u64,
    pub bytes: i64,
    pub allocated_after: i64,
    pub time_ns: u64,
}
/// Callback of a post-accumulate-grad hook; reports failure via `ms_grad_hook_fail`.
pub type GradHookFn =
    unsafe extern "C" fn(ctx: *mut c_void, tensor: *const CTensor, status: *mut c_void);

extern "C" {
    pub fn ms_last_error() -> *const c_char;
    pub fn ms_error_sink_set(sink: *mut c_void, message: *const c_char);
    pub fn ms_tensor_assign(dst: *mut CTensor, src: *const CTensor);
    pub fn ms_libtorch_version() -> *const c_char;

    pub fn ms_cpu_install_counting_allocator() -> c_int;
    pub fn ms_cpu_counting_allocator_active(out: *mut bool) -> c_int;
    pub fn ms_cpu_storage_counted(t: *const CTensor, out: *mut bool) -> c_int;
    pub fn ms_cpu_allocated(out: *mut i64) -> c_int;
    pub fn ms_cpu_peak(out: *mut i64) -> c_int;
    pub fn ms_cpu_reset_peak() -> c_int;
    pub fn ms_cpu_raise_peak(value: i64) -> c_int;
    pub fn ms_cpu_set_limit(limit: i64) -> c_int;
    pub fn ms_cpu_limit(out: *mut i64) -> c_int;
    pub fn ms_cpu_live_allocations(out: *mut i64) -> c_int;
    pub fn ms_cpu_largest_allocations(out: *mut i64, cap: usize, written: *mut usize) -> c_int;

    pub fn ms_accelerator_type() -> c_int;
    pub fn ms_device_stats(
        device_type: c_int,
        index: i64,
        allocated: *mut i64,
        peak: *mut i64,
        live_allocations: *mut i64,
        reserved: *mut i64,
    ) -> c_int;
    pub fn ms_device_reset_peak(device_type: c_int, index: i64) -> c_int;
    pub fn ms_device_empty_cache(device_type: c_int) -> c_int;
    pub fn ms_device_synchronize(device_type: c_int, index: i64) -> c_int;

    pub fn ms_tensor_use_count(t: *const CTensor, out: *mut i64) -> c_int;
    pub fn ms_tensor_storage_use_count(t: *const CTensor, out: *mut i64) -> c_int;
    pub fn ms_tensor_storage_nbytes(t: *const CTensor, out: *mut i64) -> c_int;
    pub fn ms_tensor_storage_data_ptr(t: *const CTensor, out: *mut usize) -> c_int;
    pub fn ms_tensor_version(t: *const CTensor, out: *mut i64) -> c_int;
    pub fn ms_grad_enabled(out: *mut c_int) -> c_int;
    pub fn ms_tensor_is_view(t: *const CTensor, out: *mut bool) -> c_int;
    pub fn ms_tensor_write_bytes(
        t: *const CTensor,
        offset: i64,
        data: *const u8,
        len: i64,
    ) -> c_int;
    pub fn ms_storage_weak_new(t: *const CTensor, out: *mut *mut c_void) -> c_int;
    pub fn ms_storage_weak_is_storage_of(
        w: *const c_void,
        t: *const CTensor,
        out: *mut bool,
    ) -> c_int;
    pub fn ms_storage_weak_alive(w: *const c_void, out: *mut bool) -> c_int;
    pub fn ms_storage_weak_free(w: *mut c_void);
    pub fn ms_tensor_base_use_count(t: *const CTensor, out: *mut i64) -> c_int;
    pub fn ms_tensor_view_creation_meta(t: *const CTensor, out: *mut i32) -> c_int;
    pub fn ms_tensor_is_view_of_grad_leaf(t: *const CTensor, out: *mut bool) -> c_int;
    pub fn ms_tensor_set_grad_none(t: *mut CTensor) -> c_int;
    pub fn ms_tensor_set_grad(t: *mut CTensor, g: *const CTensor) -> c_int;
    pub fn ms_set_detect_anomaly(enabled: bool) -> c_int;
    pub fn ms_is_anomaly_enabled(out: *mut bool) -> c_int;
    pub fn ms_backward_with_grads(
        tensors: *const *mut CTensor,
        grads: *const *mut CTensor,
        n: usize,
        keep_graph: bool,
    ) -> c_int;
    pub fn ms_grad_mode_enabled() -> bool;
    pub fn ms_grad_mode_set_enabled(enabled: bool);
    pub fn ms_addcmul_(
        this: *mut CTensor,
        t1: *const CTensor,
        t2: *const CTensor,
        value: f64,
    ) -> c_int;
    pub fn ms_addcdiv_(
        this: *mut CTensor,
        t1: *const CTensor,
        t2: *const CTensor,
        value: f64,
    ) -> c_int;
    pub fn ms_amp_non_finite_check_and_unscale(
        tensors: *const *mut CTensor,
        n: usize,
        found_inf: *mut CTensor,
        inv_scale: *const CTensor,
    ) -> c_int;

    pub fn ms_autocast_is_enabled(device_type: c_int, out: *mut bool) -> c_int;
    pub fn ms_autocast_set_enabled(device_type: c_int, enabled: bool) -> c_int;
    pub fn ms_autocast_get_dtype(device_type: c_int, out: *mut c_int) -> c_int;
    pub fn ms_autocast_set_dtype(device_type: c_int, scalar_type: c_int) -> c_int;
    pub fn ms_autocast_increment_nesting(out: *mut i64) -> c_int;
    pub fn ms_autocast_decrement_nesting(out: *mut i64) -> c_int;
    pub fn ms_autocast_clear_cache() -> c_int;

    pub fn ms_outputs_push(outputs: *mut c_void, t: *const CTensor);
    pub fn ms_outputs_fail(outputs: *mut c_void, message: *const c_char);
    pub fn ms_checkpoint(
        inputs: *const *mut CTensor,
        n_inputs: usize,
        ctx: *mut c_void,
        run: RunFn,
        drop: DropFn,
        name: *const c_char,
        preserve_rng: bool,
        early_stop: bool,
        pack_inputs: bool,
        out_vec: *mut *mut c_void,
    ) -> c_int;
    pub fn ms_tensor_vec_len(vec: *const c_void) -> usize;
    pub fn ms_tensor_vec_get(vec: *const c_void, i: usize, out: *mut *mut CTensor) -> c_int;
    pub fn ms_checkpoint_recomputation_done() -> bool;
    pub fn ms_running_stats_scope_enter() -> *mut c_void;
    pub fn ms_running_stats_scope_exit(scope: *mut c_void);
    pub fn ms_checkpoint_stop_message() -> *const c_char;
    pub fn ms_cpu_generator_state_bytes(out: *mut i64) -> c_int;

    pub fn ms_hooks_install_engine() -> c_int;
    pub fn ms_hooks_push(
        ctx: *mut c_void,
        pack: HookPackFn,
        unpack: HookUnpackFn,
        free_packed: HookFreeFn,
        drop: DropFn,
        record_ops: bool,
        id: *mut u64,
    ) -> c_int;
    pub fn ms_hooks_pop(id: u64, popped: *mut c_int) -> c_int;
    pub fn ms_tensor_grad_fn_name(t: *const CTensor, sink: *mut c_void, has: *mut bool) -> c_int;
    pub fn ms_current_autograd_node_name(sink: *mut c_void, has: *mut bool) -> c_int;
    pub fn ms_coupling_begin(recorder: *mut *mut c_void) -> c_int;
    pub fn ms_rng_cpu_state(out: *mut *mut CTensor) -> c_int;
    pub fn ms_rng_set_cpu_state(state: *const CTensor) -> c_int;
    pub fn ms_coupling_end(recorder: *mut c_void, sink: *mut c_void, found: *mut bool) -> c_int;
    pub fn ms_string_new(out: *mut *mut c_void) -> c_int;
    pub fn ms_string_data(s: *const c_void) -> *const c_char;
    pub fn ms_string_free(s: *mut c_void);
    pub fn ms_tensor_vec_free(vec: *mut c_void);

    pub fn ms_grad_hook_fail(status: *mut c_void, message: *const c_char);
    pub fn ms_grad_hook_register(
        t: *const CTensor,
        ctx: *mut c_void,
        run: GradHookFn,
        drop: DropFn,
        out_id: *mut *mut c_void,
    ) -> c_int;
    pub fn ms_grad_hook_remove(t: *const CTensor, id: *mut c_void, removed: *mut bool) -> c_int;
    pub fn ms_blockwise_decode(
        codes: *const CTensor,
        absmax: *const CTensor,
        table: *const f32,
        block: i64,
        values: *mut CTensor,
    ) -> c_int;
    pub fn ms_blockwise_encode(
        values: *const CTensor,
        thresholds: *const f32,
        buckets: *const u8,
        block: i64,
        codes: *mut CTensor,
        absmax: *mut CTensor,
    ) -> c_int;

    pub fn ms_dist_store_tcp(
        host: *const c_char,
        port: u16,
        is_server: bool,
        world_size: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
    ) -> c_int;
    pub fn ms_dist_store_file(
        path: *const c_char,
        world_size: c_int,
        timeout_ms: i64,
        out: *mut *mut c_void,
    ) -> c_int;
    pub fn ms_dist_store_free(store: *mut c_void);
    pub fn ms_dist_group_gloo(
        store: *mut c_void,
        rank: c_int,
        size: c_int,
        hostname: *const c_char,
        timeout_ms: i64,
        out: *mut *mut c_void,
    ) -> c_int;
    pub fn ms_dist_group_free(group: *mut c_void);
    pub fn ms_dist_all_reduce_sum(group: *mut c_void, t: *mut CTensor) -> c_int;
    pub fn ms_dist_reduce_scatter_sum(
        group: *mut c_void,
        output: *mut CTensor,
        input: *mut CTensor,
    ) -> c_int;
    pub fn ms_dist_all_gather(
        group: *mut c_void,
        output: *mut CTensor,
        input: *mut CTensor,
    ) -> c_int;
    pub fn ms_dist_all_gather_start(
        group: *mut c_void,
        output: *mut CTensor,
        input: *mut CTensor,
        out: *mut *mut c_void,
    ) -> c_int;
    pub fn ms_dist_work_wait(work: *mut c_void) -> c_int;
    pub fn ms_dist_work_free(work: *mut c_void);
    pub fn ms_dist_all_to_all(
        group: *mut c_void,
        output: *mut CTensor,
        input: *mut CTensor,
        output_counts: *const i64,
        input_counts: *const i64,
        n: c_int,
    ) -> c_int;
    pub fn ms_dist_broadcast(group: *mut c_void, t: *mut CTensor, src: c_int) -> c_int;
    pub fn ms_dist_barrier(group: *mut c_void) -> c_int;
    pub fn ms_dist_set_grad(t: *mut CTensor, grad: *const CTensor) -> c_int;

    pub fn ms_cpu_trace_start(started: *mut bool) -> c_int;
    pub fn ms_cpu_trace_position(out: *mut usize) -> c_int;
    pub fn ms_cpu_trace_stop(count: *mut usize) -> c_int;
    pub fn ms_cpu_trace_read(out: *mut MsAllocEvent, cap: usize, written: *mut usize) -> c_int;
    pub fn ms_c_mapped_blocks(out: *mut i64) -> c_int;
}
