//! The stand-in's own reading of resource quantities, written from
//! `k8s.io/apimachinery/pkg/api/resource` (`ParseQuantity`, `parseQuantityString`,
//! `Quantity.Value`), never from cleave's parser: a quantity cleave reads wrongly must not
//! pass here for the same reason.
//!
//! ```text
//! <quantity>        ::= <signedNumber><suffix>
//! <signedNumber>    ::= [+-]? digits | [+-]? digits.digits? | [+-]? .digits
//! <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
//! <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
//! <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
//! <decimalExponent> ::= e <signedNumber> | E <signedNumber>   (a whole exponent)
//! ```
//!
//! Unlike cleave, the API server takes fractions (`0.5`, `1500m`) and its `Value()` rounds
//! them away from zero; so does [`value`]. Quirks kept from upstream: `+` is a sign, `1.`
//! and `.5` are numbers, `-`/`+` alone read as zero, a binary quantity beyond `i64` is
//! capped at `i64::MAX`. One difference: a decimal value beyond `i64` is an error here,
//! where the API server keeps a big decimal.

/// Why the text is not a quantity; the first three carry upstream's messages.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// `ErrFormatWrong`.
    #[error(
        "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
    )]
    Format,
    /// `ErrSuffix`.
    #[error("unable to parse quantity's suffix")]
    Suffix,
    /// `ErrNumeric`.
    #[error("unable to parse numeric part of quantity")]
    Numeric,
    /// The value does not fit in an `i64` (the stand-in keeps no big decimals).
    #[error("quantity out of range for the stand-in (beyond a signed 64-bit integer)")]
    OutOfRange,
}

/// The parts `parseQuantityString` splits a quantity into.
struct Parts<'a> {
    negative: bool,
    /// Integer digits without leading zeros.
    num: &'a str,
    /// Fraction digits.
    denom: &'a str,
    suffix: &'a str,
}

fn digits_end(s: &[u8], from: usize) -> usize {
    s[from..]
        .iter()
        .position(|b| !b.is_ascii_digit())
        .map_or(s.len(), |n| from + n)
}

/// Splits like upstream's `parseQuantityString`.
fn split(text: &str) -> Result<Parts<'_>, QuantityError> {
    let b = text.as_bytes();
    let mut pos = 0;
    let mut negative = false;
    match b.first() {
        Some(b'-') => {
            negative = true;
            pos = 1;
        }
        Some(b'+') => pos = 1,
        _ => {}
    }
    while b.get(pos) == Some(&b'0') {
        pos += 1;
    }
    let num_end = digits_end(b, pos);
    let num = &text[pos..num_end];
    pos = num_end;
    let mut denom = "";
    if b.get(pos) == Some(&b'.') {
        let end = digits_end(b, pos + 1);
        denom = &text[pos + 1..end];
        pos = end;
    }
    let suffix_start = pos;
    while b.get(pos).is_some_and(|c| b"eEinumkKMGTP".contains(c)) {
        pos += 1;
    }
    if matches!(b.get(pos), Some(b'-' | b'+')) {
        pos += 1;
    }
    if digits_end(b, pos) != b.len() {
        return Err(QuantityError::Format);
    }
    Ok(Parts {
        negative,
        num,
        denom,
        suffix: &text[suffix_start..],
    })
}

/// What a suffix multiplies by: `2^exp` or `10^exp`.
enum Scale {
    Binary(u32),
    Decimal(i32),
}

