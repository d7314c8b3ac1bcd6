//! The profile's categories (`meta.categories`): their indices, names and colours, and which
//! one a frame gets.

use serde_json::{Value, json};

use crate::model::stacks::{FrameKind, JitLanguage};

/// Indices into `meta.categories`. "Other" must be the first grey category: the front-end uses
/// it for stacks whose frames have no category.
pub const CATEGORY_OTHER: u32 = 0;
/// The front-end finds the idle category by its name "Idle"; samples whose leaf frame has it
/// are hidden by "include idle samples" being off and count as inactive.
pub const CATEGORY_IDLE: u32 = 1;
pub const CATEGORY_USER: u32 = 2;
pub const CATEGORY_KERNEL: u32 = 3;
pub const CATEGORY_LABEL: u32 = 4;
/// Markers from USDT probes: their own colour in the Marker Chart, apart from everything else.
pub const CATEGORY_USDT: u32 = 5;
/// Off-CPU time: every frame of an off-CPU sample, and the long-block markers.
pub const CATEGORY_OFF_CPU: u32 = 6;
/// The root pseudo-frame of a user stack that is not complete (see `FrameKind::Truncated`).
pub const CATEGORY_TRUNCATED: u32 = 7;
/// JIT frames named from perf maps, one category per language. JavaScript has the
/// front-end's own colour for it (yellow, as its Firefox categories); the front-end has none
/// for the others, so they take colours no other category here uses.
pub const CATEGORY_JAVASCRIPT: u32 = 8;
pub const CATEGORY_JAVA: u32 = 9;
pub const CATEGORY_PYTHON: u32 = 10;
pub const CATEGORY_JIT_OTHER: u32 = 11;

const CATEGORIES: [(&str, &str); 12] = [
    ("Other", "grey"),
    ("Idle", "transparent"),
    ("User", "yellow"),
    ("Kernel", "orange"),
    ("Label", "lightblue"),
    ("USDT", "magenta"),
    ("Off-CPU", "purple"),
    ("Truncated stack", "red"),
    ("JavaScript", "yellow"),
    ("Java", "green"),
    ("Python", "blue"),
    ("JIT", "brown"),
];

pub(super) fn categories() -> Value {
    CATEGORIES
        .iter()
        .map(|(name, color)| json!({"name": name, "color": color, "subcategories": ["Other"]}))
        .collect()
}

/// The category of a frame of `kind`.
pub(super) fn of_frame(kind: FrameKind) -> u32 {
    match kind {
        FrameKind::User => CATEGORY_USER,
        FrameKind::Kernel => CATEGORY_KERNEL,
        FrameKind::Label => CATEGORY_LABEL,
        FrameKind::Truncated => CATEGORY_TRUNCATED,
        FrameKind::Jit(JitLanguage::JavaScript) => CATEGORY_JAVASCRIPT,
        FrameKind::Jit(JitLanguage::Java) => CATEGORY_JAVA,
        FrameKind::Jit(JitLanguage::Python) => CATEGORY_PYTHON,
        FrameKind::Jit(JitLanguage::Other) => CATEGORY_JIT_OTHER,
    }
}
