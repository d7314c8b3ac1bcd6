//! USDT (SystemTap SDT) probes: the `rsprof` provider that instrumented programs use for
//! markers, intervals, counters and labels, plus any probe named with `--usdt` /
//! `--usdt-interval`.
//!
//! * `notes` reads `.note.stapsdt` from ELF files; `args` parses argument specs.
//! * `attach` finds probe sites in the files processes map (each file once) and attaches the
//!   one BPF uprobe program to each, per file, with the site's spec index as BPF cookie.
//! * `gate` holds the first exec of each new file until its probes are attached.
//! * This module keeps the registry (probe id → what it is) and turns raw hits into typed
//!   [`UsdtHit`]s.
//!
//! * `markers` turns typed hits into stored markers as they are drained, and describes them
//!   in marker schemas.
//!
//! Label texts go to the process table (`ProcessInfo::labels`), where the writers name the
//! label frames samples carry.

pub mod args;
pub mod attach;
pub mod gate;
pub mod list;
pub mod markers;
pub mod notes;
pub mod report;
pub mod uprobe;

use std::{fmt, path::PathBuf};

use anyhow::{Result, bail};
use profiler_common::{USDT_STR_IS_NULL, USDT_STR_IS_TRUNCATED, USDT_STR_IS_UNREADABLE};

use crate::{
    bpf::decode::RawUsdtHit,
    model::ids::{Pid, Tid},
};

pub use attach::UsdtSession;
pub use report::UsdtReport;

/// Index of a probe (provider:name in one file) in the [`ProbeRegistry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ProbeId(pub u32);

/// Index of a probe site's spec: the BPF cookie of its uprobe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpecId(pub u32);

/// Index of a `--usdt-interval` request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IntervalId(pub u32);

/// What a probe means to the profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProbeRole {
    /// `rsprof:marker(const char *name, const char *text)`: an instant marker.
    RsprofMarker,
    /// `rsprof:begin(const char *name, u64 id)`: opens interval `id` of this thread.
    RsprofBegin,
    /// `rsprof:end(u64 id)`: closes the interval `id` opened by `rsprof:begin`.
    RsprofEnd,
    /// `rsprof:label_push(const char *label)`: only the first push of each label (per
    /// process) is sent, to name it; samples carry the label ids.
    RsprofLabelPush,
    /// `rsprof:label_pop()`: handled in the kernel, never sent.
    RsprofLabelPop,
    /// `rsprof:counter(const char *name, i64 value)`: a counter sample.
    RsprofCounter,
    /// A probe named by `--usdt`: an instant marker with its integer arguments.
    UserInstant,
    /// The start / end probe of a `--usdt-interval`: intervals pair per thread, start to the
    /// next end.
    UserIntervalStart(IntervalId),
    UserIntervalEnd(IntervalId),
}

impl ProbeRole {
    /// The role of an `rsprof` provider probe, by name; `None` for names outside the ABI.
    pub fn rsprof(name: &str) -> Option<ProbeRole> {
        Some(match name {
            "marker" => ProbeRole::RsprofMarker,
            "begin" => ProbeRole::RsprofBegin,
            "end" => ProbeRole::RsprofEnd,
            "label_push" => ProbeRole::RsprofLabelPush,
            "label_pop" => ProbeRole::RsprofLabelPop,
            "counter" => ProbeRole::RsprofCounter,
            _ => return None,
        })
    }

    /// Arguments the ABI defines, and which of them are C strings.
    pub fn abi(self) -> Option<&'static [bool]> {
        Some(match self {
            ProbeRole::RsprofMarker => &[true, true],
            ProbeRole::RsprofBegin => &[true, false],
            ProbeRole::RsprofEnd => &[false],
            ProbeRole::RsprofLabelPush => &[true],
            ProbeRole::RsprofLabelPop => &[],
            ProbeRole::RsprofCounter => &[true, false],
            _ => return None,
        })
    }
}

#[derive(Clone, Debug)]
pub struct ProbeInfo {
    pub provider: String,
    pub name: String,
    /// The file as the first process it was found in maps it.
    pub path: String,
    pub role: ProbeRole,
}

impl ProbeInfo {
    pub fn full_name(&self) -> String {
        format!("{}:{}", self.provider, self.name)
    }
}

#[derive(Clone, Debug)]
pub struct SiteInfo {
    pub probe: ProbeId,
    pub file_offset: u64,
    pub args: Vec<args::ArgSpec>,
    /// Per argument: read as a C string.
    pub strings: Vec<bool>,
}

