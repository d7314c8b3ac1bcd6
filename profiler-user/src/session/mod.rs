//! A running recording: the event loop, signals, snapshots and stderr output.
