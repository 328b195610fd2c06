//! `cleave-kubelet-plugin usage`: a table per claim device of what it was given and what it
//! uses, read from a running plugin's `/metrics` (`--metrics-addr`, scraped `--scrapes`
//! times `--every` apart). The development build's `--mock PROFILE` try renders its
//! rounds through the same exposition (`crate::mock`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{Read as _, Write as _};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;

use crate::args::UsageCommandArgs;

/// One sample of the text exposition: name, labels, value.
pub type Sample = (String, BTreeMap<String, String>, f64);

/// Parses the Prometheus text exposition (as prometheus-client writes it): comment lines
/// are skipped, label values unescaped. A line that does not parse is an error naming it.
pub fn parse_exposition(text: &str) -> anyhow::Result<Vec<Sample>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim_end();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = || anyhow::anyhow!("not a metrics line: {line:?}");
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let name = &line[..open];
                let (labels, used) = parse_labels(&line[open + 1..]).ok_or_else(bad)?;
                (name, labels, &line[open + 1 + used..])
            }
            None => {
                let (name, rest) = line.split_once(' ').ok_or_else(bad)?;
                (name, BTreeMap::new(), rest)
            }
        };
        let value = rest.split_whitespace().next().ok_or_else(bad)?;
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().map_err(|_| bad())?,
        };
        out.push((name.to_owned(), labels, value));
    }
    Ok(out)
}

/// Labels after `{` up to and including `}`; returns them and the bytes consumed.
fn parse_labels(s: &str) -> Option<(BTreeMap<String, String>, usize)> {
    let mut labels = BTreeMap::new();
    let bytes: Vec<char> = s.chars().collect();
    let mut i = 0;
    let mut consumed = 0;
    loop {
        if bytes.get(i) == Some(&'}') {
            consumed += 1;
            return Some((labels, consumed));
        }
        let mut key = String::new();
        while let Some(&c) = bytes.get(i) {
            if c == '=' {
                break;
            }
            key.push(c);
            consumed += c.len_utf8();
            i += 1;
        }
        if bytes.get(i) != Some(&'=') || bytes.get(i + 1) != Some(&'"') {
            return None;
        }
        i += 2;
        consumed += 2;
        let mut value = String::new();
        loop {
            let c = *bytes.get(i)?;
            i += 1;
            consumed += c.len_utf8();
            match c {
                '"' => break,
                '\\' => {
                    let n = *bytes.get(i)?;
                    i += 1;
                    consumed += n.len_utf8();
                    value.push(if n == 'n' { '\n' } else { n });
                }
                c => value.push(c),
            }
        }
        labels.insert(key.trim_start_matches(',').to_owned(), value);
        if bytes.get(i) == Some(&',') {
            i += 1;
            consumed += 1;
        }
    }
}

/// Fetches `/metrics` from `addr` (`host:port` or `http://host:port[/...]`).
pub(crate) fn scrape(addr: &str) -> anyhow::Result<String> {
    let hostport = addr
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or(addr);
    let mut s = std::net::TcpStream::connect(hostport).with_context(|| {
        let try_mock = if cfg!(feature = "mock") {
            ", or try --mock h100-80gb-x8"
        } else {
            ""
        };
        format!(
            "connecting to the plugin's metrics endpoint {hostport} (is the plugin running with --metrics-addr? pass its address with --metrics-addr{try_mock})"
        )
    })?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)
        .with_context(|| format!("reading /metrics from {hostport}"))?;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{hostport} did not answer HTTP"))?;
    let status = head.split(' ').nth(1).unwrap_or("");
    anyhow::ensure!(
        status == "200",
        "{hostport}/metrics answered {status}: {}",
        head.lines().next().unwrap_or("")
    );
    Ok(body.to_owned())
}

/// One claim device across the scrapes.
#[derive(Debug, Default, Clone)]
struct Row {
    given_memory: Option<f64>,
    sms: Option<f64>,
    profile: String,
    sharing: String,
    kind: String,
    used_now: Option<f64>,
    used_max: Option<f64>,
    activity_now: Option<(String, f64)>,
    activity: Vec<f64>,
    attributable: Option<bool>,
}

