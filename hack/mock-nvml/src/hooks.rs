//! Test hooks: injected return codes, Xid events and lost GPUs.
//!
//! Syntax (env `MOCK_NVML_FAIL`, comma- or newline-separated, and lines of the control
//! file `MOCK_NVML_CONTROL`, which is re-read on every call):
//!
//! ```text
//! nvmlDeviceCreateGpuInstanceWithPlacement=23   # every call fails with 23
//! fail nvmlDeviceGetUUID@2=999                   # only calls about GPU index 2
//! xid 0 79                                       # Xid 79 on GPU 0 (no GI/CI)
//! xid 1 31 7 0                                   # Xid 31 on GPU 1, GI 7, CI 0
//! lost 3                                         # GPU 3 fell off the bus
//! attach 0 1 0                                   # a process runs on GPU 0, GI 1, CI 0
//! delay nvmlGpuInstanceCreateComputeInstance 1500  # that call takes 1.5 s
//! # comment
//! ```
//!
//! The events file `MOCK_NVML_EVENTS` holds `xid ...` lines (the `xid` word optional).

use std::path::Path;

/// One injected failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailRule {
    /// NVML function name (`nvmlDeviceGetUUID`).
    pub func: String,
    /// GPU index the call must be about (parent GPU for MIG/GI/CI handles).
    pub device: Option<u32>,
    /// Return code.
    pub code: u32,
}

/// One injected Xid event.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct XidEvent {
    /// GPU index.
    pub gpu: u32,
    /// Xid number (`eventData`).
    pub xid: u64,
    /// GI ID or 0xFFFFFFFF.
    pub gi: u32,
    /// CI ID or 0xFFFFFFFF.
    pub ci: u32,
    /// Identity: source, line text and its occurrence number among identical lines, so
    /// rewriting the file around it neither repeats nor drops the event.
    pub key: String,
}

/// Parsed hooks of one control/events source.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hooks {
    /// Injected failures.
    pub fails: Vec<FailRule>,
    /// Xid events.
    pub xids: Vec<XidEvent>,
    /// Lost GPU indexes.
    pub lost: Vec<u32>,
    /// Compute instances with a process attached, as `(GPU index, GI ID, CI ID)`: their
    /// destroy (and their GPU instance's) returns IN_USE, as NVML documents for "processes
    /// are active" (nvml.h, `nvmlComputeInstanceDestroy`, `nvmlGpuInstanceDestroy`).
    pub attached: Vec<(u32, u32, u32)>,
    /// Extra latency of a call, `(function, milliseconds)`: GPU/compute-instance creation
    /// takes time on hardware (how long is not sourced; tests and benches choose).
    pub delays: Vec<(String, u64)>,
}

impl Hooks {
    /// True if a process is attached to compute instance `ci` of GI `gi` on GPU `gpu`
    /// (`ci` None: to any compute instance of that GI).
    pub fn is_attached(&self, gpu: u32, gi: u32, ci: Option<u32>) -> bool {
        self.attached
            .iter()
            .any(|&(g, i, c)| g == gpu && i == gi && ci.is_none_or(|ci| ci == c))
    }

    /// The extra latency configured for `func`.
    pub fn delay_of(&self, func: &str) -> Option<std::time::Duration> {
        self.delays
            .iter()
            .find(|(f, _)| f == func)
            .map(|(_, ms)| std::time::Duration::from_millis(*ms))
    }
}

/// Parses `name[@index]=code`.
pub fn parse_fail(spec: &str) -> Option<FailRule> {
    let (lhs, code) = spec.trim().split_once('=')?;
    let code: u32 = code.trim().parse().ok()?;
    let (func, device) = match lhs.trim().split_once('@') {
        Some((f, d)) => (f.trim(), Some(d.trim().parse().ok()?)),
        None => (lhs.trim(), None),
    };
    if func.is_empty() {
        return None;
    }
    Some(FailRule {
        func: func.to_string(),
        device,
        code,
    })
}

/// Parses a comma/newline separated list of fail specs (env `MOCK_NVML_FAIL`).
pub fn parse_fail_list(s: &str) -> Vec<FailRule> {
    s.split([',', '\n'])
        .filter(|p| !p.trim().is_empty())
        .filter_map(|p| {
            let r = parse_fail(p);
            if r.is_none() {
                eprintln!("mock-nvml: ignoring bad fail spec {p:?}");
            }
            r
        })
        .collect()
}

fn parse_xid(words: &[&str]) -> Option<(u32, u64, u32, u32)> {
    let gpu = words.first()?.parse().ok()?;
    let xid = words.get(1)?.parse().ok()?;
    let gi = match words.get(2) {
        Some(w) => w.parse().ok()?,
        None => u32::MAX,
    };
    let ci = match words.get(3) {
        Some(w) => w.parse().ok()?,
        None => u32::MAX,
    };
    Some((gpu, xid, gi, ci))
}

