//! A hook that libtorch calls back fails with any error (a `String`, or a typed error
//! with causes); the backward that ran it fails with the error's text and its causes,
//! one line, instead of the hook having to flatten its error to a `String` first.
use memsave_sys::grad_hooks::register_post_accumulate_grad_hook;
use memsave_sys::hooks::{self, Packed, RawHooks};
use memsave_sys::CallbackError;
use serial_test::parallel;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// A typed error whose text does not include its cause.
#[derive(Debug, thiserror::Error)]
#[error("{what}")]
struct StoreFailed {
    what: &'static str,
    #[source]
    cause: std::io::Error,
}

fn leaf() -> Tensor {
    Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true)
}

#[test]
#[parallel]
fn a_grad_hook_s_typed_error_fails_backward_with_its_cause() {
    let w = leaf();
    let _hook = register_post_accumulate_grad_hook(
        &w,
        Box::new(|_: &Tensor| -> Result<(), CallbackError> {
            Err(StoreFailed {
                what: "writing the gradient",
                cause: std::io::Error::other("disk full"),
            })?
        }),
    )
    .unwrap();
    let e = (&w * 2.0).sum(Kind::Float).f_backward().unwrap_err();
    assert!(
        e.to_string().contains("writing the gradient: disk full"),
        "{e}"
    );
}

#[test]
#[parallel]
fn a_grad_hook_s_string_error_is_its_text() {
    let w = leaf();
    let _hook = register_post_accumulate_grad_hook(
        &w,
        Box::new(|_: &Tensor| Err("no room for the gradient".into())),
    )
    .unwrap();
    let e = (&w * 2.0).sum(Kind::Float).f_backward().unwrap_err();
    assert!(e.to_string().contains("no room for the gradient"), "{e}");
}

/// Packs by keeping the tensor; unpacking fails with a typed error.
struct FailingUnpack;

impl RawHooks for FailingUnpack {
    fn pack(&self, tensor: &Tensor, _saved_by: Option<&str>) -> Result<Packed, CallbackError> {
        Ok(Box::new(tensor.shallow_clone()))
    }

    fn unpack(&self, _packed: &Packed) -> Result<Tensor, CallbackError> {
        Err(Box::new(StoreFailed {
            what: "reading the saved tensor back",
            cause: std::io::Error::other("file removed"),
        }))
    }
}

#[test]
#[parallel]
fn an_unpack_hook_s_typed_error_fails_backward_with_its_cause() {
    let w = leaf();
    let frame = hooks::push(Arc::new(FailingUnpack)).unwrap();
    let y = (&w * &w).sum(Kind::Float);
    frame.exit().unwrap();
    let e = y.f_backward().unwrap_err();
    assert!(
        e.to_string()
            .contains("reading the saved tensor back: file removed"),
        "{e}"
    );
}

#[test]
#[parallel]
fn a_checkpointed_function_s_typed_error_fails_the_forward_with_its_cause() {
    let w = leaf();
    let f: memsave_sys::checkpoint::CheckpointFn = Box::new(|_: &[Tensor]| {
        Err(StoreFailed {
            what: "reading the block's weights",
            cause: std::io::Error::other("file removed"),
        })?
    });
    let e = memsave_sys::checkpoint::checkpoint(&[w], true, true, f).unwrap_err();
    assert!(
        e.to_string()
            .contains("reading the block's weights: file removed"),
        "{e}"
    );
}

/// An error whose text cannot be made: its `Display` panics.
#[derive(Debug)]
struct Unprintable;

impl std::fmt::Display for Unprintable {
    fn fmt(&self, _: &mut std::fmt::Formatter) -> std::fmt::Result {
        panic!("this error cannot be printed")
    }
}

impl std::error::Error for Unprintable {}

#[test]
#[parallel]
fn a_checkpointed_function_s_error_that_panics_when_printed_is_a_panic_not_an_abort() {
    let w = leaf();
    let f: memsave_sys::checkpoint::CheckpointFn =
        Box::new(|_: &[Tensor]| Err(Box::new(Unprintable) as CallbackError));
    let e = memsave_sys::checkpoint::checkpoint(&[w], true, true, f).unwrap_err();
    assert!(
        e.to_string()
            .contains("panicked: this error cannot be printed"),
        "{e}"
    );
}

#[test]
#[parallel]
fn a_grad_hook_s_error_that_panics_when_printed_is_a_panic_not_an_abort() {
    let w = leaf();
    let _hook = register_post_accumulate_grad_hook(
        &w,
        Box::new(|_: &Tensor| Err(Box::new(Unprintable) as CallbackError)),
    )
    .unwrap();
    let e = (&w * 2.0).sum(Kind::Float).f_backward().unwrap_err();
    assert!(
        e.to_string()
            .contains("panicked: this error cannot be printed"),
        "{e}"
    );
}

/// Packs by keeping the tensor; unpacking fails with an error that cannot be printed.
struct UnprintableUnpack;

impl RawHooks for UnprintableUnpack {
    fn pack(&self, tensor: &Tensor, _saved_by: Option<&str>) -> Result<Packed, CallbackError> {
        Ok(Box::new(tensor.shallow_clone()))
    }

    fn unpack(&self, _packed: &Packed) -> Result<Tensor, CallbackError> {
        Err(Box::new(Unprintable))
    }
}

#[test]
#[parallel]
fn an_unpack_hook_s_error_that_panics_when_printed_is_a_panic_not_an_abort() {
    let w = leaf();
    let frame = hooks::push(Arc::new(UnprintableUnpack)).unwrap();
    let y = (&w * &w).sum(Kind::Float);
    frame.exit().unwrap();
    let e = y.f_backward().unwrap_err();
    assert!(
        e.to_string()
            .contains("panicked: this error cannot be printed"),
        "{e}"
    );
}
