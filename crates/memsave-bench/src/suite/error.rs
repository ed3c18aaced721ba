//! Why a suite cannot be used: the file cannot be read, or it is invalid at a place.
/// A suite that cannot be read or is invalid.
#[derive(Debug, thiserror::Error)]
pub enum SuiteError {
    /// The file cannot be read.
    #[error("{path}: cannot read the suite: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The YAML is malformed or a value is invalid, at a position.
    #[error("{file}:{line}:{column}: {message}")]
    Invalid {
        /// The file (or `<string>`).
        file: String,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What is wrong and what is expected.
        message: String,
    },
}

impl SuiteError {
    /// A serde_yaml error in `file`, with its position in front of the message.
    pub(crate) fn from_yaml(file: &str, error: &serde_yaml::Error) -> Self {
        let (line, column) = error.location().map_or((1, 1), |l| (l.line(), l.column()));
        SuiteError::Invalid {
            file: file.to_owned(),
            line,
            column,
            message: strip_positions(&error.to_string()),
        }
    }
}

/// serde_yaml appends ` at line L column C` (sometimes several times, with context);
/// the position is already in front of the message.
fn strip_positions(message: &str) -> String {
    let re = regex::Regex::new(r" at line \d+ column \d+").expect("valid regex");
    re.replace_all(message, "").into_owned()
}
