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
//! memory 0 30720                                 # GPU 0 has 30 GiB in use
//! memory 0 7 0 2048                              # its MIG device GI 7 / CI 0: 2 GiB
//! util 0 85 40                                   # utilization rates: GPU 85 %, memory 40 %
//! gpm 0 35.5 20                                  # GPM on GPU 0: SM activity 35.5 %, occupancy 20 %
//! gpm 0 7 12 6                                   # GPM on GPU instance 7 of GPU 0
//! process 0 4242 1024 60                         # PID 4242 on GPU 0: 1 GiB, 60 % SM
//! process 0 7 0 4343 512 10                      # PID 4343 on GPU 0, GI 7, CI 0
//! process 0 4444 2048 30 mps                     # PID 4444: an MPS client on GPU 0
//! # comment
//! ```
//!
//! The events file `MOCK_NVML_EVENTS` holds `xid ...` lines (the `xid` word optional).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};

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

/// `(GI ID, CI ID)` of a MIG device.
pub type MigIds = (u32, u32);

/// Scripted usage of one GPU, MIG device or GPU instance (control-file lines `memory`,
/// `util`, `gpm`, `process`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// `memory <gpu> [<gi> <ci>] <MiB>`: memory in use on a GPU or MIG device.
    pub memory: Vec<(u32, Option<MigIds>, u64)>,
    /// `util <gpu> <gpu %> [<memory %>]`: `nvmlDeviceGetUtilizationRates`.
    pub util: Vec<(u32, u32, u32)>,
    /// `gpm <gpu> [<gi>] <SM activity %> <SM occupancy %>`: GPM metrics of a GPU or GPU
    /// instance.
    pub gpm: Vec<(u32, Option<u32>, f64, f64)>,
    /// `process <gpu> [<gi> <ci>] <pid> <MiB> <SM %> [mps]`: a compute process, or with
    /// `mps` an MPS client (listed by `nvmlDeviceGetMPSComputeRunningProcesses_v3`, not by
    /// `nvmlDeviceGetComputeRunningProcesses_v3`).
    pub processes: Vec<Process>,
}

/// One scripted compute process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Process {
    /// GPU index.
    pub gpu: u32,
    /// `(GI, CI)` of the MIG device it runs on.
    pub mig: Option<(u32, u32)>,
    /// Host PID.
    pub pid: u32,
    /// Memory it uses, MiB.
    pub used_mib: u64,
    /// SM utilization, percent.
    pub sm_percent: u32,
    /// An MPS client rather than a plain compute process.
    pub mps: bool,
}

impl Usage {
    /// Scripted memory in use (MiB) of GPU `gpu` or its MIG device `mig`: the `memory`
    /// line, else the sum of the processes on it (a GPU counts its MIG devices' too).
    pub fn memory_mib(&self, gpu: u32, mig: Option<(u32, u32)>) -> u64 {
        if let Some(&(_, _, mib)) = self
            .memory
            .iter()
            .rev()
            .find(|(g, m, _)| *g == gpu && *m == mig)
        {
            return mib;
        }
        self.processes_on(gpu, mig).map(|p| p.used_mib).sum()
    }

    /// Processes on GPU `gpu` (all of them, MIG devices included) or on its MIG device.
    pub fn processes_on(
        &self,
        gpu: u32,
        mig: Option<(u32, u32)>,
    ) -> impl Iterator<Item = &Process> {
        self.processes
            .iter()
            .filter(move |p| p.gpu == gpu && (mig.is_none() || p.mig == mig))
    }

    /// GPM `(SM activity, SM occupancy)` of a GPU or GPU instance; zero when not scripted.
    pub fn gpm_of(&self, gpu: u32, gi: Option<u32>) -> (f64, f64) {
        self.gpm
            .iter()
            .rev()
            .find(|(g, i, _, _)| *g == gpu && *i == gi)
            .map_or((0.0, 0.0), |&(_, _, a, o)| (a, o))
    }

    /// Utilization rates `(gpu %, memory %)` of a GPU; zero when not scripted.
    pub fn util_of(&self, gpu: u32) -> (u32, u32) {
        self.util
            .iter()
            .rev()
            .find(|(g, _, _)| *g == gpu)
            .map_or((0, 0), |&(_, u, m)| (u, m))
    }
}

