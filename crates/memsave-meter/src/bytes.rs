//! Byte counts for people: `Bytes(102_400_000)` prints as `97.66 MiB`, and sizes such
//! as `60MiB`, `8 GiB` or `1.5GB` parse.
use std::fmt;
use std::str::FromStr;

/// A byte count that prints with binary units (`97.66 MiB`) and parses from text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Bytes(pub u64);

const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let mut value = self.0 as f64;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        write!(f, "{value:.2} {}", UNITS[unit])
    }
}

/// `Bytes(n).to_string()`: a byte count with binary units, e.g. `97.66 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    Bytes(bytes).to_string()
}

/// Why a size did not parse; says what is accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size '{input}': expected a non-negative number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 60MiB")]
pub struct ParseBytesError {
    input: String,
}

impl FromStr for Bytes {
    type Err = ParseBytesError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseBytesError {
            input: s.to_owned(),
        };
        let trimmed = s.trim();
        let split = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let value: f64 = number.parse().map_err(|_| err())?;
        let multiplier: u64 = match unit.trim() {
            "" | "B" => 1,
            "KB" | "kB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            "TB" => 1_000_000_000_000,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "TiB" => 1 << 40,
            _ => return Err(err()),
        };
        let bytes = value * multiplier as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 || bytes.fract() != 0.0 {
            return Err(err());
        }
        Ok(Bytes(bytes as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_with_binary_units() {
        assert_eq!(Bytes(0).to_string(), "0 B");
        assert_eq!(Bytes(1023).to_string(), "1023 B");
        assert_eq!(Bytes(1024).to_string(), "1.00 KiB");
        assert_eq!(Bytes(102_400_000).to_string(), "97.66 MiB");
        assert_eq!(format_bytes(8 << 30), "8.00 GiB");
    }

    #[test]
    fn parses_sizes_and_rejects_garbage() {
        assert_eq!("60MiB".parse::<Bytes>(), Ok(Bytes(60 << 20)));
        assert_eq!("8 GiB".parse::<Bytes>(), Ok(Bytes(8 << 30)));
        assert_eq!("1.5GB".parse::<Bytes>(), Ok(Bytes(1_500_000_000)));
        assert_eq!("4096".parse::<Bytes>(), Ok(Bytes(4096)));
        for bad in ["60MB!", "", "MiB", "-1MiB", "1.2.3KB", "0.5B", "10 parsecs"] {
            let e = bad.parse::<Bytes>().unwrap_err();
            assert!(
                e.to_string().contains("expected a non-negative number"),
                "{bad}: {e}"
            );
        }
    }
}
