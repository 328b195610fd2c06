//! Kubernetes quantities (`10Gi`, `512Mi`, `1e9`, `1.5Gi`, `100k`) as exact integers.
//!
//! The grammar is the one of `k8s.io/apimachinery/pkg/api/resource`:
//!
//! ```text
//! <quantity>        ::= <sign>? <number> <suffix>
//! <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
//! <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
//! <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
//! <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
//! <decimalExponent> ::= e <sign>? <digits> | E <sign>? <digits>
//! ```
//!
//! Unlike Kubernetes, which rounds, cleave wants an exact count of units (bytes for
//! memory): a value that is not a whole number after scaling (`0.5`, `1500m`, `1.1Ki`)
//! is an error, and so is anything outside `i64`. The original text is kept, so that a
//! value displays and serialises exactly as the user wrote it.

use std::fmt;
use std::str::FromStr;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why a string is not a usable quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// The text does not follow the quantity grammar.
    #[error("invalid quantity {text:?}: {reason}")]
    Syntax {
        /// The text as given.
        text: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The value is not a whole number of units after scaling.
    #[error("invalid quantity {text:?}: not a whole number of bytes")]
    Fraction {
        /// The text as given.
        text: String,
    },
    /// The value does not fit in a signed 64-bit integer.
    #[error("invalid quantity {text:?}: out of range")]
    Overflow {
        /// The text as given.
        text: String,
    },
}

/// A Kubernetes quantity with an exact integer value and its original text.
///
/// Equality compares both the value and the text, so that a value survives a
/// serialise/decode round trip unchanged; compare [`Quantity::value`] for numeric
/// equality (`1Ki` and `1024` have the same value).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Quantity {
    text: String,
    value: i64,
}

impl Quantity {
    /// Parses a quantity; see the module docs for the grammar and what is rejected.
    pub fn parse(text: &str) -> Result<Self, QuantityError> {
        let value = parse_value(text)?;
        Ok(Self {
            text: text.to_owned(),
            value,
        })
    }

    /// Builds the quantity of a plain integer (text is its decimal form).
    pub fn from_int(value: i64) -> Self {
        Self {
            text: value.to_string(),
            value,
        }
    }

    /// The exact value (bytes, for memory quantities).
    pub fn value(&self) -> i64 {
        self.value
    }