/// The table for `scrapes` (oldest first) at wall time `now`.
pub(crate) fn render(scrapes: &[Vec<Sample>], now: SystemTime) -> String {
    const P: &str = "cleave_kubelet_plugin_";
    let mut rows: BTreeMap<(String, String, String), Row> = BTreeMap::new();
    let mut idle: BTreeMap<(String, String), (bool, Option<f64>)> = BTreeMap::new();
    for (n, samples) in scrapes.iter().enumerate() {
        let last = n + 1 == scrapes.len();
        for (name, l, v) in samples {
            let Some(short) = name.strip_prefix(P) else {
                continue;
            };
            let get = |k: &str| l.get(k).cloned().unwrap_or_default();
            if short == "claim_idle" || short == "claim_idle_since_timestamp_seconds" {
                if !last {
                    continue;
                }
                let e = idle
                    .entry((get("namespace"), get("claim")))
                    .or_insert((false, None));
                if short == "claim_idle" {
                    e.0 = *v >= 1.0;
                } else {
                    e.1 = Some(*v);
                }
                continue;
            }
            if !short.starts_with("claim_") {
                continue;
            }
            let row = rows
                .entry((get("namespace"), get("claim"), get("device")))
                .or_default();
            match short {
                "claim_allocated_memory_bytes" => row.given_memory = Some(*v),
                "claim_allocated_sms" => row.sms = Some(*v),
                "claim_allocated_info" => {
                    row.profile = get("mig_profile");
                    row.sharing = get("sharing");
                    row.kind = get("kind");
                }
                "claim_used_memory_bytes" => {
                    row.used_max = Some(row.used_max.map_or(*v, |m| m.max(*v)));
                    if last {
                        row.used_now = Some(*v);
                    }
                }
                "claim_compute_activity_percent" => {
                    let source = get("source");
                    if source == "gpm_sm_occupancy" {
                        continue;
                    }
                    row.activity.push(*v);
                    if last {
                        row.activity_now = Some((source, *v));
                    }
                }
                "claim_activity_attributable" if last => row.attributable = Some(*v >= 1.0),
                _ => {}
            }
        }
    }
    if rows.is_empty() {
        return "no prepared claims are sampled (none prepared, or --usage-interval=0)\n".into();
    }
    let gib = |b: f64| format!("{:.1} GiB", b / f64::from(1u32 << 30));
    let mut table = vec![[
        "NAMESPACE/CLAIM".to_owned(),
        "DEVICE".to_owned(),
        "GIVEN".to_owned(),
        "USED NOW".to_owned(),
        format!("USED OVER WINDOW ({} scrapes)", scrapes.len()),
        "IDLE SINCE".to_owned(),
    ]];
    let now_s = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    for ((ns, claim, device), r) in &rows {
        let mut given = r.given_memory.map(gib).unwrap_or_else(|| "?".into());
        if !r.profile.is_empty() {
            let _ = write!(given, ", {}", r.profile);
        }
        if let Some(sms) = r.sms {
            let _ = write!(given, ", {sms} SMs");
        }
        if !r.sharing.is_empty() && r.sharing != "exclusive" {
            let _ = write!(given, ", {}", r.sharing);
        }
        let memory_now = r.used_now.map_or("memory n/a".into(), gib);
        let activity_now = match (&r.activity_now, r.attributable) {
            (Some((source, v)), _) => format!("{v:.1}% {source}"),
            (None, Some(false)) => "activity not attributable".into(),
            (None, _) => "activity pending".into(),
        };
        let window = if r.activity.is_empty() {
            format!("max {}", r.used_max.map_or("memory n/a".into(), gib))
        } else {
            let mean = r.activity.iter().sum::<f64>() / r.activity.len() as f64;
            let max = r.activity.iter().copied().fold(0.0, f64::max);
            format!(
                "max {}, activity mean {mean:.1}% max {max:.1}%",
                r.used_max.map_or("memory n/a".into(), gib)
            )
        };
        let idle_since = match idle.get(&(ns.clone(), claim.clone())) {
            Some((true, Some(ts))) => format!("idle for {}", ago(now_s - ts)),
            Some((false, Some(ts))) => format!("below threshold for {}", ago(now_s - ts)),
            _ => "-".into(),
        };
        table.push([
            format!("{ns}/{claim}"),
            device.clone(),
            given,
            format!("{memory_now}, {activity_now}"),
            window,
            idle_since,
        ]);
    }
    columns(&table)
}