/// Everything attached: probes and their sites, by the ids the kernel echoes in hits.
#[derive(Clone, Debug, Default)]
pub struct ProbeRegistry {
    pub probes: Vec<ProbeInfo>,
    pub sites: Vec<SiteInfo>,
    /// `--usdt-interval` requests, as typed (`python:gc__start:gc__done`).
    pub intervals: Vec<String>,
}

impl ProbeRegistry {
    pub fn probe(&self, id: ProbeId) -> Option<&ProbeInfo> {
        self.probes.get(id.0 as usize)
    }

    /// Types a raw hit's arguments by its site's spec. `None` for ids this registry never
    /// handed out (a corrupt record).
    pub fn resolve(&self, raw: &RawUsdtHit) -> Option<UsdtHit> {
        let site = self.sites.get(raw.spec_id as usize)?;
        if site.probe.0 != raw.probe_id {
            return None;
        }
        let mut slot = 0;
        let args = raw
            .args
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let is_str = site.strings.get(i).copied().unwrap_or(false);
                if raw.arg_errors & (1 << i) != 0 {
                    return UsdtArg::Unreadable;
                }
                if is_str {
                    let s = raw.strs.get(slot);
                    slot += 1;
                    return UsdtArg::Str(match s {
                        None => Err(StrError::Unreadable { addr: v }),
                        Some(s) => decode_str(s.flags, &s.bytes, v),
                    });
                }
                match site.args.get(i) {
                    Some(a) if a.signed => UsdtArg::Int(v as i64),
                    _ => UsdtArg::Uint(v),
                }
            })
            .collect();
        Some(UsdtHit {
            time_ns: raw.time_ns,
            pid: raw.pid,
            tid: raw.tid,
            cpu: raw.cpu,
            probe: site.probe,
            args,
        })
    }
}

fn decode_str(flags: u16, bytes: &[u8], addr: u64) -> Result<UsdtString, StrError> {
    if flags & USDT_STR_IS_NULL != 0 {
        return Err(StrError::Null);
    }
    if flags & USDT_STR_IS_UNREADABLE != 0 {
        return Err(StrError::Unreadable { addr });
    }
    let truncated = flags & USDT_STR_IS_TRUNCATED != 0;
    match std::str::from_utf8(bytes) {
        Ok(s) => Ok(UsdtString { text: s.to_owned(), truncated }),
        // A cut can split a multi-byte character: keep the valid prefix.
        Err(e) if truncated && e.error_len().is_none() => Ok(UsdtString {
            text: String::from_utf8_lossy(&bytes[..e.valid_up_to()]).into(),
            truncated,
        }),
        Err(_) => Err(StrError::InvalidUtf8 { lossy: String::from_utf8_lossy(bytes).into_owned() }),
    }
}

/// A typed probe hit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtHit {
    /// CLOCK_MONOTONIC, like sample times.
    pub time_ns: u64,
    pub pid: Pid,
    pub tid: Tid,
    pub cpu: u32,
    pub probe: ProbeId,
    pub args: Vec<UsdtArg>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum UsdtArg {
    Int(i64),
    Uint(u64),
    Str(Result<UsdtString, StrError>),
    /// The argument lived in user memory that could not be read at the probe.
    Unreadable,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsdtString {
    pub text: String,
    /// Cut at `USDT_STR_MAX - 1` bytes.
    pub truncated: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StrError {
    Null,
    Unreadable { addr: u64 },
    InvalidUtf8 { lossy: String },
}

impl UsdtArg {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            UsdtArg::Int(v) => Some(v as u64),
            UsdtArg::Uint(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        self.as_u64().map(|v| v as i64)
    }
}

/// Shows strings as text, with visible placeholders for what could not be read.
impl fmt::Display for UsdtArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            UsdtArg::Int(v) => write!(f, "{v}"),
            UsdtArg::Uint(v) => write!(f, "{v}"),
            UsdtArg::Str(Ok(s)) => {
                write!(f, "{}{}", s.text, if s.truncated { "…[truncated]" } else { "" })
            }
            UsdtArg::Str(Err(StrError::Null)) => write!(f, "<null>"),
            UsdtArg::Str(Err(StrError::Unreadable { addr })) => write!(f, "<unreadable {addr:#x}>"),
            UsdtArg::Str(Err(StrError::InvalidUtf8 { lossy })) => {
                write!(f, "{lossy}[invalid utf-8]")
            }
            UsdtArg::Unreadable => write!(f, "<unreadable>"),
        }
    }
}

/// A `--usdt` / `--usdt-interval` request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeRequest {
    pub provider: String,
    pub name: String,
    /// Only in this file (binary or library); else in any file of the profiled processes.
    pub path: Option<PathBuf>,
    pub role: ProbeRole,
}