    /// The text as the user wrote it.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// True when the value is greater than zero.
    pub fn is_positive(&self) -> bool {
        self.value > 0
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl FromStr for Quantity {
    type Err = QuantityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    /// Accepts a string (the usual form) or a JSON number, as the API server does.
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct QuantityVisitor;

        impl Visitor<'_> for QuantityVisitor {
            type Value = Quantity;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes quantity such as \"10Gi\"")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Quantity, E> {
                Quantity::parse(v).map_err(E::custom)
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Quantity, E> {
                Ok(Quantity::from_int(v))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Quantity, E> {
                let value = i64::try_from(v).map_err(|_| {
                    E::custom(QuantityError::Overflow {
                        text: v.to_string(),
                    })
                })?;
                Ok(Quantity::from_int(value))
            }

            /// YAML `1e9` reaches JSON as a float; whole floats are taken exactly.
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Quantity, E> {
                let text = v.to_string();
                if !v.is_finite() || v.abs() >= 2f64.powi(63) {
                    return Err(E::custom(QuantityError::Overflow { text }));
                }
                if v.fract() != 0.0 {
                    return Err(E::custom(QuantityError::Fraction { text }));
                }
                // In range and whole: the cast is exact.
                let value = v as i64;
                Ok(Quantity { text, value })
            }
        }

        deserializer.deserialize_any(QuantityVisitor)
    }
}

/// Longest text accepted; real quantities are a handful of characters.
const MAX_TEXT_LEN: usize = 128;

fn parse_value(text: &str) -> Result<i64, QuantityError> {
    let syntax = |reason| QuantityError::Syntax {
        text: text.to_owned(),
        reason,
    };
    if text.is_empty() {
        return Err(syntax("empty"));
    }
    if text.len() > MAX_TEXT_LEN {
        return Err(syntax("longer than 128 characters"));
    }
    let (negative, int_digits, frac_digits, suffix) = split_number(text);
    if int_digits.is_empty() && frac_digits.is_empty() {
        return Err(syntax("expected a number"));
    }
    let (exp10, exp2) = suffix_exponents(suffix).ok_or_else(|| {
        syntax(if suffix.starts_with(['e', 'E']) {
            "exponent must be an optionally signed decimal integer"
        } else {
            "unknown suffix"
        })
    })?;

    // Significant digits, with the decimal point folded into the exponent; leading
    // zeros dropped and trailing zeros moved into the exponent, so that the mantissa
    // stays small for any value that can fit.
    let all_digits = int_digits.bytes().chain(frac_digits.bytes());
    let mut exp10 = exp10 - frac_digits.len() as i64;
    let significant: Vec<u8> = all_digits.skip_while(|d| *d == b'0').collect();
    let trimmed_len = significant
        .iter()
        .rposition(|d| *d != b'0')
        .map_or(0, |i| i + 1);
    exp10 += (significant.len() - trimmed_len) as i64;
    let significant = &significant[..trimmed_len];
    if significant.is_empty() {
        return Ok(0);
    }
    let overflow = || QuantityError::Overflow {
        text: text.to_owned(),
    };
    let magnitude = exact_magnitude(significant, exp10, exp2).map_err(|e| match e {
        Inexact::Overflow => overflow(),
        Inexact::Fraction => QuantityError::Fraction {
            text: text.to_owned(),
        },
    })?;
    if negative {
        if magnitude > i64::MAX as u128 + 1 {
            return Err(overflow());
        }
        // Two's complement of a magnitude up to 2^63 fits i128 and then i64.
        i64::try_from(-(magnitude as i128)).map_err(|_| overflow())
    } else {
        i64::try_from(magnitude).map_err(|_| overflow())
    }
}

/// `text` as sign, integer digits, fraction digits (after a `.`) and the rest, the suffix.
fn split_number(text: &str) -> (bool, &str, &str, &str) {
    let bytes = text.as_bytes();
    let (negative, mut pos) = match bytes.first() {
        Some(b'-') => (true, 1),
        Some(b'+') => (false, 1),
        _ => (false, 0),
    };
    let digits_from = |start: usize| {
        start
            + bytes[start..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .count()
    };
    let int_start = pos;
    pos = digits_from(pos);
    let int_digits = &text[int_start..pos];
    let mut frac_digits = "";
    if pos < bytes.len() && bytes[pos] == b'.' {
        let frac_start = pos + 1;
        pos = digits_from(frac_start);
        frac_digits = &text[frac_start..pos];
    }
    (negative, int_digits, frac_digits, &text[pos..])
}

/// The powers of ten and of two a suffix stands for; `None` for an unknown suffix or a
/// malformed exponent.
fn suffix_exponents(suffix: &str) -> Option<(i64, u32)> {
    Some(match suffix {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        s if s.starts_with(['e', 'E']) => (parse_exponent(&s[1..])?, 0),
        _ => return None,
    })
}

/// Why a value is not an exact integer magnitude.
enum Inexact {
    /// Beyond u128.
    Overflow,
    /// Not a whole number.
    Fraction,
}

/// `significant` (decimal digits, no leading or trailing zeros) × 10^`exp10` × 2^`exp2`,
/// exactly.
fn exact_magnitude(significant: &[u8], exp10: i64, exp2: u32) -> Result<u128, Inexact> {
    if significant.len() > 38 {
        // The mantissa has no trailing zeros; more than 38 digits is either beyond
        // u128 or, divided by a power of ten, still not an integer below 2^63.
        return Err(if exp10 >= 0 {
            Inexact::Overflow
        } else {
            Inexact::Fraction
        });
    }
    let mut mantissa: u128 = 0;
    for d in significant {
        mantissa = mantissa * 10 + u128::from(d - b'0');
    }
    if exp10 >= 0 {
        let exp10 = u32::try_from(exp10).map_err(|_| Inexact::Overflow)?;
        return 10u128
            .checked_pow(exp10)
            .and_then(|p| mantissa.checked_mul(p))
            .and_then(|v| v.checked_mul(1u128 << exp2))
            .ok_or(Inexact::Overflow);
    }
    // Divide by 5^k and 2^k separately: 2^exp2 cancels part of the 2^k.
    let k = u32::try_from(-exp10).map_err(|_| Inexact::Fraction)?;
    let p5 = 5u128.checked_pow(k).ok_or(Inexact::Fraction)?;
    if !mantissa.is_multiple_of(p5) {
        return Err(Inexact::Fraction);
    }
    let m = mantissa / p5;
    if exp2 >= k {
        m.checked_mul(1u128 << (exp2 - k)).ok_or(Inexact::Overflow)
    } else {
        let shift = k - exp2;
        if shift >= 128 || !m.is_multiple_of(1u128 << shift) {
            return Err(Inexact::Fraction);
        }
        Ok(m >> shift)
    }
}

/// Parses `[+-]digits` of a decimal exponent, bounded so that arithmetic cannot overflow.
fn parse_exponent(s: &str) -> Option<i64> {
    let (negative, digits) = match s.as_bytes().first()? {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    if digits.is_empty() || digits.len() > 9 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let v: i64 = digits.parse().ok()?;
    Some(if negative { -v } else { v })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> i64 {
        Quantity::parse(s)
            .unwrap_or_else(|e| panic!("{s:?}: {e}"))
            .value()
    }

    fn err(s: &str) -> String {
        Quantity::parse(s).unwrap_err().to_string()
    }

    #[test]
    fn plain_and_decimal_si() {
        assert_eq!(v("0"), 0);
        assert_eq!(v("5"), 5);
        assert_eq!(v("+5"), 5);
        assert_eq!(v("-5"), -5);
        assert_eq!(v("100k"), 100_000);
        assert_eq!(v("1M"), 1_000_000);
        assert_eq!(v("1G"), 1_000_000_000);
        assert_eq!(v("2T"), 2_000_000_000_000);
        assert_eq!(v("3P"), 3_000_000_000_000_000);
        assert_eq!(v("1E"), 1_000_000_000_000_000_000);
        assert_eq!(v("1000m"), 1);
        assert_eq!(v("1.5k"), 1500);
        assert_eq!(v("1.G"), 1_000_000_000);
        assert_eq!(v(".5k"), 500);
        assert_eq!(v("1000000000n"), 1);
        assert_eq!(v("3000000u"), 3);
        assert_eq!(
            err("1n"),
            "invalid quantity \"1n\": not a whole number of bytes"
        );
    }

    #[test]
    fn binary_si() {
        assert_eq!(v("1Ki"), 1024);
        assert_eq!(v("512Mi"), 512 << 20);
        assert_eq!(v("10Gi"), 10 << 30);
        assert_eq!(v("1.5Gi"), 3 << 29);
        assert_eq!(v("0.5Ki"), 512);
        assert_eq!(v("1Ti"), 1 << 40);
        assert_eq!(v("1Pi"), 1 << 50);
        assert_eq!(v("7Ei"), 7 << 60);
        assert_eq!(v("-1Gi"), -(1 << 30));
        // 2^-10 Ki is one byte.
        assert_eq!(v("0.0009765625Ki"), 1);
    }

    #[test]
    fn exponents() {
        assert_eq!(v("1e9"), 1_000_000_000);
        assert_eq!(v("1E9"), 1_000_000_000);
        assert_eq!(v("1e+3"), 1000);
        assert_eq!(v("20e-1"), 2);
        assert_eq!(v("1.5e+1"), 15);
        assert_eq!(v("2000e-3"), 2);
        assert_eq!(v("0e400"), 0);
        assert_eq!(v("1.5e3"), 1500);
    }

    #[test]
    fn zeros_and_long_mantissas() {
        assert_eq!(v("0.0"), 0);
        assert_eq!(v("-0"), 0);
        assert_eq!(v("000000000000000000000000000000000000000000001"), 1);
        assert_eq!(v("1.000000000000000000000000000000000000000000"), 1);
        assert_eq!(v("100000000000000000000000000000000000000000e-40"), 10);
    }

    #[test]
    fn limits_of_i64() {
        assert_eq!(v("9223372036854775807"), i64::MAX);
        assert_eq!(v("-9223372036854775808"), i64::MIN);
        assert_eq!(
            err("9223372036854775808"),
            "invalid quantity \"9223372036854775808\": out of range"
        );
        assert_eq!(err("8Ei"), "invalid quantity \"8Ei\": out of range");
        assert_eq!(v("-8Ei"), i64::MIN);
        assert_eq!(err("1e19"), "invalid quantity \"1e19\": out of range");
        assert_eq!(
            err("1e999999999"),
            "invalid quantity \"1e999999999\": out of range"
        );
        assert_eq!(
            err("123456789012345678901234567890123456789012"),
            "invalid quantity \"123456789012345678901234567890123456789012\": out of range"
        );
    }

    #[test]
    fn fractions_are_rejected() {
        for s in [
            "0.5",
            "1500m",
            "1.1Ki",
            "1m",
            "1e-1",
            "1e-999999999",
            "0.3Gi",
        ] {
            assert_eq!(
                err(s),
                format!("invalid quantity {s:?}: not a whole number of bytes"),
                "{s}"
            );
        }
        // 0.3 Gi is 322122547.2 bytes; 0.25Gi is exact.
        assert_eq!(v("0.25Gi"), 1 << 28);
    }

    #[test]
    fn syntax_errors_name_the_reason() {
        assert_eq!(err(""), "invalid quantity \"\": empty");
        assert_eq!(err("Gi"), "invalid quantity \"Gi\": expected a number");
        assert_eq!(err("."), "invalid quantity \".\": expected a number");
        assert_eq!(err("-"), "invalid quantity \"-\": expected a number");
        assert_eq!(err("10Gb"), "invalid quantity \"10Gb\": unknown suffix");
        assert_eq!(err("10 Gi"), "invalid quantity \"10 Gi\": unknown suffix");
        assert_eq!(err("1.2.3"), "invalid quantity \"1.2.3\": unknown suffix");
        assert_eq!(err("10KI"), "invalid quantity \"10KI\": unknown suffix");
        assert_eq!(err("+-1"), "invalid quantity \"+-1\": expected a number");
        assert_eq!(
            err("1e"),
            "invalid quantity \"1e\": exponent must be an optionally signed decimal integer"
        );
        assert_eq!(
            err("1e1.5"),
            "invalid quantity \"1e1.5\": exponent must be an optionally signed decimal integer"
        );
        assert_eq!(
            err("1e1234567890"),
            "invalid quantity \"1e1234567890\": exponent must be an optionally signed decimal integer"
        );
        let long = "1".repeat(129);
        assert_eq!(
            err(&long),
            format!("invalid quantity {long:?}: longer than 128 characters")
        );
    }

    #[test]
    fn keeps_original_text() {
        let q = Quantity::parse("1.5Gi").unwrap();
        assert_eq!(q.to_string(), "1.5Gi");
        assert_eq!(q.as_str(), "1.5Gi");
        assert_eq!(
            serde_json::to_value(&q).unwrap(),
            serde_json::json!("1.5Gi")
        );
        assert!(q.is_positive());
        assert!(!Quantity::parse("0").unwrap().is_positive());
        assert_ne!(
            Quantity::parse("1Ki").unwrap(),
            Quantity::parse("1024").unwrap()
        );
    }

    #[test]
    fn deserialises_strings_and_integers() {
        let q: Quantity = serde_json::from_value(serde_json::json!("10Gi")).unwrap();
        assert_eq!(q.value(), 10 << 30);
        let q: Quantity = serde_json::from_value(serde_json::json!(1024)).unwrap();
        assert_eq!((q.value(), q.as_str()), (1024, "1024"));
        let q: Quantity = serde_json::from_value(serde_json::json!(-3)).unwrap();
        assert_eq!(q.value(), -3);
        let e = serde_json::from_value::<Quantity>(serde_json::json!(u64::MAX)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid quantity \"18446744073709551615\": out of range"
        );
        let e = serde_json::from_value::<Quantity>(serde_json::json!(0.5)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid quantity \"0.5\": not a whole number of bytes"
        );
        let q: Quantity = serde_json::from_value(serde_json::json!(1e9)).unwrap();
        assert_eq!((q.value(), q.as_str()), (1_000_000_000, "1000000000"));
        let q: Quantity = serde_json::from_value(serde_json::json!(-2048.0)).unwrap();
        assert_eq!(q.value(), -2048);
        let e = serde_json::from_value::<Quantity>(serde_json::json!(1e19)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid quantity \"10000000000000000000\": out of range"
        );
        let e = serde_json::from_value::<Quantity>(serde_json::json!(true)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid type: boolean `true`, expected a Kubernetes quantity such as \"10Gi\""
        );
        let e = serde_json::from_value::<Quantity>(serde_json::json!("x")).unwrap_err();
        assert_eq!(e.to_string(), "invalid quantity \"x\": expected a number");
    }
}