/// `rows` as left-aligned columns two spaces apart, one line each.
pub(crate) fn columns<const N: usize>(rows: &[[String; N]]) -> String {
    let mut widths = [0usize; N];
    for row in rows {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, (w, c)) in widths.iter().zip(row).enumerate() {
            if i + 1 == row.len() {
                line.push_str(c);
            } else {
                let _ = write!(line, "{c:<w$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn ago(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// Runs `usage` against the running plugin.
pub(crate) fn run_live(args: &UsageCommandArgs) -> anyhow::Result<String> {
    Ok(render(&scrape_all(args)?, SystemTime::now()))
}

/// `--scrapes` scrapes of the running plugin, `--every` apart, parsed.
pub(crate) fn scrape_all(args: &UsageCommandArgs) -> anyhow::Result<Vec<Vec<Sample>>> {
    let mut scrapes = Vec::new();
    for n in 0..args.scrapes {
        if n > 0 {
            std::thread::sleep(args.every);
        }
        let text = scrape(&args.metrics_addr)?;
        scrapes.push(parse_exposition(&text)?);
    }
    Ok(scrapes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_parses_escaped_labels() {
        let text = "# HELP x y\ncleave_kubelet_plugin_claim_idle{namespace=\"a\",claim=\"b\\\"c\"} 1\nplain 2.5\n# EOF\n";
        let s = parse_exposition(text).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].1["claim"], "b\"c");
        assert_eq!(s[0].2, 1.0);
        assert_eq!(s[1], ("plain".into(), BTreeMap::new(), 2.5));
        assert!(parse_exposition("broken{a=1} 2").is_err());
    }

    #[test]
    fn the_table_names_given_used_window_and_idle() {
        let l = |extra: &[(&str, &str)]| {
            let mut m: BTreeMap<String, String> = [
                ("namespace", "ns"),
                ("claim", "c"),
                ("device", "gpu-0"),
                ("sharing", "exclusive"),
            ]
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
            for (k, v) in extra {
                m.insert((*k).to_owned(), (*v).to_owned());
            }
            m
        };
        let p = |n: &str| format!("cleave_kubelet_plugin_{n}");
        let round = |used: f64, act: f64| {
            vec![
                (
                    p("claim_allocated_memory_bytes"),
                    l(&[]),
                    80.0 * 1073741824.0,
                ),
                (p("claim_allocated_sms"), l(&[]), 132.0),
                (p("claim_allocated_info"), l(&[("mig_profile", "")]), 1.0),
                (p("claim_used_memory_bytes"), l(&[]), used * 1073741824.0),
                (
                    p("claim_compute_activity_percent"),
                    l(&[("source", "gpm_sm_activity")]),
                    act,
                ),
                (p("claim_activity_attributable"), l(&[]), 1.0),
                (
                    p("claim_idle"),
                    [("namespace", "ns"), ("claim", "c")]
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                    1.0,
                ),
                (
                    p("claim_idle_since_timestamp_seconds"),
                    [("namespace", "ns"), ("claim", "c")]
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect(),
                    1000.0,
                ),
            ]
        };
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1090);
        let t = render(&[round(4.0, 3.0), round(2.0, 1.0)], now);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 2, "{t}");
        assert!(lines[0].starts_with("NAMESPACE/CLAIM"), "{t}");
        for part in [
            "ns/c",
            "gpu-0",
            "80.0 GiB, 132 SMs",
            "2.0 GiB, 1.0% gpm_sm_activity",
            "max 4.0 GiB, activity mean 2.0% max 3.0%",
            "idle for 1m30s",
        ] {
            assert!(lines[1].contains(part), "{part} missing in\n{t}");
        }
        assert!(render(&[], now).contains("no prepared claims"));
    }
}
