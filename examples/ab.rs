//! A/B report (in progress).
fn main() {}