/// Upstream's `quantitySuffixer.interpret`.
fn interpret(suffix: &str) -> Result<Scale, QuantityError> {
    Ok(match suffix {
        "Ki" => Scale::Binary(10),
        "Mi" => Scale::Binary(20),
        "Gi" => Scale::Binary(30),
        "Ti" => Scale::Binary(40),
        "Pi" => Scale::Binary(50),
        "Ei" => Scale::Binary(60),
        "n" => Scale::Decimal(-9),
        "u" => Scale::Decimal(-6),
        "m" => Scale::Decimal(-3),
        "" => Scale::Decimal(0),
        "k" => Scale::Decimal(3),
        "M" => Scale::Decimal(6),
        "G" => Scale::Decimal(9),
        "T" => Scale::Decimal(12),
        "P" => Scale::Decimal(15),
        "E" => Scale::Decimal(18),
        s if s.len() > 1 && (s.starts_with('e') || s.starts_with('E')) => {
            Scale::Decimal(s[1..].parse::<i32>().map_err(|_| QuantityError::Suffix)?)
        }
        _ => return Err(QuantityError::Suffix),
    })
}

/// The largest magnitude an `i64` holds with either sign.
const MAX: u128 = i64::MAX as u128;

/// `n / 10^k`, rounded up (for non-negative `n`).
fn div_pow10_ceil(n: u128, k: u32) -> u128 {
    match 10u128.checked_pow(k) {
        Some(d) => n.div_ceil(d),
        None => u128::from(n != 0),
    }
}

