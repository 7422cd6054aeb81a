#[test]
fn flex_device_exists() {
    let d = burn::tensor::Device::flex();
    let t = burn::tensor::Tensor::<1>::from_floats([1.0, 2.0], &d);
    assert_eq!(t.sum().into_scalar::<f32>(), 3.0);
}
