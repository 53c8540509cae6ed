//! Benchmarks (in progress).
fn main() {}