fn split_path(spec: &str) -> Result<(&str, Option<PathBuf>)> {
    match spec.split_once('@') {
        Some((_, "")) => bail!("invalid USDT probe '{spec}': empty path after '@'"),
        Some((p, path)) => Ok((p, Some(PathBuf::from(path)))),
        None => Ok((spec, None)),
    }
}

fn check_ident(what: &str, s: &str, spec: &str) -> Result<()> {
    if s.is_empty() || !s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        bail!("invalid {what} '{s}' in USDT probe '{spec}'");
    }
    Ok(())
}

/// Parses `--usdt PROVIDER:NAME[@PATH]`.
pub fn parse_probe_request(spec: &str) -> Result<ProbeRequest> {
    let (probe, path) = split_path(spec)?;
    let Some((provider, name)) = probe.split_once(':') else {
        bail!("invalid USDT probe '{spec}': expected PROVIDER:NAME[@PATH]");
    };
    check_ident("provider", provider, spec)?;
    check_ident("name", name, spec)?;
    Ok(ProbeRequest {
        provider: provider.into(),
        name: name.into(),
        path,
        role: ProbeRole::UserInstant,
    })
}

/// Parses `--usdt-interval PROVIDER:START:END[@PATH]` into its start and end requests.
pub fn parse_interval_request(spec: &str, id: IntervalId) -> Result<[ProbeRequest; 2]> {
    let (probe, path) = split_path(spec)?;
    let parts: Vec<&str> = probe.split(':').collect();
    let [provider, start, end] = parts[..] else {
        bail!("invalid USDT interval '{spec}': expected PROVIDER:START:END[@PATH]");
    };
    check_ident("provider", provider, spec)?;
    check_ident("start probe", start, spec)?;
    check_ident("end probe", end, spec)?;
    if start == end {
        bail!("invalid USDT interval '{spec}': start and end are the same probe");
    }
    let req = |name: &str, role| ProbeRequest {
        provider: provider.into(),
        name: name.into(),
        path: path.clone(),
        role,
    };
    Ok([req(start, ProbeRole::UserIntervalStart(id)), req(end, ProbeRole::UserIntervalEnd(id))])
}

/// The requests of `--usdt` and `--usdt-interval`, and the intervals' names.
pub fn requests_from_args(
    usdt: &[String],
    intervals: &[String],
) -> Result<(Vec<ProbeRequest>, Vec<String>)> {
    let mut reqs = Vec::new();
    for s in usdt {
        reqs.push(parse_probe_request(s)?);
    }
    for (i, s) in intervals.iter().enumerate() {
        reqs.extend(parse_interval_request(s, IntervalId(i as u32))?);
    }
    Ok((reqs, intervals.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests() {
        let r = parse_probe_request("python:gc__start").unwrap();
        assert_eq!((r.provider.as_str(), r.name.as_str(), r.path), ("python", "gc__start", None));
        let r = parse_probe_request("hotspot:gc-begin@/usr/lib/libjvm.so").unwrap();
        assert_eq!(r.path, Some(PathBuf::from("/usr/lib/libjvm.so")));
        for bad in ["python", "python:", ":x", "a:b:c", "py thon:x"] {
            assert!(parse_probe_request(bad).is_err(), "{bad}");
        }
        let [s, e] = parse_interval_request("python:gc__start:gc__done", IntervalId(0)).unwrap();
        assert_eq!(s.role, ProbeRole::UserIntervalStart(IntervalId(0)));
        assert_eq!(e.name, "gc__done");
        for bad in ["python:a", "python:a:a", "python:a:b:c", "p:a:b@"] {
            assert!(parse_interval_request(bad, IntervalId(0)).is_err(), "{bad}");
        }
    }

    #[test]
    fn strings_show_placeholders() {
        let s = |flags, bytes: &[u8]| UsdtArg::Str(decode_str(flags, bytes, 0x1234)).to_string();
        assert_eq!(s(0, b"hot"), "hot");
        assert_eq!(s(USDT_STR_IS_NULL, b""), "<null>");
        assert_eq!(s(USDT_STR_IS_UNREADABLE, b""), "<unreadable 0x1234>");
        assert_eq!(s(USDT_STR_IS_TRUNCATED, b"abc"), "abc…[truncated]");
        assert_eq!(s(0, b"a\xffb"), "a\u{fffd}b[invalid utf-8]");
        // A cut in the middle of "é" keeps the prefix.
        assert_eq!(s(USDT_STR_IS_TRUNCATED, b"ab\xc3"), "ab…[truncated]");
    }
}
