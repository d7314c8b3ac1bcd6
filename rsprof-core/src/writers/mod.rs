//! Profile writers: each turns a recording (its events plus a [`ProfileContext`]) into one
//! output. `gecko` is the only code that produces Gecko (Firefox Profiler) JSON, `pprof` the
//! only one producing pprof protobuf, `collapsed` folded stack lines; `stats` tallies what the
//! profile holds for the session's summary. [`Format`] picks the file writer.
//!
//! Export reads storage once and hands every event to each writer through [`EventSink`]
//! (each thread's events in time order), then asks the file writers to write.

pub(crate) mod collapsed;
pub(crate) mod gecko;
pub mod pprof;
pub mod stats;
// Fixtures for the writers' tests and the agent's (in the binary crate, through the feature).
#[cfg(any(test, feature = "testdata"))]
pub mod testdata;

use std::{
    fmt,
    io::{self, Write},
    path::Path,
};

use crate::model::{
    Sample,
    ids::ThreadKey,
    markers::{Marker, MarkerSchema},
    process::ProcessesMeta,
    recording::{RecordingInfo, Recycled},
    stacks::SymbolizedStacks,
};

/// Everything about a recording that is not an event.
pub struct ProfileContext<'a> {
    pub info: &'a RecordingInfo,
    pub stacks: &'a SymbolizedStacks,
    pub processes: &'a ProcessesMeta,
    pub marker_schemas: &'a [MarkerSchema],
    /// The oldest data dropped to stay within the buffer size.
    pub recycled: Recycled,
    pub buffer_bytes: usize,
    /// The session's full text report, for the profile to carry. Set after the events are
    /// tallied and before the file writer writes: the report describes what the profile holds.
    pub report: std::cell::OnceCell<String>,
}

/// Receives a recording's events.
pub trait EventSink {
    fn sample(&mut self, thread: ThreadKey, sample: &Sample);
    /// Several samples of one thread, in order.
    fn samples(&mut self, thread: ThreadKey, samples: &[Sample]) {
        for s in samples {
            self.sample(thread, s);
        }
    }
    fn marker(&mut self, thread: ThreadKey, marker: &Marker);
}

/// A file format.
pub trait ProfileWriter: EventSink {
    /// Whether what was received can be written as a profile that its readers accept.
    fn is_empty(&self) -> bool;
    /// Writes the profile; `corrupt` lists storage that could not be read (skipped).
    fn write(self: Box<Self>, corrupt: &[String], out: &mut dyn Write) -> io::Result<()>;
}

/// An output file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// Firefox Profiler (Gecko) JSON.
    Gecko,
    /// pprof's protobuf `Profile`.
    Pprof,
    /// Folded stacks, one `frame;frame;... count` line per stack (flamegraph.pl, inferno).
    Collapsed,
}

/// Name endings that imply a format (each also with `.gz`), most specific first.
const SUFFIXES: &[(&str, Format)] = &[
    (".json", Format::Gecko),
    (".pb", Format::Pprof),
    (".pprof", Format::Pprof),
    (".folded", Format::Collapsed),
    (".collapsed", Format::Collapsed),
];

impl Format {
    pub const ALL: [Format; 3] = [Format::Gecko, Format::Pprof, Format::Collapsed];

    pub fn name(self) -> &'static str {
        match self {
            Format::Gecko => "gecko",
            Format::Pprof => "pprof",
            Format::Collapsed => "collapsed",
        }
    }

    /// The name ending this format is written with when the program picks the name.
    pub fn extension(self) -> &'static str {
        SUFFIXES.iter().find(|(_, f)| *f == self).map_or("", |(ext, _)| ext)
    }

    pub fn from_name(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == s)
    }

    /// The format a file name implies, and the name's format suffix (e.g. `.pb.gz`); None for
    /// a name without a known suffix.
    pub fn from_path(path: &Path) -> Option<(Self, String)> {
        let name = path.file_name()?.to_string_lossy();
        let bare = name.strip_suffix(".gz").unwrap_or(&name);
        SUFFIXES.iter().find_map(|&(ext, f)| {
            let stem = bare.strip_suffix(ext).filter(|s| !s.is_empty())?;
            Some((f, name[stem.len()..].to_owned()))
        })
    }

    /// A writer of this format.
    pub fn writer<'a>(self, ctx: &'a ProfileContext<'a>) -> Box<dyn ProfileWriter + 'a> {
        match self {
            Format::Gecko => Box::new(gecko::GeckoWriter::new(ctx)),
            Format::Pprof => Box::new(pprof::PprofWriter::new(ctx)),
            Format::Collapsed => Box::new(collapsed::CollapsedWriter::new(ctx)),
        }
    }

    /// How to look at a file of this format, for the summary.
    pub fn viewer_hint(self) -> &'static str {
        match self {
            Format::Gecko => {
                "open it at https://profiler.firefox.com (\"Load a profile from file\") or with \
                 `samply load FILE`"
            }
            Format::Pprof => "view it with `pprof -http=: FILE` or `go tool pprof FILE`",
            Format::Collapsed => "draw it with `flamegraph.pl FILE` or `inferno-flamegraph FILE`",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_from_names() {
        let f = |p: &str| Format::from_path(Path::new(p));
        assert_eq!(f("a/p.json.gz"), Some((Format::Gecko, ".json.gz".into())));
        assert_eq!(f("p.pb.gz"), Some((Format::Pprof, ".pb.gz".into())));
        assert_eq!(f("p.pb"), Some((Format::Pprof, ".pb".into())));
        assert_eq!(f("cpu.pprof"), Some((Format::Pprof, ".pprof".into())));
        assert_eq!(f("p.folded"), Some((Format::Collapsed, ".folded".into())));
        assert_eq!(f("p.collapsed.gz"), Some((Format::Collapsed, ".collapsed.gz".into())));
        for none in ["out", "p.gz", ".pb", "p.txt", "p.pb.zst"] {
            assert_eq!(f(none), None, "{none}");
        }
        for format in Format::ALL {
            assert_eq!(Format::from_name(format.name()), Some(format));
        }
    }
}
