//! The values a suite is written with (byte sizes, dtypes, positive counts) and the
//! checks every entry's deserializer shares: a mapping checked as a whole, and names
//! unique within their list.
use memsave_meter::Bytes;
use serde::de::value::MapAccessDeserializer;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;

/// A byte size as written in the suite (`60MiB`, `8 GiB`, `1048576`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Size {
    /// The size in bytes.
    pub bytes: u64,
    /// The text as written, used in canonical names.
    pub text: String,
}

/// A reduced-precision dtype for autocast, with the spelling the suite used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dtype {
    /// The libtorch kind (`BFloat16` or `Half`).
    pub kind: tch::Kind,
    /// The text as written (`bf16`, `fp16`, ...).
    pub text: String,
}

/// A name used twice in one list of a suite (`models:` or `strategies:`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("duplicate {what} name '{name}': names must be unique within a suite")]
pub(super) struct DuplicateName {
    /// `model` or `strategy`.
    what: &'static str,
    /// The name.
    name: String,
}

/// Claims `name` in `seen` (the names of the list being read, when there is one).
pub(super) fn claim_name(
    seen: Option<&mut HashSet<String>>,
    what: &'static str,
    name: &str,
) -> Result<(), DuplicateName> {
    match seen.map(|seen| seen.insert(name.to_owned())) {
        Some(false) => Err(DuplicateName {
            what,
            name: name.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// Deserializes a mapping into `R` with serde's derive, then checks it with `check`;
/// a failed check is reported at the mapping's position.
pub(super) fn validated_map<'de, D, R, T, E, F>(
    deserializer: D,
    expecting: &'static str,
    check: F,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    R: Deserialize<'de>,
    F: FnOnce(R) -> Result<T, E>,
    E: fmt::Display,
{
    struct Checked<R, E, F> {
        expecting: &'static str,
        check: F,
        raw: PhantomData<(R, E)>,
    }
    impl<'de, R, T, E, F> Visitor<'de> for Checked<R, E, F>
    where
        R: Deserialize<'de>,
        F: FnOnce(R) -> Result<T, E>,
        E: fmt::Display,
    {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str(self.expecting)
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
            let raw = R::deserialize(MapAccessDeserializer::new(map))?;
            (self.check)(raw).map_err(de::Error::custom)
        }
    }
    deserializer.deserialize_map(Checked {
        expecting,
        check,
        raw: PhantomData,
    })
}

/// A strictly positive integer of at most `MAX` (sizes, counts), reported at its own
/// position when out of range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Positive<const MAX: u64 = { u64::MAX }>(pub(super) u64);

impl<'de, const MAX: u64> Deserialize<'de> for Positive<MAX> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<const MAX: u64>;
        impl<const MAX: u64> Visitor<'_> for V<MAX> {
            type Value = Positive<MAX>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a positive integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Positive<MAX>, E> {
                if v == 0 {
                    Err(E::custom("must be positive, got 0"))
                } else if v > MAX {
                    Err(E::custom(format!("must be at most {MAX}, got {v}")))
                } else {
                    Ok(Positive(v))
                }
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Positive<MAX>, E> {
                match u64::try_from(v) {
                    Ok(v) => self.visit_u64(v),
                    Err(_) => Err(E::custom(format!("must be positive, got {v}"))),
                }
            }
        }
        d.deserialize_any(V::<MAX>)
    }
}

impl<const MAX: u64> Positive<MAX> {
    pub(super) fn usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }

    pub(super) fn i64(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Size;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a size such as 60MiB, 8 GiB or a number of bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Size, E> {
                if v == 0 {
                    return Err(E::custom("a size must be positive, got 0"));
                }
                Ok(Size {
                    bytes: v,
                    text: v.to_string(),
                })
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Size, E> {
                Err(E::custom(format!("a size must be positive, got {v}")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Size, E> {
                let bytes: Bytes = v.parse().map_err(E::custom)?;
                if bytes.0 == 0 {
                    return Err(E::custom(format!("a size must be positive, got '{v}'")));
                }
                Ok(Size {
                    bytes: bytes.0,
                    text: v.trim().to_owned(),
                })
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Dtype {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Dtype;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a dtype: bf16 or fp16")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Dtype, E> {
                let kind = match v {
                    "bf16" | "bfloat16" => tch::Kind::BFloat16,
                    "fp16" | "f16" | "float16" | "half" => tch::Kind::Half,
                    _ => {
                        return Err(E::custom(format!(
                            "unknown dtype '{v}', expected bf16 or fp16"
                        )))
                    }
                };
                Ok(Dtype {
                    kind,
                    text: v.to_owned(),
                })
            }
        }
        d.deserialize_str(V)
    }
}
