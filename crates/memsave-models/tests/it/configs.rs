//! Every zoo configuration refuses a size below 1 and an image with a side below 1,
//! naming the key and the value.

use memsave_models::{
    EncoderDecoderConfig, LlamaConfig, MobileNetV2Config, ModelError, ResNetConfig, UNetConfig,
    VitConfig,
};

fn key_and_message(result: Result<(), ModelError>) -> (&'static str, String) {
    match result {
        Err(ModelError::Config { key, message }) => (key, message),
        other => panic!("not a configuration error: {other:?}"),
    }
}

#[test]
fn sizes_below_one_are_refused_naming_the_key() {
    let cases: Vec<(&str, Result<(), ModelError>)> = vec![
        (
            "heads",
            VitConfig {
                heads: 0,
                ..VitConfig::default()
            }
            .validate(),
        ),
        (
            "levels",
            UNetConfig {
                levels: -2,
                ..UNetConfig::default()
            }
            .validate(),
        ),
        (
            "kv_heads",
            LlamaConfig {
                kv_heads: 0,
                ..LlamaConfig::default()
            }
            .validate(),
        ),
        (
            "target",
            EncoderDecoderConfig {
                target: 0,
                ..EncoderDecoderConfig::default()
            }
            .validate(),
        ),
        (
            "classes",
            ResNetConfig {
                classes: 0,
                ..ResNetConfig::default()
            }
            .validate(),
        ),
        (
            "classes",
            MobileNetV2Config {
                classes: 0,
                ..MobileNetV2Config::default()
            }
            .validate(),
        ),
    ];
    for (expected, result) in cases {
        let (key, message) = key_and_message(result);
        assert_eq!(key, expected, "{message}");
        assert!(message.starts_with("must be at least 1, got "), "{message}");
    }
    for result in [
        VitConfig {
            image: [3, 0, 32],
            ..VitConfig::default()
        }
        .validate(),
        UNetConfig {
            image: [0, 32, 32],
            ..UNetConfig::default()
        }
        .validate(),
    ] {
        let (key, message) = key_and_message(result);
        assert_eq!(key, "image");
        assert!(
            message.contains("every side at least 1, got ["),
            "{message}"
        );
    }
}
