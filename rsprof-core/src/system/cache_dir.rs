//! A directory of cache files shared by rsprof-bpf runs and agents: each file written whole
//! then renamed into place (a reader never sees half of one), its mtime renewed on use, and the
//! least recently used deleted beyond a bound.

use std::{
    fs::File,
    io::Write as _,
    path::{Path, PathBuf},
    time::SystemTime,
};

#[derive(Clone, Debug)]
pub struct CacheDir {
    pub dir: PathBuf,
    /// Bytes the directory may hold; beyond, files go least recently used first.
    pub limit: u64,
}

impl CacheDir {
    pub fn new(dir: PathBuf, limit: u64) -> Self {
        Self { dir, limit }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The file `name` if it is there, its mtime renewed (so it is used recently).
    pub fn open(&self, name: &str) -> Option<File> {
        let f = File::options().read(true).append(true).open(self.path(name)).ok()?;
        let _ = f.set_modified(SystemTime::now());
        Some(f)
    }

    /// Writes `parts` as the file `name`: whole, then renamed into place. Returns how many
    /// older files were deleted to stay within the bound.
    pub fn write(&self, name: &str, parts: &[&[u8]]) -> std::io::Result<u64> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.path(name);
        let tmp = self.dir.join(format!(".{name}.{}.tmp", std::process::id()));
        let written = File::create(&tmp)
            .and_then(|mut f| parts.iter().try_for_each(|p| f.write_all(p)))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(self.trim(&path))
    }

    /// Deletes a file found bad, so that it is made again.
    pub fn remove(&self, name: &str) {
        let _ = std::fs::remove_file(self.path(name));
    }

    /// Deletes the least recently used files beyond the bound, never `keep`; returns how many.
    fn trim(&self, keep: &Path) -> u64 {
        let Ok(dir) = std::fs::read_dir(&self.dir) else { return 0 };
        let mut files: Vec<(SystemTime, u64, PathBuf)> = dir
            .flatten()
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                m.is_file()
                    .then(|| (m.modified().unwrap_or(SystemTime::UNIX_EPOCH), m.len(), e.path()))
            })
            .collect();
        let mut total: u64 = files.iter().map(|f| f.1).sum();
        files.sort();
        let mut deleted = 0;
        for (_, len, p) in files {
            if total <= self.limit {
                break;
            }
            if p != keep && std::fs::remove_file(&p).is_ok() {
                total -= len;
                deleted += 1;
            }
        }
        deleted
    }
}

#[cfg(test)]
mod tests {
    use super::CacheDir;

    #[test]
    fn least_recently_used_files_go_beyond_the_bound() {
        let dir = std::env::temp_dir().join(format!("rsprof-cachedir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let c = CacheDir::new(dir.clone(), 250);
        assert_eq!(c.write("a", &[&[1; 100]]).unwrap(), 0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(c.write("b", &[&[2; 50], &[2; 50]]).unwrap(), 0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        // Reading "a" makes it the most recent: "b" goes when "c" needs the room.
        assert!(c.open("a").is_some());
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(c.write("c", &[&[3; 100]]).unwrap(), 1);
        assert!(c.open("b").is_none() && c.open("a").is_some() && c.open("c").is_some());
        assert_eq!(std::fs::read(c.path("c")).unwrap(), vec![3; 100]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
