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

impl From<tch::TchError> for ModelError {
    fn from(e: tch::TchError) -> Self {
        ModelError::Torch(e.to_string())
    }
}
