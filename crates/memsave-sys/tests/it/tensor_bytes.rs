//! `write_bytes` and `WeakStorage`: the checks that keep them memory-safe.
use memsave_sys::tensor::{write_bytes, WeakStorage};
use serial_test::parallel;
use tch::{Device, Kind, Tensor};

#[test]
#[parallel]
fn bytes_land_where_asked_and_out_of_range_is_an_error() {
    let t = Tensor::zeros([8], (Kind::Uint8, Device::Cpu));
    write_bytes(&t, 2, &[7, 8, 9]).unwrap();
    assert_eq!(
        Vec::<u8>::try_from(&t).unwrap(),
        vec![0, 0, 7, 8, 9, 0, 0, 0]
    );
    let e = write_bytes(&t, 6, &[1, 2, 3]).unwrap_err().to_string();
    assert!(e.contains("outside a tensor of 8 bytes"), "{e}");
    // Offsets whose sum with the length overflows are refused, not wrapped.
    let e = write_bytes(&t, i64::MAX as usize, &[1, 2])
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside a tensor of 8 bytes"), "{e}");
    assert!(write_bytes(&t, usize::MAX, &[1]).is_err());
    assert_eq!(
        Vec::<u8>::try_from(&t).unwrap(),
        vec![0, 0, 7, 8, 9, 0, 0, 0]
    );
    let f = Tensor::zeros([8], (Kind::Float, Device::Cpu));
    let e = write_bytes(&f, 0, &[1]).unwrap_err().to_string();
    assert!(e.contains("uint8"), "{e}");
    let strided = Tensor::zeros([4, 4], (Kind::Uint8, Device::Cpu)).tr();
    let e = write_bytes(&strided, 0, &[1]).unwrap_err().to_string();
    assert!(e.contains("contiguous"), "{e}");
}

#[test]
#[parallel]
fn a_weak_storage_knows_its_tensor_and_views_and_not_a_successor() {
    let t = Tensor::ones([16], (Kind::Float, Device::Cpu));
    let weak = WeakStorage::new(&t).unwrap();
    assert!(weak.is_storage_of(&t).unwrap());
    assert!(weak.is_storage_of(&t.narrow(0, 4, 4)).unwrap());
    assert!(!weak.is_storage_of(&t.copy()).unwrap());
    drop(t);
    // Whatever the allocator hands out next, the first storage is gone.
    let successor = Tensor::ones([16], (Kind::Float, Device::Cpu));
    assert!(!weak.is_storage_of(&successor).unwrap());
}
