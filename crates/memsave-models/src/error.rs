//! Why a model cannot be built.

/// A configuration that does not describe a network, or a build that libtorch refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A configuration value out of range or inconsistent with another
    /// (`heads` not dividing `dim`, an image smaller than the network's stride, ...).
    /// `key` is the configuration key at fault, as a suite spells it.
    #[error("{key}: {message}")]
    Config {
        /// The key at fault (`heads`, `image`, `depth`, ...).
        key: &'static str,
        /// What is wrong and what is expected.
        message: String,
    },
    /// libtorch failed while building the parameters or the inputs.
    #[error("building the model: {0}")]
    Torch(String),
}

impl ModelError {
    pub(crate) fn config(key: &'static str, message: impl Into<String>) -> Self {
        ModelError::Config {
            key,
            message: message.into(),
        }
    }
}

/// The first of `values` (configuration keys and their values) below 1, as the error
/// naming its key.
pub(crate) fn at_least_one(values: &[(&'static str, i64)]) -> Result<(), ModelError> {
    match values.iter().find(|(_, value)| *value < 1) {
        Some(&(key, value)) => Err(ModelError::config(
            key,
            format!("must be at least 1, got {value}"),
        )),
        None => Ok(()),
    }
}

/// An `image` key `[channels, height, width]` with every side at least 1.
pub(crate) fn image_sides(image: [i64; 3]) -> Result<(), ModelError> {
    if image.iter().any(|&side| side < 1) {
        return Err(ModelError::config(
            "image",
            format!("must be [channels, height, width] with every side at least 1, got {image:?}"),
        ));
    }
    Ok(())
}

impl From<tch::TchError> for ModelError {
    fn from(e: tch::TchError) -> Self {
        ModelError::Torch(e.to_string())
    }
}
