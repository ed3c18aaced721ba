// Tensor introspection that tch does not expose: reference counts, the version
// counter, grad mode, setting a gradient to none, the AMP unscale kernel, and the
// in-place pointwise ops whose number tch cannot pass without a Scalar.
#include "common.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/variable.h>

#include <cstring>
#include <vector>

extern "C" {

int ms_tensor_use_count(const at::Tensor* t, int64_t* out) {
  MS_TRY({ *out = static_cast<int64_t>(t->use_count()); })
}

int ms_tensor_storage_use_count(const at::Tensor* t, int64_t* out) {
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    *out = t->has_storage() ? static_cast<int64_t>(t->storage().use_count()) : 0;
  })
}

int ms_tensor_storage_nbytes(const at::Tensor* t, int64_t* out) {
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    *out = t->has_storage() ? static_cast<int64_t>(t->storage().nbytes()) : 0;
  })
}

int ms_tensor_storage_data_ptr(const at::Tensor* t, uintptr_t* out) {
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    *out = t->has_storage() ? reinterpret_cast<uintptr_t>(t->storage().data()) : 0;
  })
}

int ms_tensor_version(const at::Tensor* t, int64_t* out) {
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    *out = static_cast<int64_t>(t->_version());
  })
}

// Whether autograd records operations on this thread (GradMode, off under no_grad).
int ms_grad_enabled(int* out) {
  MS_TRY({ *out = at::GradMode::is_enabled() ? 1 : 0; })
}

// Copies `len` bytes from `data` into a contiguous CPU uint8 tensor at byte `offset`,
// with no temporary tensor (a file read back chunk by chunk into its final place).
int ms_tensor_write_bytes(const at::Tensor* t, int64_t offset, const uint8_t* data, int64_t len) {
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    TORCH_CHECK(t->device().is_cpu(), "writing bytes needs a CPU tensor, got ", t->device());
    TORCH_CHECK(t->scalar_type() == at::kByte, "writing bytes needs a uint8 tensor, got ",
                t->scalar_type());
    TORCH_CHECK(t->is_contiguous(), "writing bytes needs a contiguous tensor");
    TORCH_CHECK(offset >= 0 && len >= 0 && offset <= t->numel() && len <= t->numel() - offset,
                "writing ", len, " bytes at ", offset, " outside a tensor of ", t->numel(),
                " bytes");
    if (len > 0) {
      std::memcpy(static_cast<uint8_t*>(t->data_ptr()) + offset, data, static_cast<size_t>(len));
    }
  })
}

// A weak handle to a tensor's storage: it does not keep the data alive, and says
// whether a later tensor still uses that same storage (not a new one at the same
// address after the first was freed).
int ms_storage_weak_new(const at::Tensor* t, void** out) {
  MS_TRY({
    TORCH_CHECK(t->defined() && t->has_storage(), "the tensor has no storage");
    *out = new c10::weak_intrusive_ptr<c10::StorageImpl>(t->storage().getWeakStorageImpl());
  })
}

int ms_storage_weak_is_storage_of(const void* w, const at::Tensor* t, bool* out) {
  MS_TRY({
    auto strong = static_cast<const c10::weak_intrusive_ptr<c10::StorageImpl>*>(w)->lock();
    *out = strong.defined() && t->defined() && t->has_storage() &&
           strong.get() == t->storage().unsafeGetStorageImpl();
  })
}

int ms_storage_weak_alive(const void* w, bool* out) {
  MS_TRY({
    *out = static_cast<const c10::weak_intrusive_ptr<c10::StorageImpl>*>(w)->lock().defined();
  })
}

void ms_storage_weak_free(void* w) noexcept {
  delete static_cast<c10::weak_intrusive_ptr<c10::StorageImpl>*>(w);
}

int ms_tensor_is_view(const at::Tensor* t, bool* out) {
  MS_TRY({ *out = t->is_view(); })
}

// Use count of the base of a view (-1 when `t` is not a view): 1 means only the view
// itself holds its base.
int ms_tensor_base_use_count(const at::Tensor* t, int64_t* out) {
  MS_TRY({ *out = t->is_view() ? static_cast<int64_t>(t->_base().use_count()) : -1; })
}

