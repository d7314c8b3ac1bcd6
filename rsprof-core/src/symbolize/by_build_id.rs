//! Names (build-id, ELF virtual address) pairs where the file itself is not at hand: what an
//! agent left unnamed on a host without debug files, named when its windows are read
//! (`query`). The debug file of a build-id comes from a directory laid out as
//! `/usr/lib/debug` is (`DIR/.build-id/xx/rest.debug`), else from debuginfod.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use blazesym::symbolize::{
    Input, Symbolized, Symbolizer,
    source::{Elf, Source},
};

use super::{debuginfod, new_symbolizer, sym_frames};
use crate::model::stacks::{ElfAddress, Frame};

/// What naming by build-id did, for `query`'s report.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Distinct (build-id, address) pairs named, and those left as addresses.
    pub named: u64,
    pub unnamed: u64,
    /// Build-ids whose debug file was found in the debug directory, and those found nowhere.
    pub from_dir: u64,
    pub missing: u64,
    pub debuginfod: debuginfod::Stats,
    /// Pairs named from names a database held (`known`), and pairs stored there
    /// after; the last failure to read or store them.
    pub from_store: u64,
    pub stored: u64,
    pub store_error: Option<String>,
    /// Debug files blazesym could not read, the last reason.
    pub errors: u64,
    pub last_error: Option<String>,
}

pub struct ByBuildId {
    debug_dir: Option<PathBuf>,
    debuginfod: Option<debuginfod::Config>,
    /// Debug file of each build-id looked up (None: none found).
    files: HashMap<String, Option<PathBuf>>,
    /// Frames of each pair asked (None: not named), outermost first, `module` empty.
    names: HashMap<(String, u64), Option<Vec<Frame>>>,
    /// Pairs named from debug files, in order.
    fresh: Vec<(String, u64)>,
    sym: Symbolizer,
    pub stats: Stats,
}

impl ByBuildId {
    pub fn new(debug_dir: Option<PathBuf>, debuginfod: Option<debuginfod::Config>) -> Self {
        Self {
            debug_dir,
            debuginfod,
            files: HashMap::new(),
            names: HashMap::new(),
            fresh: Vec::new(),
            sym: new_symbolizer(),
            stats: Stats::default(),
        }
    }

    /// Whether there is anywhere to look.
    pub fn enabled(&self) -> bool {
        self.debug_dir.is_some() || self.debuginfod.is_some()
    }

    /// Names `pairs` (lower-case hex build-id, ELF virtual address): each debug file looked
    /// up once, each pair symbolized once.
    pub fn name(&mut self, pairs: &[(String, u64)]) {
        let mut ids: Vec<&String> = (pairs.iter())
            .filter(|p| !self.names.contains_key(*p))
            .map(|p| &p.0)
            .filter(|id| !self.files.contains_key(*id))
            .collect();
        ids.sort_unstable();
        ids.dedup();
        let mut remote = Vec::new();
        for id in ids {
            match self.debug_dir.as_deref().and_then(|d| in_dir(d, id)) {
                Some(p) => {
                    self.stats.from_dir += 1;
                    self.files.insert(id.clone(), Some(p));
                }
                None => remote.push(id.clone()),
            }
        }
        if !remote.is_empty() {
            let fetched = match &self.debuginfod {
                Some(c) => debuginfod::debug_files(c, &remote, &mut self.stats.debuginfod),
                None => HashMap::new(),
            };
            for id in remote {
                let file = fetched.get(&id).cloned();
                self.stats.missing += u64::from(file.is_none());
                self.files.insert(id, file);
            }
        }
        let mut by_file: HashMap<&str, Vec<u64>> = HashMap::new();
        for (id, addr) in pairs {
            if !self.names.contains_key(&(id.clone(), *addr)) {
                by_file.entry(id).or_default().push(*addr);
            }
        }
        for (id, mut addrs) in by_file {
            addrs.sort_unstable();
            addrs.dedup();
            let results = match self.files.get(id).cloned().flatten() {
                Some(path) => {
                    match self
                        .sym
                        .symbolize(&Source::Elf(Elf::new(&path)), Input::VirtOffset(&addrs))
                    {
                        Ok(r) => Some(r),
                        Err(e) => {
                            self.stats.errors += 1;
                            self.stats.last_error = Some(format!("{}: {e}", path.display()));
                            None
                        }
                    }
                }
                None => None,
            };
            for (i, &addr) in addrs.iter().enumerate() {
                let frames = match results.as_ref().map(|r| &r[i]) {
                    Some(Symbolized::Sym(s)) => Some(sym_frames(s, "")),
                    _ => None,
                };
                if frames.is_some() {
                    self.stats.named += 1;
                    self.fresh.push((id.to_owned(), addr));
                } else {
                    self.stats.unnamed += 1;
                }
                self.names.insert((id.to_owned(), addr), frames);
            }
        }
    }

    /// Names known already (from a database), so that `name` does not look for them.
    pub fn known(&mut self, named: Vec<(ElfAddress, Vec<Frame>)>) {
        for (at, frames) in named {
            self.stats.from_store += 1;
            self.names.insert((at.build_id, at.address), Some(frames));
        }
    }

    /// The pairs named from debug files so far, with their frames.
    pub fn fresh(&self) -> Vec<(ElfAddress, Vec<Frame>)> {
        (self.fresh.iter())
            .filter_map(|(id, addr)| {
                let frames = self.frames(id, *addr)?.to_vec();
                Some((ElfAddress { build_id: id.clone(), address: *addr }, frames))
            })
            .collect()
    }

    /// The frames of a pair `name` was given (outermost first, `module` empty).
    pub fn frames(&self, id: &str, addr: u64) -> Option<&[Frame]> {
        self.names.get(&(id.to_owned(), addr))?.as_deref()
    }
}

/// The debug file of build-id `id` under `dir` (`dir/.build-id/xx/rest.debug`, or
/// `dir/xx/rest.debug` for a `.build-id` directory itself), if it is that build-id's.
fn in_dir(dir: &Path, id: &str) -> Option<PathBuf> {
    if id.len() < 4 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let (head, rest) = id.split_at(2);
    let name = format!("{rest}.debug");
    [dir.join(".build-id").join(head).join(&name), dir.join(head).join(&name)]
        .into_iter()
        .find(|p| p.is_file() && debuginfod::file_build_id(p).as_deref() == Some(id))
}
