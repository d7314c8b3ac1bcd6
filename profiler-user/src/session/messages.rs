//! Everything rsprof-bpf says on stderr while recording goes through here, which owns the
//! quiet policy: `-q` silences information and the summary, never warnings or an explanation
//! of an empty result; the live status line is drawn only when stderr is a terminal.

use std::io::IsTerminal as _;

#[derive(Clone, Copy, Debug)]
pub struct Messages {
    quiet: bool,
    status_line: bool,
}

impl Messages {
    pub fn new(quiet: bool) -> Self {
        Self { quiet, status_line: !quiet && std::io::stderr().is_terminal() }
    }

    pub fn is_quiet(&self) -> bool {
        self.quiet
    }

    /// Whether [`Messages::status`] draws anything.
    pub fn has_status_line(&self) -> bool {
        self.status_line
    }

    /// `rsprof-bpf: TEXT`, unless quiet.
    pub fn info(&self, text: impl std::fmt::Display) {
        if !self.quiet {
            self.clear_status();
            eprintln!("rsprof-bpf: {text}");
        }
    }

    /// `rsprof-bpf: TEXT`, even when quiet: what the user must not miss.
    pub fn notice(&self, text: impl std::fmt::Display) {
        self.clear_status();
        eprintln!("rsprof-bpf: {text}");
    }

    pub fn warn(&self, text: impl std::fmt::Display) {
        self.clear_status();
        eprintln!("rsprof-bpf: warning: {text}");
    }

    /// Preformatted lines (the summary), unless quiet.
    pub fn block(&self, text: &str) {
        if !self.quiet {
            eprint!("{text}");
        }
    }

    /// Preformatted lines, even when quiet.
    pub fn block_always(&self, text: &str) {
        eprint!("{text}");
    }

    /// Redraws the one-line live status.
    pub fn status(&self, line: impl std::fmt::Display) {
        if self.status_line {
            eprint!("\r\x1b[2K[rsprof-bpf] {line}");
        }
    }

    pub fn clear_status(&self) {
        if self.status_line {
            eprint!("\r\x1b[2K");
        }
    }
}
