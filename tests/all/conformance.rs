//! One conformance suite, written once and run against every allocator: alignment sweep,
//! zero size, huge requests, distinct live blocks, random allocate/free/grow/shrink with
//! contents checked, and use from several threads.

use core::ptr::NonNull;

use allocator_api2::alloc::{Allocator, Layout};

/// A small deterministic RNG (xorshift64*), so failures reproduce.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// How hard to push an allocator (slow uncached CUDA allocators get fewer operations).
#[derive(Clone, Copy)]
pub struct Options {
    pub max_align: usize,
    pub random_ops: usize,
    pub max_size: usize,
    /// Whether a 1 PiB request must fail. True for every allocator of the crate; false
    /// for `Global`, which on a machine with unlimited overcommit hands out 1 PiB of
    /// address space (seen on the GPU machine).
    pub huge_must_fail: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            max_align: 1 << 20,
            random_ops: 3000,
            max_size: 64 << 10,
            huge_must_fail: true,
        }
    }
}

fn fill(p: NonNull<[u8]>, len: usize, tag: u8) {
    let base = p.cast::<u8>().as_ptr();
    for i in 0..len {
        // SAFETY: the block has at least `len` bytes.
        unsafe { base.add(i).write(tag.wrapping_add(i as u8).wrapping_mul(31)) };
    }
}

fn check(p: NonNull<u8>, len: usize, tag: u8, what: &str) {
    for i in 0..len {
        // SAFETY: the block has at least `len` bytes.
        let got = unsafe { p.as_ptr().add(i).read() };
        assert_eq!(
            got,
            tag.wrapping_add(i as u8).wrapping_mul(31),
            "{what}: byte {i} of {len} corrupted"
        );
    }
}

fn assert_fits(p: NonNull<[u8]>, layout: Layout, what: &str) {
    assert!(
        p.len() >= layout.size(),
        "{what}: block of {} bytes for {layout:?}",
        p.len()
    );
    assert_eq!(
        p.cast::<u8>().as_ptr() as usize % layout.align(),
        0,
        "{what}: misaligned for {layout:?}"
    );
}

/// Every power-of-two alignment up to `max_align`, with several sizes each.
pub fn alignment_sweep<A: Allocator>(a: &A, opts: Options) {
    let mut align = 1;
    while align <= opts.max_align {
        for size in [1, 7, align, align + 1, 3 * align / 2 + 5] {
            let size = size.min(opts.max_size.max(align + 1));
            let layout = Layout::from_size_align(size, align).unwrap();
            let p = a
                .allocate(layout)
                .unwrap_or_else(|_| panic!("allocate {layout:?}"));
            assert_fits(p, layout, "alignment sweep");
            fill(p, size, align as u8);
            check(p.cast(), size, align as u8, "alignment sweep");
            // SAFETY: allocated above with `layout`.
            unsafe { a.deallocate(p.cast(), layout) };
        }
        align *= 2;
    }
}

/// Zero-size requests succeed with an aligned pointer and free without effect.
pub fn zero_size<A: Allocator>(a: &A) {
    for align in [1, 8, 64, 4096, 1 << 20] {
        let layout = Layout::from_size_align(0, align).unwrap();
        let p = a.allocate(layout).expect("zero-size allocation");
        assert_eq!(p.cast::<u8>().as_ptr() as usize % align, 0);
        // SAFETY: allocated above with `layout`.
        unsafe { a.deallocate(p.cast(), layout) };
    }
}

/// A 1 PiB request, and the largest layout there is, fail with AllocError (no panic, no
/// abort), and the allocator still works afterwards.
pub fn huge_requests<A: Allocator>(a: &A, opts: Options) {
    let pib = Layout::from_size_align(1 << 50, 8).unwrap();
    match a.allocate(pib) {
        Err(_) => {}
        Ok(p) if !opts.huge_must_fail => {
            // SAFETY: just allocated with `pib`, never touched.
            unsafe { a.deallocate(p.cast(), pib) }
        }
        Ok(_) => panic!("a 1 PiB request must fail"),
    }
    let max = Layout::from_size_align(isize::MAX as usize - 4095, 4096).unwrap();
    match a.allocate(max) {
        Err(_) => {}
        Ok(p) if !opts.huge_must_fail => {
            // SAFETY: just allocated with `max`, never touched.
            unsafe { a.deallocate(p.cast(), max) }
        }
        Ok(_) => panic!("an isize::MAX request must fail"),
    }
    let small = Layout::from_size_align(64, 8).unwrap();
    let p = a.allocate(small).expect("allocator still usable after failures");
    // SAFETY: allocated above.
    unsafe { a.deallocate(p.cast(), small) };
}

struct Live {
    ptr: NonNull<u8>,
    layout: Layout,
    tag: u8,
}

fn assert_disjoint(live: &[Live], what: &str) {
    let mut ranges: Vec<(usize, usize)> = live
        .iter()
        .filter(|b| b.layout.size() > 0)
        .map(|b| (b.ptr.as_ptr() as usize, b.ptr.as_ptr() as usize + b.layout.size()))
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        assert!(
            w[0].1 <= w[1].0,
            "{what}: live blocks overlap: {:x?} and {:x?}",
            w[0],
            w[1]
        );
    }
}

