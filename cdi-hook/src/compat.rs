//! `enable-cuda-compat`: when the image carries CUDA forward-compatibility libraries
//! (`/usr/local/cuda/compat/libcuda.so.<version>`) that suit the host driver, put their
//! folder in an ld.so.conf.d drop-in that sorts before the driver's, so that the following
//! `update-ldcache` makes them win. After NVIDIA/nvidia-container-toolkit
//! cmd/nvidia-cdi-hook/cudacompat (cudacompat.go, cuda-elf-header.go).

use std::cmp::Ordering;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{HookError, Result};
use crate::log;
use crate::root::{ContainerRoot, config_line, escaped};

/// Where the compat libraries sit in CUDA images.
pub const DEFAULT_COMPAT_DIR: &str = "/usr/local/cuda/compat";
/// The drop-in; `00-compat-` sorts before the driver's `00-nvcr-` drop-in (NVIDIA's names).
pub const DROP_IN: &str = "/etc/ld.so.conf.d/00-compat-cleave.conf";
const HOOK: &str = "enable-cuda-compat";

/// What `enable-cuda-compat` was asked to do.
#[derive(Debug)]
pub struct Options {
    pub host_driver_version: Option<String>,
    pub host_cuda_version: Option<String>,
    pub compat_dir: PathBuf,
}

/// A dotted version, `MAJOR[.MINOR[.PATCH]]` with an optional leading `v`; leading zeros are
/// allowed (driver versions such as `550.163.01` have them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version(pub u64, pub u64, pub u64);

impl Version {
    /// Parses a version; `None` for anything else.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.strip_prefix('v').unwrap_or(s);
        let mut parts = s.split('.');
        let mut next = |required: bool| -> Option<u64> {
            match parts.next() {
                Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => p.parse().ok(),
                None if !required => Some(0),
                _ => None,
            }
        };
        let v = Version(next(true)?, next(false)?, next(false)?);
        if parts.next().is_some() {
            return None;
        }
        Some(v)
    }
}

/// The JSON in the compat libcuda's `.note.cuda.fwd_compatibility` ELF note.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct CompatNote {
    #[serde(rename = "CUDA Version", default)]
    pub cuda_version: String,
    /// Driver branches (major versions) the compat libraries support.
    #[serde(rename = "Driver", default)]
    pub driver: Vec<u64>,
}

impl CompatNote {
    /// NVIDIA's rule with a note: with both driver versions known, the host's branch must be
    /// listed and the compat driver newer; otherwise compare CUDA versions if the host's is known.
    pub fn use_compat(
        &self,
        compat: Option<Version>,
        host: Option<Version>,
        host_cuda: Option<Version>,
    ) -> bool {
        match (compat, host) {
            (Some(c), Some(h)) => self.driver.contains(&h.0) && c > h,
            _ => match (host_cuda, Version::parse(&self.cuda_version)) {
                (Some(hc), Some(cc)) => cc.cmp(&hc) == Ordering::Greater,
                _ => false,
            },
        }
    }
}

/// Decides from the versions (and the note, when the library has one) whether to use the
/// compat libraries. Without a note, NVIDIA compares major versions only, and says no when
/// only a host CUDA version was given.
pub fn use_compat(
    note: Option<&CompatNote>,
    compat: Option<Version>,
    host: Option<Version>,
    host_cuda: Option<Version>,
    host_cuda_given: bool,
) -> bool {
    if let Some(n) = note {
        return n.use_compat(compat, host, host_cuda);
    }
    if host_cuda_given {
        return false;
    }
    match (compat, host) {
        (Some(c), Some(h)) => h.0 < c.0,
        _ => false,
    }
}

