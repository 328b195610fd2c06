//! Query-string parsing and field/label selectors.

use serde_json::Value;

/// Decodes `application/x-www-form-urlencoded` pairs (`a=b&c=d`, empty pairs skipped).
pub fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (decode(k), decode(v)),
            None => (decode(p), String::new()),
        })
        .collect()
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Percent-decodes one component (`+` is a space).
pub fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                match (
                    bytes.get(i + 1).copied().and_then(hex),
                    bytes.get(i + 2).copied().and_then(hex),
                ) {
                    (Some(h), Some(l)) => {
                        out.push(h * 16 + l);
                        i += 2;
                    }
                    _ => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Req {
    Eq(String, String),
    Ne(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

/// A parsed field or label selector (all requirements must hold).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    reqs: Vec<Req>,
}

/// Splits on commas outside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
        .into_iter()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

fn set_values(s: &str) -> Option<Vec<String>> {
    let inner = s.trim().strip_prefix('(')?.strip_suffix(')')?;
    Some(
        inner
            .split(',')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect(),
    )
}

impl Selector {
    /// Parses `a=b,c!=d,e==f,k,!k,k in (x,y),k notin (x)`. Returns an error message on junk.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut reqs = Vec::new();
        for part in split_top(s) {
            if let Some((k, v)) = part.split_once("!=") {
                reqs.push(Req::Ne(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = part.split_once("==") {
                reqs.push(Req::Eq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = part.split_once('=') {
                reqs.push(Req::Eq(k.trim().into(), v.trim().into()));
            } else if let Some((k, v)) = part.split_once(" notin ") {
                let vals = set_values(v).ok_or_else(|| format!("invalid selector {part:?}"))?;
                reqs.push(Req::NotIn(k.trim().into(), vals));
            } else if let Some((k, v)) = part.split_once(" in ") {
                let vals = set_values(v).ok_or_else(|| format!("invalid selector {part:?}"))?;
                reqs.push(Req::In(k.trim().into(), vals));
            } else if let Some(k) = part.strip_prefix('!') {
                reqs.push(Req::NotExists(k.trim().into()));
            } else if part.contains(char::is_whitespace) {
                return Err(format!("invalid selector {part:?}"));
            } else {
                reqs.push(Req::Exists(part.into()));
            }
        }
        Ok(Selector { reqs })
    }

    /// The value `key` must equal (`key=v` or `key==v`), if the selector pins it: what the
    /// API server's watch cache matches against a field index
    /// (`fields.Selector.RequiresExactMatch`, used by `storage.SelectionPredicate.MatcherIndex`).
    pub fn required_value(&self, key: &str) -> Option<&str> {
        self.reqs.iter().find_map(|r| match r {
            Req::Eq(k, v) if k == key => Some(v.as_str()),
            _ => None,
        })
    }

    fn matches_with(&self, get: impl Fn(&str) -> Option<String>) -> bool {
        self.reqs.iter().all(|r| match r {
            Req::Eq(k, v) => get(k).unwrap_or_default() == *v,
            Req::Ne(k, v) => get(k).unwrap_or_default() != *v,
            Req::In(k, vs) => get(k).is_some_and(|x| vs.contains(&x)),
            Req::NotIn(k, vs) => get(k).is_none_or(|x| !vs.contains(&x)),
            Req::Exists(k) => get(k).is_some(),
            Req::NotExists(k) => get(k).is_none(),
        })
    }

    /// Field-selector match: keys are dotted paths into the object (`spec.driver`).
    pub fn matches_fields(&self, obj: &Value) -> bool {
        self.matches_with(|path| {
            let mut cur = obj;
            for seg in path.split('.') {
                cur = cur.get(seg)?;
            }
            match cur {
                Value::String(s) => Some(s.clone()),
                Value::Null => None,
                Value::Bool(b) => Some(b.to_string()),
                Value::Number(n) => Some(n.to_string()),
                other => Some(other.to_string()),
            }
        })
    }

    /// Label-selector match against `metadata.labels`.
    pub fn matches_labels(&self, obj: &Value) -> bool {
        let labels = obj.get("metadata").and_then(|m| m.get("labels"));
        self.matches_with(|k| labels?.get(k)?.as_str().map(str::to_string))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn query_decoding() {
        let q = parse_query(
            "&watch=true&fieldSelector=spec.driver%3Dgpu.x%2Cspec.nodeName%3Dn1&a=b+c&bad=%zz",
        );
        assert_eq!(q[0], ("watch".into(), "true".into()));
        assert_eq!(q[1].1, "spec.driver=gpu.x,spec.nodeName=n1");
        assert_eq!(q[2].1, "b c");
        assert_eq!(q[3].1, "%zz");
    }

    #[test]
    fn field_selector() {
        let obj = json!({"spec": {"driver": "d", "nodeName": "n1"}});
        assert!(
            Selector::parse("spec.driver=d,spec.nodeName=n1")
                .unwrap()
                .matches_fields(&obj)
        );
        assert!(
            !Selector::parse("spec.driver=d,spec.nodeName=n2")
                .unwrap()
                .matches_fields(&obj)
        );
        assert!(
            Selector::parse("spec.nodeName!=n2")
                .unwrap()
                .matches_fields(&obj)
        );
        assert!(Selector::parse("").unwrap().matches_fields(&obj));
    }

    #[test]
    fn required_value_is_an_equality_only() {
        let s = Selector::parse("spec.driver=d,spec.nodeName==n1").unwrap();
        assert_eq!(s.required_value("spec.nodeName"), Some("n1"));
        assert_eq!(s.required_value("spec.driver"), Some("d"));
        assert_eq!(s.required_value("spec.pool"), None);
        let ne = Selector::parse("spec.nodeName!=n1").unwrap();
        assert_eq!(ne.required_value("spec.nodeName"), None);
    }

    #[test]
    fn label_selector() {
        let obj = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        assert!(
            Selector::parse("a=1,b in (2,3),!c")
                .unwrap()
                .matches_labels(&obj)
        );
        assert!(!Selector::parse("a notin (1)").unwrap().matches_labels(&obj));
        assert!(!Selector::parse("c").unwrap().matches_labels(&obj));
    }
}