/// Random allocate / free / grow / shrink with every live block's contents checked.
pub fn random_ops<A: Allocator>(a: &A, seed: u64, opts: Options) {
    let mut rng = Rng::new(seed);
    let mut live: Vec<Live> = Vec::new();
    for step in 0..opts.random_ops {
        let what = format!("random op {step} (seed {seed})");
        match rng.below(10) {
            0..=3 => {
                let size = if rng.below(8) == 0 {
                    rng.below(opts.max_size)
                } else {
                    rng.below(512)
                };
                let align = 1 << rng.below(8);
                let layout = Layout::from_size_align(size, align).unwrap();
                let p = a
                    .allocate(layout)
                    .unwrap_or_else(|_| panic!("{what}: allocate {layout:?}"));
                assert_fits(p, layout, &what);
                let tag = rng.next() as u8;
                fill(p, size, tag);
                live.push(Live {
                    ptr: p.cast(),
                    layout,
                    tag,
                });
            }
            4..=5 if !live.is_empty() => {
                let b = live.swap_remove(rng.below(live.len()));
                check(b.ptr, b.layout.size(), b.tag, &what);
                // SAFETY: allocated by `a` with `b.layout`, freed once.
                unsafe { a.deallocate(b.ptr, b.layout) };
            }
            6..=7 if !live.is_empty() => {
                let i = rng.below(live.len());
                let b = &mut live[i];
                let step = if rng.below(4) == 0 { opts.max_size } else { 256 };
                let new_size = (b.layout.size() + 1 + rng.below(step))
                    .min(4 * opts.max_size)
                    .max(b.layout.size());
                let new = Layout::from_size_align(new_size, b.layout.align()).unwrap();
                // SAFETY: b is live, allocated by `a` with b.layout; new is not smaller.
                let p = unsafe { a.grow(b.ptr, b.layout, new) }.unwrap_or_else(|_| panic!("{what}: grow"));
                assert_fits(p, new, &what);
                check(p.cast(), b.layout.size(), b.tag, &what);
                fill(p, new_size, b.tag);
                b.ptr = p.cast();
                b.layout = new;
            }
            8 if !live.is_empty() => {
                let i = rng.below(live.len());
                let b = &mut live[i];
                let new_size = rng.below(b.layout.size() + 1);
                let new = Layout::from_size_align(new_size, b.layout.align()).unwrap();
                // SAFETY: b is live; new is not larger.
                let p =
                    unsafe { a.shrink(b.ptr, b.layout, new) }.unwrap_or_else(|_| panic!("{what}: shrink"));
                assert_fits(p, new, &what);
                check(p.cast(), new_size, b.tag, &what);
                b.ptr = p.cast();
                b.layout = new;
            }
            _ => {
                // SAFETY-free check step: every live block intact and disjoint.
                for b in &live {
                    check(b.ptr, b.layout.size(), b.tag, &what);
                }
                assert_disjoint(&live, &what);
            }
        }
    }
    assert_disjoint(&live, "end of random ops");
    for b in live {
        check(b.ptr, b.layout.size(), b.tag, "final check");
        // SAFETY: allocated by `a` with b.layout, freed once.
        unsafe { a.deallocate(b.ptr, b.layout) };
    }
}

/// Many live blocks at once are distinct and do not overlap.
pub fn distinct_blocks<A: Allocator>(a: &A) {
    let mut live = Vec::new();
    for i in 0..300usize {
        let layout = Layout::from_size_align(1 + (i * 37) % 3000, 1 << (i % 7)).unwrap();
        let p = a.allocate(layout).expect("allocate");
        fill(p, layout.size(), i as u8);
        live.push(Live {
            ptr: p.cast(),
            layout,
            tag: i as u8,
        });
    }
    assert_disjoint(&live, "distinct blocks");
    for b in live {
        check(b.ptr, b.layout.size(), b.tag, "distinct blocks");
        // SAFETY: allocated above.
        unsafe { a.deallocate(b.ptr, b.layout) };
    }
}

/// The whole single-threaded suite.
pub fn suite<A: Allocator>(a: &A, opts: Options) {
    zero_size(a);
    alignment_sweep(a, opts);
    huge_requests(a, opts);
    distinct_blocks(a);
    random_ops(a, 0x5eed, opts);
}

/// The suite from several threads at once; blocks are also freed by threads other than
/// the one that allocated them.
pub fn threads<A: Allocator + Sync>(a: &A, threads: usize, opts: Options) {
    struct SendBlock(NonNull<u8>, Layout, u8);
    // SAFETY: the block is exclusively owned by whoever holds the SendBlock.
    unsafe impl Send for SendBlock {}
    let (tx, rx) = std::sync::mpsc::channel::<SendBlock>();
    std::thread::scope(|s| {
        for t in 0..threads {
            let tx = tx.clone();
            s.spawn(move || {
                random_ops(a, 1000 + t as u64, opts);
                for i in 0..50usize {
                    let layout = Layout::from_size_align(8 + i * 13, 8).unwrap();
                    let p = a.allocate(layout).expect("allocate for hand-off");
                    fill(p, layout.size(), (t * 50 + i) as u8);
                    tx.send(SendBlock(p.cast(), layout, (t * 50 + i) as u8)).unwrap();
                }
            });
        }
        drop(tx);
        s.spawn(move || {
            for SendBlock(p, layout, tag) in rx {
                check(p, layout.size(), tag, "cross-thread free");
                // SAFETY: allocated by `a` with `layout` in another thread, freed once.
                unsafe { a.deallocate(p, layout) };
            }
        });
    });
}
