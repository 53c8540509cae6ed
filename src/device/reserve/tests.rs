use super::growing::Growing;
use super::*;
use crate::sync::global::AtomicBool;
use std::thread;

/// The recorder's tag of the tests' allocations (no recording runs in them).
static TAG: Tag = Tag::new(String::new);

const MIB: usize = 1 << 20;

fn steps(step: usize) -> Growing<'static> {
    Growing::new(step, None, false)
}

#[test]
fn the_page_heap_and_the_driver_pool_share_one_limit() {
    let r = Reservations::new(Some(64 * MIB));
    let pool = steps(2 * MIB);
    r.take(20 * MIB).unwrap();
    assert!(r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok());
    assert_eq!(
        r.held(),
        22 * MIB,
        "the driver pool's growth is charged, the room given back"
    );
    assert!(
        r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok(),
        "idle driver memory needs no room"
    );
    assert_eq!(r.held(), 22 * MIB);
    r.take(40 * MIB).unwrap();
    // 2 MiB of room are left; a growth may take 4 + 30 MiB.
    assert!(matches!(
        r.pool_alloc(4 * MIB, &pool, &PoolReservation::new(), &TAG, 0),
        Err(Error::LimitExceeded { .. })
    ));
    assert_eq!(
        pool.usage().unwrap(),
        (2 * MIB, 2 * MIB),
        "the driver was not asked"
    );
    assert!(
        r.take(4 * MIB).is_err(),
        "the page heap sees the driver pool's part"
    );
    r.give(40 * MIB);
    assert!(r.take(44 * MIB).is_err());
    assert!(r.take(42 * MIB).is_ok());
    assert_eq!(r.peak(), 64 * MIB);
}

#[test]
fn a_growth_past_the_limit_is_given_back_and_shows_in_the_peak() {
    // The driver grows by 48 MiB where 32 MiB of room were taken.
    let r = Reservations::new(Some(64 * MIB));
    let pool = steps(48 * MIB);
    r.take(20 * MIB).unwrap();
    assert!(matches!(
        r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0),
        Err(Error::LimitExceeded { .. })
    ));
    assert_eq!(
        pool.usage().unwrap(),
        (0, 0),
        "the block and the growth went back"
    );
    assert_eq!(r.held(), 20 * MIB);
    assert_eq!(r.peak(), 68 * MIB, "the breach is counted");
    // Learned: the next allocation asks for 48 MiB of room first, and fails cleanly.
    assert!(r
        .pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0)
        .is_err());
    assert_eq!(pool.usage().unwrap(), (0, 0));
    r.give(20 * MIB);
    assert!(r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok());
    assert_eq!(r.held(), 48 * MIB);
}

#[test]
fn the_room_is_capped_by_what_the_driver_pool_may_still_grow_by() {
    // Under a 16 MiB limit the driver pool (its maximum size is the limit) grows by at
    // most 16 MiB: the room asked for is no more.
    let r = Reservations::new(Some(16 * MIB));
    let pool = steps(16 * MIB);
    assert!(r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok());
    assert_eq!(r.held(), 16 * MIB);
}

#[test]
fn without_a_limit_the_driver_pool_is_not_read() {
    let r = Reservations::new(None);
    let pool = steps(32 * MIB);
    assert!(r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0).is_ok());
    assert_eq!(r.held(), 0);
    r.take(8 * MIB).unwrap();
    assert_eq!((r.held(), r.peak()), (8 * MIB, 8 * MIB));
}

#[test]
fn the_driver_pool_is_asked_without_the_limits_lock() {
    let r = Reservations::new(Some(64 * MIB));
    let pool = Growing::new(16 * MIB, Some(&r), true);
    for _ in 0..20 {
        r.pool_alloc(MIB, &pool, &PoolReservation::new(), &TAG, 0)
            .unwrap();
    }
    assert_eq!(r.held(), 32 * MIB);
    pool.free(20 * MIB);
    pool.trim_to(0);
    r.pool_trimmed(|| pool.usage().ok().map(|(r, _)| r));
    assert_eq!(r.held(), 0, "the trim gave the idle steps back");
}

/// Threads allocate and free under a limit at once: at every driver call the
/// reservations cover what the driver pool reserves (checked by the pool, with its
/// state locked), no allocation breaches the limit (each growth fits its room), and
/// once all have landed the tally holds exactly the driver pool's reservation.
#[test]
fn threads_under_a_limit_keep_the_driver_pool_covered() {
    let r = Reservations::new(Some(256 * MIB));
    let pool = Growing::new(32 * MIB, Some(&r), false);
    let refused = AtomicBool::new(false);
    let made: usize = thread::scope(|s| {
        let workers: Vec<_> = (0..8)
            .map(|t| {
                let (r, pool, refused) = (&r, &pool, &refused);
                s.spawn(move || {
                    let mut made = 0;
                    for i in 0..300 {
                        let bytes = (1 + (t + i) % 8) * MIB;
                        let got = r.pool_alloc(bytes, pool, &PoolReservation::new(), &TAG, 0);
                        match got {
                            Ok(_) => {
                                made += 1;
                                pool.free(bytes);
                            }
                            Err(Error::LimitExceeded { .. }) => refused.store(true, Ordering::Relaxed),
                            Err(e) => panic!("{e}"),
                        }
                        if i % 37 == t {
                            pool.trim_to(0);
                            r.pool_trimmed(|| pool.usage().ok().map(|(r, _)| r));
                        }
                    }
                    made
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).sum()
    });
    assert!(made > 8 * 150, "{made} of 2400 allocations made");
    assert!(r.peak() <= 256 * MIB, "breached: peak {}", r.peak());
    r.pool_trimmed(|| pool.usage().ok().map(|(r, _)| r));
    assert_eq!(r.held(), lock(&pool.state).reserved, "refused some: {refused:?}");
}

/// The order the loom model reaches only past its preemption bound, played out by
/// hand: A's growth is charged out of its room by a reading taken after it (but
/// ticketed earlier); then a reading ticketed later but taken before the growth says
/// the pool is smaller. The room that reading gives back must stay with A, or the tally
/// no longer covers the driver pool while A is in flight.
#[test]
fn a_reading_from_before_a_growth_in_flight_keeps_its_room() {
    let r = Reservations::new(Some(128 * MIB));
    let read = |bytes| Reading {
        ticket: r.ticket(),
        bytes,
    };
    let a = r.take_off(MIB, read(0)).unwrap();
    assert_eq!(r.held(), 32 * MIB, "A's room: its request and 30 MiB");
    let after_growth = r.ticket();
    let before_growth = read(0);
    // A's allocation grows the driver pool by 32 MiB.
    r.apply(
        &mut lock(&r.pool),
        Reading {
            ticket: after_growth,
            bytes: 32 * MIB,
        },
    );
    r.apply(&mut lock(&r.pool), before_growth);
    assert_eq!(r.held(), 32 * MIB, "A's growth is still covered");
    assert!(r.land(a, After::Read(read(32 * MIB), 0)));
    assert_eq!(r.held(), 32 * MIB, "charged as read after A, no room left");
}
