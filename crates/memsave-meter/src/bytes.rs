//! Byte counts for people: `Bytes(102_400_000)` prints as `97.66 MiB`, and sizes such
//! as `60MiB`, `8 GiB` or `1.5GB` parse.
use std::fmt;
use std::str::FromStr;

/// A byte count that prints with binary units (`97.66 MiB`) and parses from text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Bytes(pub u64);

const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];

/// The unit `bytes` is shown in (the largest at most `bytes`, up to TiB) and its size.
fn unit_of(bytes: u64) -> (u64, &'static str) {
    let mut unit = 0;
    let mut scale = 1u64;
    while bytes / scale >= 1024 && unit + 1 < UNITS.len() {
        scale *= 1024;
        unit += 1;
    }
    (scale, UNITS[unit])
}

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let (scale, unit) = unit_of(self.0);
        // (A power of two: the division is exact before the rounding.)
        write!(f, "{:.2} {unit}", self.0 as f64 / scale as f64)
    }
}

/// A byte count shown as [`Bytes`] shows it, but rounded up in its last digit, so that
/// the text parsed back is never less than the count: for "give a budget of at least
/// ...", which a user copies into the next command (`2.00 MiB` for 2 MiB and 64 bytes
/// would be refused again; this shows `2.01 MiB`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BytesAtLeast(pub u64);

impl fmt::Display for BytesAtLeast {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 < 1024 {
            return write!(f, "{} B", self.0);
        }
        let (scale, unit) = unit_of(self.0);
        // Hundredths of the unit, rounded up, in integers (no float rounding).
        let hundredths = (self.0 as u128 * 100).div_ceil(scale as u128);
        write!(f, "{}.{:02} {unit}", hundredths / 100, hundredths % 100)
    }
}

/// `Bytes(n).to_string()`: a byte count with binary units, e.g. `97.66 MiB`.
pub fn format_bytes(bytes: u64) -> String {
    Bytes(bytes).to_string()
}

/// Why a size did not parse; says what is accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseBytesError {
    /// Not a number with an optional unit.
    #[error("invalid size '{input}': expected a non-negative number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 60MiB")]
    Invalid {
        /// The text given.
        input: String,
    },
    /// A well-formed size of more than `u64::MAX` bytes.
    #[error(
        "size '{input}' is too large: at most {} bytes (16 EiB) can be counted",
        u64::MAX
    )]
    TooLarge {
        /// The text given.
        input: String,
    },
}

/// Parses sizes such as `4096`, `60MiB`, `8 GiB`, `1.5GB` or `122.05KiB`, exactly.
///
/// The arithmetic is done on the decimal digits, never through a float, so every
/// integer up to `u64::MAX` parses to itself and anything larger is
/// [`ParseBytesError::TooLarge`]. A fraction of a unit is allowed and rounded *up* to
/// the next whole byte (`0.0001KiB` is 1 byte, `122.05KiB` is 124,980 bytes), so a
/// size printed with two decimals and parsed back is never below the original; a
/// fraction of a plain byte (`0.5B`) is rejected, as a byte count has none.
impl FromStr for Bytes {
    type Err = ParseBytesError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || ParseBytesError::Invalid {
            input: s.to_owned(),
        };
        let trimmed = s.trim();
        let split = trimmed
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(trimmed.len());
        let (number, unit) = trimmed.split_at(split);
        let (integer, fraction) = number.split_once('.').unwrap_or((number, ""));
        if (integer.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return Err(invalid());
        }
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
            _ => return Err(invalid()),
        };
        if multiplier == 1 && fraction.bytes().any(|d| d != b'0') {
            return Err(invalid());
        }
        scale_decimal(integer, fraction, multiplier)
            .map(Bytes)
            .ok_or_else(|| ParseBytesError::TooLarge {
                input: s.to_owned(),
            })
    }
}

