//! Counting<System> as the global allocator (in progress).
fn main() {}