fn parse_usage(kw: &str, rest: &[&str], u: &mut Usage) -> bool {
    fn n<T: std::str::FromStr>(w: &str) -> Option<T> {
        w.parse().ok()
    }
    fn pct(w: &str) -> Option<f64> {
        n::<f64>(w).filter(|v| (0.0..=100.0).contains(v))
    }
    fn ipct(w: &str) -> Option<u32> {
        n::<u32>(w).filter(|v| *v <= 100)
    }
    fn process(
        gpu: &str,
        mig: Option<(&str, &str)>,
        pid: &str,
        mib: &str,
        sm: &str,
    ) -> Option<Process> {
        let mig = match mig {
            Some((gi, ci)) => Some((n(gi)?, n(ci)?)),
            None => None,
        };
        Some(Process {
            gpu: n(gpu)?,
            mig,
            pid: n(pid)?,
            used_mib: n(mib)?,
            sm_percent: ipct(sm)?,
            mps: false,
        })
    }
    // A trailing `mps` marks a process line as an MPS client.
    let (rest, mps) = match rest {
        [head @ .., "mps"] if kw == "process" => (head, true),
        _ => (rest, false),
    };
    match (kw, rest) {
        ("memory", [g, mib]) => n(g).zip(n(mib)).map(|(g, m)| u.memory.push((g, None, m))),
        ("memory", [g, gi, ci, mib]) => match (n(g), n(gi), n(ci), n(mib)) {
            (Some(g), Some(gi), Some(ci), Some(m)) => {
                u.memory.push((g, Some((gi, ci)), m));
                Some(())
            }
            _ => None,
        },
        ("util", [g, gpu]) => n(g).zip(ipct(gpu)).map(|(g, p)| u.util.push((g, p, 0))),
        ("util", [g, gpu, mem]) => match (n(g), ipct(gpu), ipct(mem)) {
            (Some(g), Some(p), Some(m)) => {
                u.util.push((g, p, m));
                Some(())
            }
            _ => None,
        },
        ("gpm", [g, a, o]) => match (n(g), pct(a), pct(o)) {
            (Some(g), Some(a), Some(o)) => {
                u.gpm.push((g, None, a, o));
                Some(())
            }
            _ => None,
        },
        ("gpm", [g, gi, a, o]) => match (n(g), n(gi), pct(a), pct(o)) {
            (Some(g), Some(gi), Some(a), Some(o)) => {
                u.gpm.push((g, Some(gi), a, o));
                Some(())
            }
            _ => None,
        },
        ("process", [g, pid, mib, sm]) => {
            process(g, None, pid, mib, sm).map(|p| u.processes.push(Process { mps, ..p }))
        }
        ("process", [g, gi, ci, pid, mib, sm]) => {
            process(g, Some((gi, ci)), pid, mib, sm).map(|p| u.processes.push(Process { mps, ..p }))
        }
        _ => None,
    }
    .is_some()
}

/// Parsed hooks of one control/events source.
#[derive(Debug, Clone, Default, PartialEq)]
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
    /// Scripted usage (memory, utilization, GPM, processes).
    pub usage: Usage,
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
            Some(&kw @ ("memory" | "util" | "gpm" | "process")) if !events_only => {
                (kw, &words[1..])
            }
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
            "memory" | "util" | "gpm" | "process" => parse_usage(kw, rest, &mut h.usage),
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

/// The last text read from each hooks source and what it parsed to.
type Parsed = HashMap<(PathBuf, bool), (String, Arc<Hooks>)>;

static PARSED: LazyLock<Mutex<Parsed>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// Reads and parses a hooks file; a missing or unreadable file means no hooks. The file is
/// read on every call (a test changes it at any time) but parsed again only when its text
/// changed: real NVML does not parse anything per call, and a usage round re-parsing its
/// script on every query cost more CPU than everything else in the round.
pub fn read(path: &Path, events_only: bool) -> Arc<Hooks> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Arc::default();
    };
    let key = (path.to_path_buf(), events_only);
    let mut parsed = PARSED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((seen, hooks)) = parsed.get(&key)
        && *seen == text
    {
        return Arc::clone(hooks);
    }
    let hooks = Arc::new(parse(&text, &path.display().to_string(), events_only));
    parsed.insert(key, (text, Arc::clone(&hooks)));
    hooks
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
    fn parses_usage_lines() {
        let h = parse(
            "memory 0 30720\nmemory 0 7 0 2048\nutil 1 85 40\nutil 2 10\ngpm 0 35.5 20\ngpm 0 7 12 6\n\
             process 1 4242 1024 60\nprocess 0 7 0 4343 512 10\nprocess 0 4444 256 5 mps\n\
             gpm 0 101 0\nutil 0 x\nprocess 0 1 2\nmemory 0 1 2\n",
            "ctl",
            false,
        );
        let u = &h.usage;
        assert_eq!(u.memory, [(0, None, 30720), (0, Some((7, 0)), 2048)]);
        assert_eq!(u.util, [(1, 85, 40), (2, 10, 0)]);
        assert_eq!(u.gpm, [(0, None, 35.5, 20.0), (0, Some(7), 12.0, 6.0)]);
        assert_eq!(u.processes.len(), 3);
        assert_eq!(u.processes[1].mig, Some((7, 0)));
        assert!(u.processes[2].mps && !u.processes[0].mps && !u.processes[1].mps);
        // Bad lines (out of range, wrong arity) are ignored, not read as fail rules.
        assert!(h.fails.is_empty(), "{:?}", h.fails);
        assert_eq!(u.memory_mib(0, None), 30720);
        assert_eq!(
            u.memory_mib(1, None),
            1024,
            "sum of processes without a memory line"
        );
        assert_eq!(u.memory_mib(0, Some((7, 0))), 2048);
        assert_eq!(u.processes_on(0, None).count(), 2);
        assert_eq!(u.gpm_of(0, Some(7)), (12.0, 6.0));
        assert_eq!(u.gpm_of(3, None), (0.0, 0.0));
        assert_eq!(u.util_of(1), (85, 40));
        assert!(parse("gpm 0 1 1", "ev", true).usage.gpm.is_empty());
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
    /// The control file is read on every call: a new text of the same length is seen at
    /// once, the same text is not parsed again.
    #[test]
    fn reads_see_a_rewritten_file_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control");
        std::fs::write(&path, "lost 3\n").unwrap();
        let first = read(&path, false);
        assert_eq!(first.lost, [3]);
        assert!(Arc::ptr_eq(&first, &read(&path, false)));
        std::fs::write(&path, "lost 4\n").unwrap();
        assert_eq!(read(&path, false).lost, [4]);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(*read(&path, false), Hooks::default());
    }
}
