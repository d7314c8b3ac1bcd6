//! The end-of-recording summary: by default a few lines a user acts on, with `-v` the full
//! report, and the full report inside the Gecko profile either way. Records only its own
//! fixture (`-- CMD`), so the numbers it checks are the fixture's. Needs root.

use std::process::Stdio;

use serde_json::Value;
use tests::{
    fixtures, gecko_schema,
    harness::{self, output_path},
    profile_query::{sample_stacks, threads},
};

/// The default summary's fixed lines: the "sampling" line, what was recorded, samples and
/// losses, complete stacks, the top-functions heading and five functions, where the file is,
/// and where the full report is. Warnings come on top, one line each, only when something
/// needs acting on (a clean recording of one busy fixture has none or one).
const SHORT_FIXED_LINES: usize = 12;
const SHORT_MAX_LINES: usize = SHORT_FIXED_LINES + 4;

/// Records `split 2` (2 s of a 3:1 split between `hot_a` and `hot_b`), verbose or not;
/// returns stderr, the profile and its path.
fn record_split(test: &str, verbose: bool) -> (String, Value, String) {
    let exe = fixtures::build("split").unwrap();
    let out = output_path(test, "json.gz");
    let mut cmd = harness::command().unwrap();
    // `command` asks for the full report (other tests read it); here a user's default.
    cmd.env_remove("RSPROF_VERBOSE");
    if verbose {
        cmd.arg("-v");
    }
    let done =
        cmd.arg("-o").arg(&out).arg("--").arg(&exe).arg("2").stdin(Stdio::null()).output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr).into_owned();
    assert!(done.status.success(), "{}: {stderr}", done.status);
    let profile = gecko_schema::load(&out).unwrap();
    (stderr, profile, out.display().to_string())
}

/// The numbers after `prefix` on the first line that starts with it.
fn numbers_after(text: &str, prefix: &str) -> Vec<f64> {
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?}:\n{text}"));
    line.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|w| w.trim_end_matches('.').parse().ok())
        .collect()
}

/// Samples in the profile, and those whose stack is missing or starts at a truncation marker.
fn profile_stacks(profile: &Value) -> (usize, usize) {
    let (mut all, mut cut) = (0, 0);
    for t in threads(profile) {
        for stack in sample_stacks(t.thread) {
            all += 1;
            if stack.first().is_none_or(|root| root.starts_with("[truncated")) {
                cut += 1;
            }
        }
    }
    (all, cut)
}

fn report_in(profile: &Value) -> &str {
    profile["meta"]["rsprof"]["report"].as_str().expect("meta.rsprof.report holds the report")
}

#[test]
fn default_summary_is_short_and_says_what_matters() {
    let (stderr, profile, out) = record_split("summary_short", false);
    let lines: Vec<&str> = stderr.lines().collect();
    let warnings = lines.iter().filter(|l| l.starts_with("warning: ")).count();
    assert!(
        lines.len() - warnings <= SHORT_FIXED_LINES && lines.len() <= SHORT_MAX_LINES,
        "{} lines ({warnings} warnings), want at most {SHORT_FIXED_LINES} besides warnings:\n\
         {stderr}",
        lines.len()
    );
    assert!(stderr.contains(&format!("wrote {out} (gecko, ")), "names the output:\n{stderr}");
    assert!(stderr.contains("profiler.firefox.com"), "says how to open it:\n{stderr}");
    // samples: N recorded, M lost (x%); …
    let n = numbers_after(&stderr, "samples: ");
    let (recorded, lost) = (n[0], n[1]);
    // Under load the fixture may get half a CPU: a few hundred samples at least.
    assert!(recorded > 200.0, "2 s of a busy thread at 999 Hz: {recorded}\n{stderr}");
    assert!(lost >= 0.0);
    // stacks: P% complete (C of B); T cut short …; S without a stack — the profile's own count.
    let n = numbers_after(&stderr, "stacks: ");
    let (complete, busy) = (n[1] as usize, n[2] as usize);
    let (all, cut) = profile_stacks(&profile);
    assert_eq!(busy, all, "the summary counts the profile's samples:\n{stderr}");
    assert_eq!(recorded as usize, all, "nothing idle or recycled here:\n{stderr}");
    assert_eq!(complete, all - cut, "complete stacks as the profile has them:\n{stderr}");
    let top: Vec<&str> = lines
        .iter()
        .skip_while(|l| !l.starts_with("top functions"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .copied()
        .collect();
    assert!(!top.is_empty() && top.len() <= 5, "a handful of top functions:\n{stderr}");
    assert!(top[0].contains("hot_a (in split)"), "hot_a leads the 3:1 split:\n{stderr}");
    assert!(top.iter().any(|l| l.contains("hot_b (in split)")), "{stderr}");
    // Internals are left to -v, and kept in the profile.
    assert!(!stderr.contains("lost by cause") && !stderr.contains("event loop:"), "{stderr}");
    let report = report_in(&profile);
    let n = numbers_after(report, "samples: ");
    assert_eq!(n[0], recorded, "the profile's report is this recording's:\n{report}");
    for part in ["lost by cause:", "kernel:", "top functions by self samples:", "event loop:"] {
        assert!(report.contains(part), "{part:?} in the profile's report:\n{report}");
    }
}

#[test]
fn verbose_prints_the_full_report_the_profile_carries() {
    let (stderr, profile, out) = record_split("summary_verbose", true);
    assert!(stderr.lines().count() > SHORT_MAX_LINES, "the full report:\n{stderr}");
    for part in ["lost by cause:", "kernel:", "buffer:", "processes:", "event loop:"] {
        assert!(stderr.contains(part), "{part:?} with -v:\n{stderr}");
    }
    assert!(stderr.contains(&format!("wrote {out} (gecko, ")), "{stderr}");
    assert!(!stderr.contains("the full report: -v"), "{stderr}");
    // The profile's copy is the same report up to the session's details, which it rendered
    // before the unwind tables' disk cache was written.
    let report = report_in(&profile);
    let counters: Vec<&str> =
        report.lines().take_while(|l| !l.starts_with("event loop:")).collect();
    assert!(counters.len() > 5, "{report}");
    let printed: Vec<&str> = stderr.lines().collect();
    let at = printed.iter().position(|l| *l == counters[0]).expect("the report's first line");
    assert_eq!(&printed[at..at + counters.len()], &counters[..], "printed:\n{stderr}");
}