/// The value the API server's `Quantity.Value()` gives: the quantity rounded away from zero
/// to a whole number.
pub fn value(text: &str) -> Result<i64, QuantityError> {
    if text.is_empty() {
        return Err(QuantityError::Format);
    }
    let parts = split(text)?;
    let scale = interpret(parts.suffix)?;
    // All digits as one integer; the fraction's length moves the decimal exponent.
    let digits = format!("{}{}", parts.num, parts.denom);
    let digits = digits.trim_start_matches('0');
    let mantissa: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| QuantityError::OutOfRange)?
    };
    let frac = u32::try_from(parts.denom.len()).map_err(|_| QuantityError::Numeric)?;
    let magnitude = match scale {
        // Upstream caps a binary quantity's magnitude at the largest `i64`.
        Scale::Binary(exp) => mantissa
            .checked_mul(1u128 << exp)
            .map_or(MAX, |shifted| div_pow10_ceil(shifted, frac).min(MAX)),
        Scale::Decimal(exp) => {
            let exp = i64::from(exp) - i64::from(frac);
            if mantissa == 0 {
                0
            } else if exp >= 0 {
                let exp = u32::try_from(exp).map_err(|_| QuantityError::OutOfRange)?;
                10u128
                    .checked_pow(exp)
                    .and_then(|m| mantissa.checked_mul(m))
                    .ok_or(QuantityError::OutOfRange)?
            } else {
                let k = u32::try_from(-exp).unwrap_or(u32::MAX);
                div_pow10_ceil(mantissa, k)
            }
        }
    };
    let magnitude = i128::try_from(magnitude).map_err(|_| QuantityError::OutOfRange)?;
    let signed = if parts.negative {
        -magnitude
    } else {
        magnitude
    };
    i64::try_from(signed).map_err(|_| QuantityError::OutOfRange)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_examples() {
        let ok = [
            ("0", 0),
            ("10Gi", 10 << 30),
            ("512Mi", 512 << 20),
            ("1.5Gi", 3 << 29),
            ("1e9", 1_000_000_000),
            ("1E3", 1000),
            ("1e+3", 1000),
            ("100k", 100_000),
            ("1M", 1_000_000),
            ("1E", 1_000_000_000_000_000_000),
            ("+5", 5),
            ("-5", -5),
            ("007", 7),
            ("1.", 1),
            (".5", 1),
            ("0.5", 1),
            ("-0.5", -1),
            ("1500m", 2),
            ("1000m", 1),
            ("1n", 1),
            ("1e-3", 1),
            ("1.1Ki", 1127),
            ("-", 0),
            ("+", 0),
        ];
        for (text, want) in ok {
            assert_eq!(value(text), Ok(want), "{text}");
        }
        let bad = [
            ("", QuantityError::Format),
            ("abc", QuantityError::Format),
            ("1 Gi", QuantityError::Format),
            ("1Gi ", QuantityError::Format),
            ("1.5.5", QuantityError::Format),
            ("1x", QuantityError::Format),
            ("1K", QuantityError::Suffix),
            ("1ki", QuantityError::Suffix),
            ("1e", QuantityError::Suffix),
            ("1Gie3", QuantityError::Suffix),
            ("1e99999999999", QuantityError::Suffix),
            ("9223372036854775808", QuantityError::OutOfRange),
            ("1e19", QuantityError::OutOfRange),
        ];
        for (text, want) in bad {
            assert_eq!(value(text), Err(want), "{text}");
        }
        assert_eq!(value("9223372036854775807"), Ok(i64::MAX));
        assert_eq!(value("8Ei"), Ok(i64::MAX));
        assert_eq!(value("-8Ei"), Ok(-i64::MAX));
        assert_eq!(value("-9223372036854775808"), Ok(i64::MIN));
    }

    /// Both readings over many quantities: where cleave's parser takes a value the API
    /// server takes the same value, and where they differ it is by a rule each side
    /// states (cleave refuses fractions, values beyond `i64` and longer texts; upstream
    /// reads a bare sign or point as zero and caps binary values). It found cleave
    /// refusing the `n` and `u` suffixes.
    #[test]
    fn cross_check_with_cleave_parser() {
        use cleave_api::quantity::{Quantity, QuantityError as Product};

        let signs = ["", "-", "+"];
        let ints = [
            "",
            "0",
            "1",
            "7",
            "10",
            "007",
            "123",
            "1024",
            "9223372036854775807",
            "9223372036854775808",
            "99999999999999999999999",
        ];
        let fracs = [
            None,
            Some(""),
            Some("0"),
            Some("5"),
            Some("25"),
            Some("000"),
            Some("125"),
            Some("0000000001"),
        ];
        let suffixes = [
            "", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei",
            "e0", "e3", "e-3", "E+2", "e18", "e19", "e-9", "e-40", "K", "ki", "e", "x", "Gi3", " ",
            "i", "mi",
        ];
        let mut texts = Vec::new();
        for sign in signs {
            for int in ints {
                for frac in fracs {
                    for suffix in suffixes {
                        let frac = frac.map_or(String::new(), |f| format!(".{f}"));
                        texts.push(format!("{sign}{int}{frac}{suffix}"));
                    }
                }
            }
        }
        texts.extend(
            [
                "", " 1", "1 ", "1.5.5", "--1", "1-", "0x10", "1_000", "١", "1e1.5", "Gi",
            ]
            .map(str::to_owned),
        );

        let mut wrong = Vec::new();
        for text in &texts {
            let product = Quantity::parse(text).map(|q| q.value());
            let ours = value(text);
            let agreed = match (&product, &ours) {
                (Ok(p), Ok(o)) => p == o,
                (Err(Product::Fraction { .. }), Ok(_) | Err(QuantityError::OutOfRange)) => true,
                (Err(Product::Overflow { .. }), Err(QuantityError::OutOfRange)) => true,
                (Err(Product::Overflow { .. }), Ok(v)) => v.unsigned_abs() == i64::MAX as u64,
                (Err(Product::Syntax { reason, .. }), Ok(0)) => *reason == "expected a number",
                (Err(Product::Syntax { .. }), Err(_)) => true,
                (Err(Product::Syntax { reason, .. }), Ok(_)) => {
                    *reason == "longer than 128 characters"
                }
                _ => false,
            };
            if !agreed {
                wrong.push(format!("{text:?}: cleave {product:?}, stand-in {ours:?}"));
            }
        }
        assert!(
            wrong.is_empty(),
            "{} of {}: {wrong:#?}",
            wrong.len(),
            texts.len()
        );
        assert!(texts.len() > 8000, "{}", texts.len());
    }
}
