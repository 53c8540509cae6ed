//! The `debug-checks` feature: a pool remembers its live blocks and panics with a clear
//! message on a double free (small or large) and on a block freed to a pool that does not
//! own it, instead of handing a block out twice or adopting foreign memory.
//!
//! Run with `cargo test --features debug-checks --test all debug_checks`.

use allocator_api2::alloc::{Allocator, Layout};
use cudalloc::pool::{Pool, PoolConfig};
use cudalloc::source::HostSource;

fn freed_twice(config: PoolConfig, l: Layout) {
    let pool = Pool::with_config(HostSource, config);
    let b = pool.allocate(l).unwrap();
    // SAFETY: allocated above with `l`.
    unsafe { pool.deallocate(b.cast(), l) };
    // SAFETY: none: the second free is the misuse debug-checks must catch before it does
    // any harm (it panics before touching the pool's lists).
    unsafe { pool.deallocate(b.cast(), l) };
}

#[test]
#[should_panic(expected = "cudalloc debug-checks: double free of block")]
fn a_small_block_freed_twice_panics() {
    freed_twice(PoolConfig::default(), Layout::from_size_align(64, 8).unwrap());
}

#[test]
#[should_panic(expected = "cudalloc debug-checks: double free of block")]
fn a_small_block_freed_twice_without_thread_caches_panics() {
    freed_twice(
        PoolConfig::default().with_thread_cache_capacity(0),
        Layout::from_size_align(3000, 64).unwrap(),
    );
}

#[test]
#[should_panic(expected = "cudalloc debug-checks: double free of block")]
fn a_large_block_freed_twice_panics() {
    freed_twice(
        PoolConfig::default(),
        Layout::from_size_align(3 << 20, 4096).unwrap(),
    );
}

#[test]
#[should_panic(expected = "cudalloc debug-checks: double free of block")]
fn a_large_block_freed_twice_without_thread_caches_panics() {
    freed_twice(
        PoolConfig::default().with_thread_cache_capacity(0),
        Layout::from_size_align(700 << 10, 8).unwrap(),
    );
}

#[test]
#[should_panic(expected = "freed to a pool that does not own it")]
fn a_block_of_pool_a_freed_to_pool_b_panics() {
    let a = Pool::new(HostSource);
    let b = Pool::new(HostSource);
    let l = Layout::from_size_align(64, 8).unwrap();
    let p = a.allocate(l).unwrap();
    // Pool B must be holding memory too: a block of A is not "no block of B" by accident.
    let _held_by_b = b.allocate(l).unwrap();
    // SAFETY: none: freeing A's block to B is the misuse debug-checks must catch.
    unsafe { b.deallocate(p.cast(), l) };
}

#[test]
#[should_panic(expected = "freed to a pool that does not own it")]
fn a_large_block_of_pool_a_freed_to_pool_b_panics() {
    let a = Pool::new(HostSource);
    let b = Pool::new(HostSource);
    let l = Layout::from_size_align(2 << 20, 8).unwrap();
    let p = a.allocate(l).unwrap();
    // SAFETY: none: the misuse under test.
    unsafe { b.deallocate(p.cast(), l) };
}

#[test]
#[should_panic(expected = "freed to a pool that does not own it")]
fn memory_from_elsewhere_freed_to_a_pool_panics() {
    let pool = Pool::new(HostSource);
    let l = Layout::from_size_align(64, 8).unwrap();
    let foreign = allocator_api2::alloc::Global.allocate(l).unwrap();
    // SAFETY: none: the misuse under test.
    unsafe { pool.deallocate(foreign.cast(), l) };
}

/// Correct use never trips the checks: the pool's own paths (thread caches, shared
/// lists, in-place growth, moves, pending blocks) keep the set of live blocks exact.
#[test]
fn correct_use_never_trips_the_checks() {
    let pool = Pool::new(HostSource);
    let mut v: allocator_api2::vec::Vec<u64, _> = allocator_api2::vec::Vec::new_in(&pool);
    for i in 0..1_000_000u64 {
        v.push(i);
    }
    v.truncate(10);
    v.shrink_to_fit();
    let boxes: Vec<_> = (0..1000)
        .map(|i| allocator_api2::boxed::Box::new_in(i, &pool))
        .collect();
    drop(boxes);
    drop(v);
    pool.trim();
    assert_eq!(pool.stats().source_bytes, 0);
}
