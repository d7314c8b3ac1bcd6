//! The files whose tables a command's last recorded run loaded (`record -- CMD`), kept beside
//! the tables on disk, so that the next run of the command has them in the kernel before it
//! starts: its exec and library mappings are then walked from their first instruction (the
//! kernel maps loaded files early, `UnwindFile`), instead of waiting for each file's table to
//! be read after its mapping's record arrives — most of a short compile's run.
//!
//! One list per command, named by its executable's identity (a rebuilt or upgraded program
//! starts a new list) and the name it was run by (rustup's one binary run as `cargo` and as
//! `rustc` loads different libraries), not by its arguments: `rustc -O a.rs -o a` and `rustc
//! b.rs` load the same libraries. Each run replaces the list; tables listed that a run does
//! not use are loaded for nothing, and released seconds later. Each line is a file's identity
//! and path; a file whose identity has changed since is skipped when read. A damaged list is
//! only a shorter one.

use std::path::{Path, PathBuf};

use super::FileIdentity;
use crate::system::cache_dir::CacheDir;

/// Files listed at most (the rows array bounds what is loaded anyway).
pub const MAX_FILES: usize = 256;
/// Bytes read of a list at most.
const MAX_BYTES: u64 = 256 << 10;

pub fn identity_of(path: &Path) -> Option<FileIdentity> {
    let meta = std::fs::metadata(path).ok()?;
    meta.is_file().then(|| super::file_identity(&meta))
}

/// The list's name for the command line `argv` (`argv[0]` looked up in `PATH` like the launch
/// does), None if it names no file.
pub fn list_name(argv: &[String]) -> Option<String> {
    let argv0 = argv.first()?;
    let exe = resolve(argv0)?;
    let id = identity_of(&exe)?;
    let base = Path::new(argv0).file_name()?.to_string_lossy();
    let base: String =
        base.chars().map(|c| if c.is_ascii_alphanumeric() || c == '.' { c } else { '_' }).collect();
    Some(format!("launch-{base}-{:x}-{:x}-{:x}-{:x}.list", id.0, id.1, id.2, id.3))
}

fn resolve(argv0: &str) -> Option<PathBuf> {
    if argv0.contains('/') {
        return Some(PathBuf::from(argv0));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(argv0)).find(|p| p.is_file())
}

/// The files listed whose identity is still the one listed.
pub fn read(dir: &CacheDir, name: &str) -> Vec<(FileIdentity, PathBuf)> {
    use std::io::Read as _;
    let Some(f) = dir.open(name) else { return Vec::new() };
    let mut text = String::new();
    if f.take(MAX_BYTES).read_to_string(&mut text).is_err() {
        return Vec::new();
    }
    text.lines()
        .filter_map(parse_line)
        .filter(|(id, p)| identity_of(p) == Some(*id))
        .take(MAX_FILES)
        .collect()
}

fn parse_line(line: &str) -> Option<(FileIdentity, PathBuf)> {
    let mut f = line.splitn(5, ' ');
    let mut num = || u64::from_str_radix(f.next()?, 16).ok();
    let id = (num()?, num()?, num()? as i64, num()?);
    let path = f.next().filter(|p| p.starts_with('/'))?;
    Some((id, PathBuf::from(path)))
}

/// Writes the list (whole, then renamed into place).
pub fn write(dir: &CacheDir, name: &str, files: &[(FileIdentity, &Path)]) -> std::io::Result<()> {
    let mut text = String::new();
    for (id, path) in files.iter().take(MAX_FILES) {
        let Some(p) = path.to_str().filter(|p| !p.contains('\n')) else { continue };
        text.push_str(&format!("{:x} {:x} {:x} {:x} {p}\n", id.0, id.1, id.2 as u64, id.3));
    }
    dir.write(name, &[text.as_bytes()]).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_reads_back_only_files_still_the_same() {
        let dir = std::env::temp_dir().join(format!("rsprof-launch-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let cache = CacheDir::new(dir.clone(), 1 << 20);
        let (a, b) = (dir.join("a.so"), dir.join("b.so"));
        std::fs::write(&a, b"one").unwrap();
        std::fs::write(&b, b"two").unwrap();
        let (ida, idb) = (identity_of(&a).unwrap(), identity_of(&b).unwrap());
        write(&cache, "l.list", &[(ida, &a), (idb, &b)]).unwrap();
        assert_eq!(read(&cache, "l.list"), vec![(ida, a.clone()), (idb, b.clone())]);
        // Rewritten: a new size, so no longer the listed file.
        std::fs::write(&b, b"three").unwrap();
        assert_eq!(read(&cache, "l.list"), vec![(ida, a.clone())]);
        // Garbage lines are skipped.
        let mut text = std::fs::read_to_string(dir.join("l.list")).unwrap();
        text.insert_str(0, "zz 1 2\n\n1 2 3 4 relative/path\n");
        std::fs::write(dir.join("l.list"), text).unwrap();
        assert_eq!(read(&cache, "l.list"), vec![(ida, a)]);
        assert!(read(&cache, "missing.list").is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_command_is_named_by_its_executable_and_the_name_it_ran_by() {
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let sh = list_name(&argv(&["sh", "-c", "a"])).expect("sh on PATH");
        assert!(sh.starts_with("launch-sh-"), "{sh}");
        assert_eq!(list_name(&argv(&["sh", "-c", "b"])).as_ref(), Some(&sh));
        assert_ne!(list_name(&argv(&["/bin/true"])), list_name(&argv(&["/bin/false"])));
        assert_eq!(list_name(&argv(&["/nonexistent/x"])), None);
        assert_eq!(list_name(&[]), None);
    }
}