/// Reads the `.note.cuda.fwd_compatibility` note of a 64-bit ELF file. `Ok(None)` when the
/// file is not such an ELF or has no NVIDIA note; `Err` only on I/O errors.
pub fn read_note(file: &File) -> std::io::Result<Option<CompatNote>> {
    let mut ident = [0u8; 64];
    if file.read_exact_at(&mut ident, 0).is_err() || &ident[..4] != b"\x7fELF" || ident[4] != 2 {
        return Ok(None);
    }
    let little = match ident[5] {
        1 => true,
        2 => false,
        _ => return Ok(None),
    };
    let u16_at = |b: &[u8], o: usize| {
        let a = [b[o], b[o + 1]];
        if little {
            u16::from_le_bytes(a)
        } else {
            u16::from_be_bytes(a)
        }
    };
    let u32_at = |b: &[u8], o: usize| {
        let a = [b[o], b[o + 1], b[o + 2], b[o + 3]];
        if little {
            u32::from_le_bytes(a)
        } else {
            u32::from_be_bytes(a)
        }
    };
    let u64_at = |b: &[u8], o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        if little {
            u64::from_le_bytes(a)
        } else {
            u64::from_be_bytes(a)
        }
    };
    let shoff = u64_at(&ident, 0x28);
    let shentsize = usize::from(u16_at(&ident, 0x3a));
    let shnum = usize::from(u16_at(&ident, 0x3c));
    let shstrndx = usize::from(u16_at(&ident, 0x3e));
    // ELF64 section headers are 64 bytes; anything else is not a file we read.
    if shentsize != 64 || shnum == 0 || shstrndx >= shnum || shnum > 4096 {
        return Ok(None);
    }
    let mut table = vec![0u8; shentsize * shnum];
    if file.read_exact_at(&mut table, shoff).is_err() {
        return Ok(None);
    }
    let section = |i: usize| {
        let b = &table[i * shentsize..];
        (
            u32_at(b, 0),    // sh_name
            u32_at(b, 4),    // sh_type
            u64_at(b, 0x18), // sh_offset
            u64_at(b, 0x20), // sh_size
            u64_at(b, 0x30), // sh_addralign
        )
    };
    let read = |off: u64, size: u64| -> Option<Vec<u8>> {
        let size = usize::try_from(size).ok().filter(|s| *s <= 1 << 20)?;
        let mut buf = vec![0u8; size];
        file.read_exact_at(&mut buf, off).ok()?;
        Some(buf)
    };
    let (_, _, str_off, str_size, _) = section(shstrndx);
    let Some(names) = read(str_off, str_size) else {
        return Ok(None);
    };
    const SHT_NOTE: u32 = 7;
    const WANTED: &[u8] = b".note.cuda.fwd_compatibility";
    for i in 0..shnum {
        let (name, kind, off, size, align) = section(i);
        let name = names.get(name as usize..).unwrap_or(&[]);
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        if kind != SHT_NOTE || name != WANTED {
            continue;
        }
        let Some(data) = read(off, size) else {
            return Ok(None);
        };
        return Ok(parse_note(&data, align, little));
    }
    Ok(None)
}

/// Parses one ELF note (`namesz`, `descsz`, `type`, name, desc) holding NVIDIA's JSON.
fn parse_note(data: &[u8], align: u64, little: bool) -> Option<CompatNote> {
    if data.len() < 12 {
        return None;
    }
    let word = |o: usize| {
        let a = [data[o], data[o + 1], data[o + 2], data[o + 3]];
        usize::try_from(if little {
            u32::from_le_bytes(a)
        } else {
            u32::from_be_bytes(a)
        })
        .ok()
    };
    let (namesz, descsz) = (word(0)?, word(4)?);
    if namesz == 0 || descsz == 0 {
        return None;
    }
    let align = usize::try_from(align).ok().filter(|a| *a > 0).unwrap_or(4);
    let name_end = 12usize.checked_add(namesz.div_ceil(align) * align)?;
    let trim = |b: &[u8]| -> Vec<u8> {
        let s = b.iter().position(|&c| c != 0).unwrap_or(b.len());
        let e = b.iter().rposition(|&c| c != 0).map_or(s, |e| e + 1);
        b[s..e].to_vec()
    };
    let name = trim(data.get(12..name_end.min(data.len()))?);
    if name != b"NVIDIA Corporation" {
        return None;
    }
    let desc = trim(data.get(name_end..name_end.checked_add(descsz)?.min(data.len()))?);
    serde_json::from_slice(&desc).ok()
}