// True when `t` is a view whose base is a leaf that requires grad: a parameter seen
// through `t()`, `view` or `expand`, which stays alive as long as the parameter does.
int ms_tensor_is_view_of_grad_leaf(const at::Tensor* t, bool* out) {
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    *out = t->is_view() && t->_base().is_leaf() && t->_base().requires_grad();
  })
}

// How a backward-differentiable view was created: torch::autograd::CreationMeta as its
// number (0 DEFAULT, 1 IN_CUSTOM_FUNCTION, 2 MULTI_OUTPUT_NODE, 3 NO_GRAD_MODE,
// 4 INFERENCE_MODE), or -1 for any other tensor. libtorch refuses an in-place write that
// autograd records on a view whose value is not DEFAULT (can_mutate_inplace in
// torch/csrc/autograd/VariableTypeUtils.h).
int ms_tensor_view_creation_meta(const at::Tensor* t, int32_t* out) {
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    auto* meta = torch::autograd::impl::get_view_autograd_meta(*t);
    *out = (meta != nullptr && meta->has_bw_view())
               ? static_cast<int32_t>(meta->get_creation_meta())
               : -1;
  })
}

// Anomaly detection (PyTorch's torch.autograd.set_detect_anomaly): backward errors then
// name the forward op that produced the failing node.
int ms_set_detect_anomaly(bool enabled) {
  MS_TRY({ torch::autograd::AnomalyMode::set_enabled(enabled); })
}

int ms_is_anomaly_enabled(bool* out) {
  MS_TRY({ *out = torch::autograd::AnomalyMode::is_enabled(); })
}

int ms_tensor_set_grad_none(at::Tensor* t) {
  MS_TRY({
    TORCH_CHECK(t->defined(), "the tensor is undefined");
    t->mutable_grad().reset();
  })
}

// `t.grad = g` (PyTorch's setter): same dtype, device and shape, checked here.
int ms_tensor_set_grad(at::Tensor* t, const at::Tensor* g) {
  MS_TRY({
    TORCH_CHECK(t->defined() && g->defined(), "the tensor or the gradient is undefined");
    TORCH_CHECK(t->scalar_type() == g->scalar_type() && t->device() == g->device() &&
                    t->sizes() == g->sizes(),
                "the gradient's dtype, device and shape must be the tensor's");
    t->mutable_grad() = *g;
  })
}

// torch::autograd::backward(tensors, grads): back-propagates given output gradients.
int ms_backward_with_grads(at::Tensor* const* tensors, at::Tensor* const* grads, size_t n, bool keep_graph) {
  MS_TRY({
    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < n; ++i) {
      roots.push_back(*tensors[i]);
      root_grads.push_back(*grads[i]);
    }
    torch::autograd::backward(roots, root_grads, keep_graph, /*create_graph=*/false);
  })
}

bool ms_grad_mode_enabled() noexcept { return at::GradMode::is_enabled(); }

void ms_grad_mode_set_enabled(bool enabled) noexcept { at::GradMode::set_enabled(enabled); }

// Multiplies every tensor by `inv_scale` in place and sets `found_inf` to 1 when any
// holds an inf or NaN (torch._amp_foreach_non_finite_check_and_unscale_).
int ms_amp_non_finite_check_and_unscale(at::Tensor* const* tensors, size_t n, at::Tensor* found_inf,
                                        const at::Tensor* inv_scale) {
  MS_TRY({
    std::vector<at::Tensor> list;
    list.reserve(n);
    for (size_t i = 0; i < n; ++i) list.push_back(*tensors[i]);
    at::_amp_foreach_non_finite_check_and_unscale_(list, *found_inf, *inv_scale);
  })
}

// self += value * t1 * t2 and self += value * t1 / t2, in place (torch.addcmul_ and
// torch.addcdiv_ with `value`, as libtorch's Adam and AdamW call them). The kernel
// reads the number from the c10::Scalar: nothing is allocated.
int ms_addcmul_(at::Tensor* self, const at::Tensor* t1, const at::Tensor* t2, double value) {
  MS_TRY({ self->addcmul_(*t1, *t2, value); })
}

int ms_addcdiv_(at::Tensor* self, const at::Tensor* t1, const at::Tensor* t2, double value) {
  MS_TRY({ self->addcdiv_(*t1, *t2, value); })
}

}  // extern "C"
