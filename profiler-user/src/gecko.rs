//! Gecko writer: see helper task.