/// Runs the hook: finds the single `libcuda.so.*.*` in the compat folder and, if it should
/// be used, writes [`DROP_IN`] naming the folder (symlinks resolved inside the root).
pub fn run(root: &ContainerRoot, opts: &Options) -> Result<()> {
    let host_v = opts
        .host_driver_version
        .as_deref()
        .filter(|s| !s.is_empty());
    let host_cuda = opts.host_cuda_version.as_deref().filter(|s| !s.is_empty());
    // The folder is opened inside the root; its name as the container sees it (symlinks
    // resolved) is what goes into the drop-in, so it must be a clean config line.
    let Some(dir) = root.open_dir(&opts.compat_dir)? else {
        log::line(
            HOOK,
            format_args!(
                "no {} in the container; nothing to do",
                opts.compat_dir.display()
            ),
        );
        return Ok(());
    };
    let dir_in_root = dir.in_root.clone();
    let mut libs: Vec<String> = dir
        .list()?
        .into_iter()
        .filter(|(_, t)| t.is_file())
        .map(|(n, _)| n.to_string_lossy().into_owned())
        .filter(|n| {
            n.strip_prefix("libcuda.so.")
                .is_some_and(|v| v.contains('.'))
        })
        .collect();
    libs.sort();
    let lib = match libs.as_slice() {
        [one] => one.clone(),
        [] => {
            log::line(
                HOOK,
                format_args!(
                    "no libcuda.so.*.* in {}; nothing to do",
                    escaped(dir_in_root.as_os_str())
                ),
            );
            return Ok(());
        }
        many => {
            log::line(
                HOOK,
                format_args!(
                    "{} compat libraries in {} ({}); not choosing, nothing to do",
                    many.len(),
                    escaped(dir_in_root.as_os_str()),
                    many.join(", ")
                ),
            );
            return Ok(());
        }
    };
    let lib_shown = dir.shown(std::ffi::OsStr::new(&lib));
    let Some(file) = dir.open_regular(std::ffi::OsStr::new(&lib))? else {
        return Err(HookError::Refused {
            path: escaped(lib_shown.as_os_str()),
            reason: "was replaced while the hook read the folder".into(),
        });
    };
    let note = read_note(&file).map_err(|e| HookError::io("reading", &lib_shown, e))?;
    let compat_v = lib.strip_prefix("libcuda.so.").and_then(Version::parse);
    let decision = use_compat(
        note.as_ref(),
        compat_v,
        host_v.and_then(Version::parse),
        host_cuda.and_then(Version::parse),
        host_cuda.is_some(),
    );
    if !decision {
        log::line(
            HOOK,
            format_args!(
                "{}/{lib} is not newer than the host driver {}; not used",
                escaped(dir_in_root.as_os_str()),
                host_v.unwrap_or("(unknown)")
            ),
        );
        return Ok(());
    }
    let line = config_line(&dir_in_root)?;
    let written = root.write_file(Path::new(DROP_IN), format!("{line}\n").as_bytes())?;
    log::line(
        HOOK,
        format_args!(
            "{}/{lib} is newer than the host driver {}; wrote {}",
            escaped(dir_in_root.as_os_str()),
            host_v.unwrap_or("(unknown)"),
            written.display()
        ),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_versions() {
        assert_eq!(Version::parse("550.163.01"), Some(Version(550, 163, 1)));
        assert_eq!(Version::parse("12.4"), Some(Version(12, 4, 0)));
        assert_eq!(Version::parse("v575"), Some(Version(575, 0, 0)));
        for bad in ["", "x", "1..2", "1.2.3.4", "550.*.*", "1.2-rc1"] {
            assert_eq!(Version::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn without_a_note_majors_decide() {
        let v = |s| Version::parse(s);
        assert!(use_compat(
            None,
            v("575.57.08"),
            v("550.163.01"),
            None,
            false
        ));
        assert!(!use_compat(
            None,
            v("550.200.01"),
            v("550.163.01"),
            None,
            false
        ));
        assert!(!use_compat(
            None,
            v("535.1.1"),
            v("550.163.01"),
            None,
            false
        ));
        assert!(use_compat(None, v("222.88.99"), v("99.55.66"), None, false));
        assert!(!use_compat(None, v("575.57.08"), None, None, false));
        assert!(!use_compat(
            None,
            v("575.57.08"),
            v("550.1.1"),
            v("12.4"),
            true
        ));
    }

    #[test]
    fn with_a_note_the_branch_list_decides() {
        let v = |s| Version::parse(s);
        let note = CompatNote {
            cuda_version: "12.9".into(),
            driver: vec![535, 550, 570, 575],
        };
        assert!(use_compat(
            Some(&note),
            v("575.57.08"),
            v("550.163.01"),
            None,
            false
        ));
        assert!(!use_compat(
            Some(&note),
            v("575.57.08"),
            v("590.44.01"),
            None,
            false
        ));
        assert!(use_compat(
            Some(&note),
            v("575.57.08"),
            v("575.10.10"),
            None,
            false
        ));
        assert!(!use_compat(
            Some(&note),
            v("575.57.08"),
            v("575.57.08"),
            None,
            false
        ));
        assert!(use_compat(Some(&note), None, None, v("12.4"), true));
        assert!(!use_compat(Some(&note), None, None, v("12.9"), true));
    }

    /// A minimal 64-bit little-endian ELF with a section string table and the CUDA note.
    pub(crate) fn elf_with_note(json: &str) -> Vec<u8> {
        let name = b"NVIDIA Corporation\0";
        let pad = |v: &mut Vec<u8>| {
            while !v.len().is_multiple_of(4) {
                v.push(0);
            }
        };
        let mut note = Vec::new();
        note.extend((name.len() as u32).to_le_bytes());
        note.extend((json.len() as u32).to_le_bytes());
        note.extend(1u32.to_le_bytes());
        note.extend(name);
        pad(&mut note);
        note.extend(json.as_bytes());
        pad(&mut note);
        let strtab = b"\0.shstrtab\0.note.cuda.fwd_compatibility\0".to_vec();
        let note_off = 64u64;
        let str_off = note_off + note.len() as u64;
        let sh_off = str_off + strtab.len() as u64;
        let mut out = vec![0u8; 64];
        out[..4].copy_from_slice(b"\x7fELF");
        out[4] = 2;
        out[5] = 1;
        out[6] = 1;
        out[0x28..0x30].copy_from_slice(&sh_off.to_le_bytes());
        out[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        out[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        out[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());
        out.extend(&note);
        out.extend(&strtab);
        let sh = |name: u32, kind: u32, off: u64, size: u64, align: u64| {
            let mut s = vec![0u8; 64];
            s[0..4].copy_from_slice(&name.to_le_bytes());
            s[4..8].copy_from_slice(&kind.to_le_bytes());
            s[0x18..0x20].copy_from_slice(&off.to_le_bytes());
            s[0x20..0x28].copy_from_slice(&size.to_le_bytes());
            s[0x30..0x38].copy_from_slice(&align.to_le_bytes());
            s
        };
        out.extend(sh(0, 0, 0, 0, 0));
        out.extend(sh(1, 3, str_off, strtab.len() as u64, 1));
        out.extend(sh(11, 7, note_off, note.len() as u64, 4));
        out
    }

    #[test]
    fn reads_the_note_from_an_elf() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("libcuda.so.575.57.08");
        std::fs::write(
            &p,
            elf_with_note(
                r#"{"Format":1,"CUDA Version":"12.9","Driver":[535,550,575],"Device":[]}"#,
            ),
        )
        .unwrap();
        let note = read_note(&File::open(&p).unwrap()).unwrap().unwrap();
        assert_eq!(note.cuda_version, "12.9");
        assert_eq!(note.driver, vec![535, 550, 575]);
        std::fs::write(&p, "not an elf").unwrap();
        assert_eq!(read_note(&File::open(&p).unwrap()).unwrap(), None);
    }
}
