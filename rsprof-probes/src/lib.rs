//! Instrument a Rust program for rsprof-bpf: markers, intervals, counters and thread labels,
//! emitted as USDT probes of the `rsprof` provider (ABI in `docs/usdt-abi.md`).
//!
//! Every probe has a semaphore: while no profiler listens, a probe costs a load and a branch
//! and its arguments (including `marker!` formatting) are not evaluated.
//!
//! ```no_run
//! use rsprof_probes::{interval, label, marker};
//! let _l = label!("parse"); // samples of this thread carry "parse" until `_l` drops
//! marker!("cache", "miss on key {}", 42);
//! {
//!     let _i = interval!("request", 7); // an interval from here to the end of the scope
//! }
//! ```
//!
//! Strings are passed as C strings (`&CStr`); the macros make them from literals at compile
//! time. Labels are identified by their address, so they must be `'static`.

use std::ffi::{CStr, CString};

use probe::probe_lazy;

/// Starts the `.probes` section (the `probe` crate's semaphores) on a page of its own. The
/// kernel finds a semaphore by file offset, and lld gives the RELRO segment and the data
/// segment one shared file page: a semaphore on that page is incremented in the RELRO
/// mapping when the program is exec'd while probes are attached, and the probe never fires.
#[repr(C, align(4096))]
struct PageAligned(u8);

#[unsafe(link_section = ".probes")]
#[used]
static PROBES_PAGE: PageAligned = PageAligned(0);

/// A C string literal, checked at compile time.
#[doc(hidden)]
#[macro_export]
macro_rules! __cstr {
    ($l:literal) => {
        const {
            match ::core::ffi::CStr::from_bytes_with_nul(concat!($l, "\0").as_bytes()) {
                Ok(c) => c,
                Err(_) => panic!("string literal contains a NUL byte"),
            }
        }
    };
}

/// `marker!("name", "format {}", args…)`: an instant marker with formatted text.
#[macro_export]
macro_rules! marker {
    ($name:literal, $($fmt:tt)+) => {
        $crate::marker_fmt($crate::__cstr!($name), format_args!($($fmt)+))
    };
}

/// `let _g = label!("name");`: labels this thread's samples until the guard drops.
#[macro_export]
macro_rules! label {
    ($label:literal) => {
        $crate::label($crate::__cstr!($label))
    };
}

/// `let _g = interval!("name", id);`: an interval from here until the guard drops.
#[macro_export]
macro_rules! interval {
    ($name:literal, $id:expr) => {
        $crate::interval($crate::__cstr!($name), $id)
    };
}

/// `counter!("name", value)`.
#[macro_export]
macro_rules! counter {
    ($name:literal, $value:expr) => {
        $crate::counter($crate::__cstr!($name), $value)
    };
}

fn to_cstring(args: std::fmt::Arguments) -> CString {
    let text = match args.as_str() {
        Some(s) => s.to_owned(),
        None => args.to_string(),
    };
    // An interior NUL would end the text early; show it instead.
    CString::new(text.replace('\0', "\u{2400}")).expect("NULs replaced")
}

/// An instant marker. Returns whether a profiler was listening.
#[inline]
pub fn marker(name: &CStr, text: &CStr) -> bool {
    probe_lazy!(rsprof, marker, name.as_ptr(), text.as_ptr())
}

/// An instant marker whose text is formatted only when a profiler listens.
#[inline]
pub fn marker_fmt(name: &CStr, text: std::fmt::Arguments) -> bool {
    let mut owned: Option<CString> = None;
    probe_lazy!(rsprof, marker, name.as_ptr(), owned.insert(to_cstring(text)).as_ptr())
}

/// A counter value.
#[inline]
pub fn counter(name: &CStr, value: i64) -> bool {
    probe_lazy!(rsprof, counter, name.as_ptr(), value)
}

/// Opens interval `id` (pair with [`end`]); prefer [`interval`].
#[inline]
pub fn begin(name: &CStr, id: u64) -> bool {
    probe_lazy!(rsprof, begin, name.as_ptr(), id)
}

/// Closes interval `id`.
#[inline]
pub fn end(id: u64) -> bool {
    probe_lazy!(rsprof, end, id)
}

/// Pushes a label on this thread's label stack; prefer [`label`].
///
/// Always inlined, as is [`label`]: the profiler places the label under the frame the probe
/// fires in, which must be the caller's.
#[inline(always)]
pub fn label_push(label: &'static CStr) -> bool {
    probe_lazy!(rsprof, label_push, label.as_ptr())
}

/// Pops this thread's innermost label.
#[inline]
pub fn label_pop() -> bool {
    probe_lazy!(rsprof, label_pop)
}

/// Ends its interval when dropped, if the begin was seen by a profiler.
#[must_use = "the interval ends when this guard drops"]
pub struct IntervalGuard {
    id: u64,
    begun: bool,
}

impl Drop for IntervalGuard {
    fn drop(&mut self) {
        if self.begun {
            end(self.id);
        }
    }
}

pub fn interval(name: &CStr, id: u64) -> IntervalGuard {
    IntervalGuard { id, begun: begin(name, id) }
}

/// Pops its label when dropped, if the push was seen by a profiler (so a profiler attaching
/// in between sees no unmatched pop).
#[must_use = "the label is popped when this guard drops"]
pub struct LabelGuard {
    pushed: bool,
}

impl Drop for LabelGuard {
    fn drop(&mut self) {
        if self.pushed {
            label_pop();
        }
    }
}

#[inline(always)]
pub fn label(label: &'static CStr) -> LabelGuard {
    LabelGuard { pushed: label_push(label) }
}

#[cfg(test)]
mod tests {
    #[test]
    fn probes_are_cheap_noops_without_a_profiler() {
        // No profiler attached in unit tests: every probe reports "not listening".
        assert!(!marker!("m", "x {}", 1));
        let g = label!("l");
        assert!(!g.pushed);
        let i = interval!("i", 3);
        assert!(!i.begun);
        assert!(!counter!("c", -5));
    }
}
