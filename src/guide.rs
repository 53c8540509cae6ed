//! Guides: which allocator fits which job, what the crate promises, and what its errors
//! mean. Each is a page of its own (the text lives in `docs/` in the repository).

#[doc = include_str!("../docs/choosing.md")]
pub mod choosing {}

#[doc = include_str!("../docs/troubleshooting.md")]
pub mod troubleshooting {}

#[doc = include_str!("../docs/guarantees.md")]
pub mod guarantees {}

#[doc = include_str!("../docs/traces.md")]
pub mod traces {}

#[doc = include_str!("../docs/staging.md")]
pub mod staging {}