/// Parses control-file (or events-file, `events_only`) text from `source`.
pub fn parse(text: &str, source: &str, events_only: bool) -> Hooks {
    let mut h = Hooks::default();
    let mut seen: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    for raw in text.lines() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let (kw, rest) = match words.first() {
            Some(&"xid") => ("xid", &words[1..]),
            Some(&"lost") if !events_only => ("lost", &words[1..]),
            Some(&"attach") if !events_only => ("attach", &words[1..]),
            Some(&"delay") if !events_only => ("delay", &words[1..]),
            Some(&"fail") if !events_only => ("fail", &words[1..]),
            _ if events_only => ("xid", &words[..]),
            _ => ("fail", &words[..]),
        };
        let ok = match kw {
            "xid" => match parse_xid(rest) {
                Some((gpu, xid, gi, ci)) => {
                    let norm = format!("{gpu} {xid} {gi} {ci}");
                    let n = seen.entry(norm.clone()).or_insert(0);
                    *n += 1;
                    h.xids.push(XidEvent {
                        gpu,
                        xid,
                        gi,
                        ci,
                        key: format!("{source}\n{norm}\n{n}"),
                    });
                    true
                }
                None => false,
            },
            "attach" => match rest {
                [g, i, c] => match (g.parse(), i.parse(), c.parse()) {
                    (Ok(g), Ok(i), Ok(c)) => {
                        h.attached.push((g, i, c));
                        true
                    }
                    _ => false,
                },
                _ => false,
            },
            "delay" => match rest {
                [f, ms] => match ms.parse() {
                    Ok(ms) => {
                        h.delays.push(((*f).to_owned(), ms));
                        true
                    }
                    Err(_) => false,
                },
                _ => false,
            },
            "lost" => match rest.first().and_then(|w| w.parse().ok()) {
                Some(g) => {
                    h.lost.push(g);
                    true
                }
                None => false,
            },
            _ => match parse_fail(&rest.join("")) {
                Some(r) => {
                    h.fails.push(r);
                    true
                }
                None => false,
            },
        };
        if !ok {
            eprintln!("mock-nvml: ignoring bad line {raw:?} in {source}");
        }
    }
    h
}

/// Reads and parses a hooks file; a missing or unreadable file means no hooks.
pub fn read(path: &Path, events_only: bool) -> Hooks {
    match std::fs::read_to_string(path) {
        Ok(t) => parse(&t, &path.display().to_string(), events_only),
        Err(_) => Hooks::default(),
    }
}

/// The injected code for a call of `func` about GPU `device`, if any.
pub fn fail_code<'a>(
    rules: impl IntoIterator<Item = &'a FailRule>,
    func: &str,
    device: Option<u32>,
) -> Option<u32> {
    rules
        .into_iter()
        .find(|r| r.func == func && (r.device.is_none() || r.device == device))
        .map(|r| r.code)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn parses_env_list() {
        let r =
            parse_fail_list("nvmlDeviceCreateGpuInstanceWithPlacement=23,nvmlDeviceGetUUID@2=999");
        assert_eq!(r.len(), 2);
        assert_eq!(fail_code(&r, "nvmlDeviceGetUUID", Some(1)), None);
        assert_eq!(fail_code(&r, "nvmlDeviceGetUUID", Some(2)), Some(999));
        assert_eq!(
            fail_code(&r, "nvmlDeviceCreateGpuInstanceWithPlacement", Some(5)),
            Some(23)
        );
        assert_eq!(
            fail_code(&r, "nvmlDeviceCreateGpuInstanceWithPlacement", None),
            Some(23)
        );
        assert!(parse_fail_list("garbage").is_empty());
    }

    #[test]
    fn parses_attached_processes_and_delays() {
        let h = parse(
            "attach 0 1 0\ndelay nvmlGpuInstanceCreateComputeInstance 1500\nattach x\ndelay f\n",
            "ctl",
            false,
        );
        assert_eq!(h.attached, [(0, 1, 0)]);
        assert!(h.is_attached(0, 1, Some(0)));
        assert!(h.is_attached(0, 1, None));
        assert!(!h.is_attached(0, 1, Some(1)));
        assert!(!h.is_attached(1, 1, Some(0)));
        assert_eq!(
            h.delay_of("nvmlGpuInstanceCreateComputeInstance"),
            Some(std::time::Duration::from_millis(1500))
        );
        assert_eq!(h.delay_of("nvmlDeviceGetUUID"), None);
        assert!(h.fails.is_empty(), "{:?}", h.fails);
        // Events files know only Xid lines.
        assert!(parse("attach 0 1 0", "ev", true).attached.is_empty());
    }

    #[test]
    fn parses_control_file() {
        let h = parse(
            "# c\nfail nvmlInit_v2=9\nnvmlDeviceGetName@1 = 15\nxid 0 79\nxid 1 31 7 0\nxid 0 79\nlost 3\nbogus line\n",
            "ctl",
            false,
        );
        assert_eq!(h.fails.len(), 2);
        assert_eq!(h.fails[1].device, Some(1));
        assert_eq!(h.lost, vec![3]);
        assert_eq!(h.xids.len(), 3);
        assert_eq!((h.xids[1].gi, h.xids[1].ci), (7, 0));
        assert_eq!(h.xids[0].gi, u32::MAX);
        assert_ne!(h.xids[0].key, h.xids[2].key);
        let e = parse("0 48\nxid 2 79 1 0\n", "ev", true);
        assert_eq!(e.xids.len(), 2);
        assert!(e.fails.is_empty());
    }
}
