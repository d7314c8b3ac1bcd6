//! The process's executable and command line in the Gecko profile: a `Process` interval
//! marker spanning its life on its main thread (Marker Chart, Marker Table, tooltip and
//! sidebar show the fields). The track itself keeps the short name (`comm`) as
//! `processName`: a command line is too long for a track label.

use serde_json::{Value, json};

use crate::model::{ids::Pid, process::ProcessMeta};

pub const MARKER_TYPE: &str = "ProcessInfo";
pub const MARKER_NAME: &str = "Process";

pub fn marker_schema() -> Value {
    let field = |key: &str, label: &str| json!({"key": key, "label": label, "format": "string"});
    json!({
        "name": MARKER_TYPE,
        "display": ["marker-chart", "marker-table"],
        "chartLabel": "{marker.data.argv}",
        "tableLabel": "{marker.data.pid} {marker.data.argv}",
        "tooltipLabel": "{marker.name} {marker.data.pid}: {marker.data.argv}",
        "description": "The process's executable and command line (argv as the kernel saw it at exec)",
        "data": [
            {"key": "pid", "label": "PID", "format": "integer"},
            {"key": "exe", "label": "Executable", "format": "file-path"},
            field("argv", "Command line"),
        ],
    })
}

/// The marker's payload; `None` when nothing beyond the name is known.
pub fn marker(pid: Pid, p: &ProcessMeta) -> Option<Value> {
    if p.argv.is_empty() && p.exe.is_empty() {
        return None;
    }
    Some(json!({
        "type": MARKER_TYPE,
        "pid": pid.0,
        "exe": p.exe,
        "argv": p.command_line(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_carries_exe_and_quoted_argv() {
        let p = ProcessMeta {
            exe: "/usr/bin/python3.11".into(),
            argv: vec!["python3".into(), "-c".into(), "print('hi there')".into()],
            argv_truncated: true,
            ..Default::default()
        };
        let m = marker(Pid(42), &p).unwrap();
        assert_eq!(m["exe"], "/usr/bin/python3.11");
        assert_eq!(m["argv"], r"python3 -c 'print('\''hi there'\'')'…");
        assert_eq!(m["pid"], 42);
        assert!(marker(Pid(1), &ProcessMeta::default()).is_none());
    }
}