/// `ceil(integer.fraction * multiplier)` from ASCII digits, or `None` past `u64::MAX`.
///
/// Long multiplication of the digit string by `multiplier`, least significant digit
/// first; the lowest `fraction.len()` digits of the product are its fraction.
fn scale_decimal(integer: &str, fraction: &str, multiplier: u64) -> Option<u64> {
    let digits = integer.bytes().chain(fraction.bytes()).map(|d| d - b'0');
    let mut product_digits = Vec::with_capacity(integer.len() + fraction.len() + 20);
    let mut carry: u128 = 0;
    for d in digits.rev() {
        let v = u128::from(d) * u128::from(multiplier) + carry;
        product_digits.push((v % 10) as u8);
        carry = v / 10;
    }
    while carry > 0 {
        product_digits.push((carry % 10) as u8);
        carry /= 10;
    }
    let (fraction_digits, integer_digits) =
        product_digits.split_at(fraction.len().min(product_digits.len()));
    let mut bytes: u64 = 0;
    for &d in integer_digits.iter().rev() {
        bytes = bytes.checked_mul(10)?.checked_add(u64::from(d))?;
    }
    if fraction_digits.iter().any(|&d| d != 0) {
        bytes = bytes.checked_add(1)?;
    }
    Some(bytes)
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
    fn at_least_rounds_up_so_that_the_text_is_never_less() {
        // 2 MiB and 64 bytes: Bytes shows 2.00 MiB, which parses back to less.
        let n = (2 << 20) + 64;
        assert_eq!(Bytes(n).to_string(), "2.00 MiB");
        assert_eq!(BytesAtLeast(n).to_string(), "2.01 MiB");
        assert_eq!(BytesAtLeast(2 << 20).to_string(), "2.00 MiB");
        assert_eq!(BytesAtLeast(1023).to_string(), "1023 B");
        assert_eq!(BytesAtLeast(1025).to_string(), "1.01 KiB");
        for n in [1024, 1025, 5_000_000, (3 << 30) + 1, u64::MAX / 2] {
            let back: Bytes = BytesAtLeast(n)
                .to_string()
                .replace(' ', "")
                .parse()
                .unwrap();
            assert!(back.0 >= n, "{n}: {}", BytesAtLeast(n));
        }
    }

    #[test]
    fn parses_sizes_and_rejects_garbage() {
        assert_eq!("60MiB".parse::<Bytes>(), Ok(Bytes(60 << 20)));
        assert_eq!("8 GiB".parse::<Bytes>(), Ok(Bytes(8 << 30)));
        assert_eq!("1.5GB".parse::<Bytes>(), Ok(Bytes(1_500_000_000)));
        assert_eq!("4096".parse::<Bytes>(), Ok(Bytes(4096)));
        for bad in [
            "60MB!",
            "",
            "MiB",
            "-1MiB",
            "1.2.3KB",
            "0.5B",
            "10 parsecs",
            ".",
            "1e3",
            "+5",
        ] {
            let e = bad.parse::<Bytes>().unwrap_err();
            assert!(
                e.to_string().contains("expected a non-negative number"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn integers_parse_exactly_up_to_u64_max() {
        // 2^53 + 1: the first integer an f64 cannot hold.
        assert_eq!(
            "9007199254740993".parse::<Bytes>(),
            Ok(Bytes(9_007_199_254_740_993))
        );
        assert_eq!("18446744073709551615".parse::<Bytes>(), Ok(Bytes(u64::MAX)));
        assert_eq!("0000000000000000000000042".parse::<Bytes>(), Ok(Bytes(42)));
        assert_eq!(
            "8796093022207 KiB".parse::<Bytes>(),
            Ok(Bytes(8_796_093_022_207 * 1024))
        );
    }

    #[test]
    fn sizes_past_u64_max_are_an_error() {
        for too_large in [
            "18446744073709551616",
            "99999999999999999999999999",
            "16777216TiB",
            "18446744073709551615.5KiB",
            "18446744073709551.616KB",
        ] {
            let e = too_large.parse::<Bytes>().unwrap_err();
            assert!(
                matches!(e, ParseBytesError::TooLarge { .. }),
                "{too_large}: {e:?}"
            );
            assert!(e.to_string().contains("too large"), "{e}");
        }
        // The largest size that still fits: 16 EiB - 1 byte, as a fraction of a unit.
        assert_eq!(
            "18446744073709551.615KB".parse::<Bytes>(),
            Ok(Bytes(u64::MAX))
        );
    }

    #[test]
    fn fractions_of_a_unit_round_up_to_whole_bytes() {
        // 122.05 * 1024 = 124979.2
        assert_eq!("122.05KiB".parse::<Bytes>(), Ok(Bytes(124_980)));
        // 122.04 * 1024 = 124968.96: a printed size parses back to at least its bytes.
        assert_eq!("122.04KiB".parse::<Bytes>(), Ok(Bytes(124_969)));
        assert_eq!("0.0001KiB".parse::<Bytes>(), Ok(Bytes(1)));
        assert_eq!(".5KiB".parse::<Bytes>(), Ok(Bytes(512)));
        assert_eq!("5.".parse::<Bytes>(), Ok(Bytes(5)));
        assert_eq!("1.000B".parse::<Bytes>(), Ok(Bytes(1)));
        assert_eq!("2.50 MB".parse::<Bytes>(), Ok(Bytes(2_500_000)));
        assert_eq!(
            "0.0000000000000000000000000001TiB".parse::<Bytes>(),
            Ok(Bytes(1))
        );
        assert_eq!(
            "1.0000000000000000000000000000KiB".parse::<Bytes>(),
            Ok(Bytes(1024))
        );
    }
}
