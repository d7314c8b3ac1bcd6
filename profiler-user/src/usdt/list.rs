//! `rsprof-bpf list-usdt`: the probes of a file or a process, like `bpftrace -l 'usdt:…'`.

use std::{
    collections::{HashMap, HashSet},
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::{Result, anyhow, bail};

use super::{args, notes};
use crate::model::ids::Pid;

/// `rsprof-bpf list-usdt`: the probes of a file, or of every file a process maps.
pub fn list(path: Option<&Path>, pid: Option<Pid>) -> Result<String> {
    let mut files: Vec<(PathBuf, String)> = Vec::new();
    if let Some(p) = path {
        if !p.exists() {
            bail!("no such file: {}", p.display());
        }
        files.push((p.to_owned(), p.display().to_string()));
    }
    if let Some(pid) = pid {
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
            .map_err(|_| anyhow!("no process with pid {pid}"))?;
        let mut seen = HashSet::new();
        for line in maps.lines() {
            let f: Vec<&str> = line.split_ascii_whitespace().collect();
            if f.len() < 6 || !f[5].starts_with('/') || f[4] == "0" {
                continue;
            }
            let display = f[5..].join(" ");
            if seen.insert(display.clone()) {
                files.push((PathBuf::from(format!("/proc/{pid}/map_files/{}", f[0])), display));
            }
        }
    }
    let mut out = String::new();
    for (open, display) in files {
        let probes = match notes::read_probes(&open) {
            Ok(p) => p,
            Err(e) if path.is_some() => return Err(e),
            Err(_) => continue,
        };
        // One line per probe name; sites of one probe (inlined copies) are counted.
        let mut order: Vec<String> = Vec::new();
        let mut by_name: HashMap<String, Vec<&notes::Note>> = HashMap::new();
        for n in &probes.notes {
            let k = n.full_name();
            if !by_name.contains_key(&k) {
                order.push(k.clone());
            }
            by_name.entry(k).or_default().push(n);
        }
        for k in order {
            let sites = &by_name[&k];
            let n = sites[0];
            let _ = write!(out, "usdt:{display}:{k}");
            if sites.len() > 1 {
                let _ = write!(out, "  sites={}", sites.len());
            }
            if n.semaphore != 0 {
                let _ = write!(out, "  semaphore={:#x}", n.semaphore);
                if n.semaphore_page_shared {
                    let _ = write!(out, " (page shared with another segment)");
                }
            }
            let _ = write!(out, "  args: {}", if n.args.is_empty() { "(none)" } else { &n.args });
            let bad: Vec<String> = sites
                .iter()
                .filter_map(|s| args::parse_args(&s.args, s.pc, &probes.symbols).err())
                .map(|e| e.to_string())
                .collect();
            if let Some(e) = bad.first() {
                let _ = write!(out, "  [cannot record: {e}]");
            }
            out.push('\n');
        }
    }
    Ok(out)
}
