//! YAML that YAML 1.1 readers read back as written.
//!
//! serde_yaml writes YAML 1.2: it quotes a string only when a 1.2 reader would take it for
//! something else. YAML 1.1 readers (PyYAML, Ruby's Psych, many operator tools) have more
//! implicit types, so a plain `0000:53:00.0` (a PCI bus ID) reads there as the base-60 float
//! 3180.0, `yes`/`on` as booleans and `1_000` as an integer. [`yaml11_safe`] single-quotes
//! every plain scalar that a 1.1 reader would not read as a string while a 1.2 reader does
//! (the implicit types of the YAML 1.1 type repository, yaml.org/type: bool, int, float,
//! null, timestamp, in the forms PyYAML's resolver matches; and those of the 1.2 core
//! schema).

use std::sync::LazyLock;

use regex::Regex;

/// Plain scalars YAML 1.1 resolves to something other than a string.
static YAML11_NON_STRING: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(concat!(
        r"^(?:",
        // bool
        r"y|Y|yes|Yes|YES|n|N|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF",
        // null
        r"|~|null|Null|NULL",
        // int: binary, octal, decimal, hex, base 60
        r"|[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+",
        r"|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+",
        // float: decimal, base 60, infinity, not a number
        r"|[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?",
        r"|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*",
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)",
        // timestamp
        r"|[0-9]{4}-[0-9]{1,2}-[0-9]{1,2}(?:[Tt ].*)?",
        r")$"
    ))
    .ok()
});

/// Plain scalars the YAML 1.2 core schema resolves to something other than a string:
/// what serde_yaml writes plain for real numbers, booleans and nulls.
static YAML12_NON_STRING: LazyLock<Option<Regex>> = LazyLock::new(|| {
    Regex::new(concat!(
        r"^(?:true|True|TRUE|false|False|FALSE|null|Null|NULL|~",
        r"|[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+",
        r"|[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?",
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ))
    .ok()
});

/// True if a plain `value` written by serde_yaml (a string, since it is not a 1.2
/// number, boolean or null) would be read as something else by a YAML 1.1 reader.
fn needs_quotes(value: &str) -> bool {
    let (Some(v11), Some(v12)) = (&*YAML11_NON_STRING, &*YAML12_NON_STRING) else {
        return false;
    };
    v11.is_match(value) && !v12.is_match(value)
}

/// Quotes the plain scalars of serde_yaml's block output that YAML 1.1 would misread.
/// Mapping values (`key: value`) and sequence items (`- value`) are looked at; anything
/// already quoted, a block or flow collection, or a multi-line scalar is left alone.
pub fn yaml11_safe(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 16);
    for line in text.split_inclusive('\n') {
        let (body, newline) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        out.push_str(&quote_line(body));
        out.push_str(newline);
    }
    out
}

fn quote_line(line: &str) -> String {
    // The value after the last structural prefix: `- `, `key: `, or `- key: `.
    let trimmed = line.trim_start();
    let indent = &line[..line.len() - trimmed.len()];
    let mut rest = trimmed;
    let mut prefix = String::from(indent);
    while let Some(r) = rest.strip_prefix("- ") {
        prefix.push_str("- ");
        rest = r;
    }
    let value = match rest.split_once(": ") {
        Some((key, value)) if !key.starts_with(['\'', '"']) || key.ends_with(['\'', '"']) => {
            prefix.push_str(key);
            prefix.push_str(": ");
            value
        }
        _ if prefix.ends_with("- ") => rest,
        _ => return line.to_owned(),
    };
    if value.is_empty() || value.starts_with(['\'', '"', '|', '>', '[', '{', '&', '*', '!']) {
        return line.to_owned();
    }
    if needs_quotes(value) {
        format!("{prefix}'{}'", value.replace('\'', "''"))
    } else {
        line.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ambiguous_strings_are_quoted_numbers_stay() {
        let text = "spec:\n  pciBusID: 0000:53:00.0\n  answer: yes\n  big: 1_000\n  count: 8\n  ratio: 0.5\n  name: gpu-0\n  list:\n  - on\n  - 0000:23:00.0\n  - 0000:64:00.0\n  - 'kept'\n  - a: 0000:46:00.0\n  date: 2026-12-01\n";
        let out = yaml11_safe(text);
        assert_eq!(
            out,
            "spec:\n  pciBusID: '0000:53:00.0'\n  answer: 'yes'\n  big: '1_000'\n  count: 8\n  ratio: 0.5\n  name: gpu-0\n  list:\n  - 'on'\n  - '0000:23:00.0'\n  - 0000:64:00.0\n  - 'kept'\n  - a: '0000:46:00.0'\n  date: '2026-12-01'\n"
        );
        // serde_yaml reads the quoted output back to the same strings.
        let a: serde_yaml::Value = serde_yaml::from_str(text).unwrap();
        let b: serde_yaml::Value = serde_yaml::from_str(&out).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn bus_ids_are_read_as_strings_by_a_yaml11_rule() {
        assert!(needs_quotes("0000:53:00.0"));
        // 64 is no base-60 digit: a 1.1 reader keeps this one a string.
        assert!(!needs_quotes("0000:64:00.0"));
        assert!(!needs_quotes("8"));
        assert!(!needs_quotes("9.0.0"));
        assert!(!needs_quotes("pci0000:50"));
    }
}
