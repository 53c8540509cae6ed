//! Caching pool (in progress).
