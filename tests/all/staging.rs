//! The staging ring's argument checks (`cudalloc::staging`); its GPU tests hold streams
//! with gates and live in the gated binary (`tests/gated/staging.rs`).

use cudalloc::cuda::Stream;
use cudalloc::staging::StagingRing;
use cudalloc::{Error, PinnedAlloc};

#[test]
fn a_ring_refuses_empty_shapes() {
    // Checked before any driver call: runs without a GPU too.
    let err = StagingRing::new(PinnedAlloc, &[], 1, 4096).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    if !cudalloc::cuda::driver_available() {
        return;
    }
    let s = Stream::new(0).unwrap();
    for (n, len) in [(0, 4096), (1, 0)] {
        let err = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), n, len).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    }
}

// ----- the pipeline helper (`StagingRing::pipeline`) ---------------------------------

use std::collections::HashSet;
use std::ffi::c_void;
use std::time::Duration;

use allocator_api2::vec::Vec as AVec;
use cudalloc::copy;
use cudalloc::cuda::{Kernel, Module};
use cudalloc::device::DevicePool;

use crate::pipeline::{hash_rounds, input_value, KERNEL, PTX};

const ROUNDS: u32 = 8;

/// What the closures saw, in the order they were called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Fill(usize),
    Launch(usize),
    /// The second half of a split launch (`Pipeline::run_split`).
    Finish(usize),
    Drain(usize),
}

struct Outcome {
    /// Output elements not equal to `hash_rounds(input_value(batch, i), ROUNDS)`.
    wrong: usize,
    elements: usize,
    calls: Vec<Call>,
    streams: HashSet<cudalloc::cuda::StreamId>,
    /// The ring buffer (`Staged::index`) of each batch.
    buffer_of: Vec<usize>,
    batches: usize,
}

impl Outcome {
    fn at(&self, c: Call) -> usize {
        self.calls.iter().position(|&x| x == c).unwrap()
    }

    /// Each batch was launched in its ring buffer only after the buffer's last batch was
    /// drained (state kept per buffer is safe to reuse); returns how many batches were
    /// filled before that drain (the fill overlapping the last batch's work).
    fn assert_buffers_drained_before_launch(&self) -> usize {
        let mut early_fills = 0;
        for (b, &k) in self.buffer_of.iter().enumerate() {
            if let Some(prev) = self.buffer_of[..b].iter().rposition(|&j| j == k) {
                assert!(
                    self.at(Call::Drain(prev)) < self.at(Call::Launch(b)),
                    "buffer {k} launched for batch {b} before batch {prev} was drained"
                );
                early_fills += usize::from(self.at(Call::Fill(b)) < self.at(Call::Drain(prev)));
            }
        }
        early_fills
    }
}

/// Queues `out[i] = hash_rounds(input[i], ROUNDS)` on `stream`.
///
/// # Safety
/// `input` and `output` hold `n` u32s on the device until the kernel completes, ordered
/// with other work by `stream`; `kernel` is kept until then.
unsafe fn launch_hash(
    kernel: &Kernel,
    stream: &Stream,
    input: u64,
    output: u64,
    n: usize,
) -> cudalloc::Result<()> {
    let (mut input, mut output, mut n64, mut rounds) = (input, output, n as u64, ROUNDS);
    let mut args: [*mut c_void; 4] = [
        (&mut input as *mut u64).cast(),
        (&mut output as *mut u64).cast(),
        (&mut n64 as *mut u64).cast(),
        (&mut rounds as *mut u32).cast(),
    ];
    let grid = n.div_ceil(256).clamp(1, 1 << 16) as u32;
    // SAFETY: the arguments match `pipeline_hash(const u32*, u32*, u64, u32)` and live
    // across the call; this function's contract covers the buffers and the kernel.
    unsafe { kernel.launch((grid, 1, 1), (256, 1, 1), 0, stream, &mut args) }
}

/// Elements of batch `b`'s output that are not `hash_rounds(input_value(b, i), ROUNDS)`.
fn wrong_elements(b: usize, out: &[u32]) -> usize {
    out.iter()
        .enumerate()
        .filter(|&(i, &v)| v != hash_rounds(input_value(b, i), ROUNDS))
        .count()
}

/// `batches` batches of `n` u32s through a ring of `per_stream` buffers on each of
/// `streams` new streams: fill with `input_value`, H2D, the hash kernel, D2H into pinned
/// memory, and every element checked in the drain. `corrupt`: a batch filled wrong (the
/// check's negative control).
fn hash_pipeline(
    streams: usize,
    per_stream: usize,
    batches: usize,
    n: usize,
    corrupt: Option<usize>,
) -> Outcome {
    let streams: Vec<Stream> = (0..streams).map(|_| Stream::new(0).unwrap()).collect();
    let ring = StagingRing::new(PinnedAlloc, &streams, per_stream, n * 4).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let module = Module::load_ptx(0, PTX).unwrap();
    let kernel = module.function(KERNEL).unwrap();
    let mut calls = Vec::new();
    let mut used = HashSet::new();
    let mut buffer_of = Vec::new();
    let (mut wrong, mut elements) = (0, 0);
    let calls_cell = std::cell::RefCell::new(&mut calls);
    let run = ring
        .pipeline()
        .run(
            batches,
            |b, bytes| {
                calls_cell.borrow_mut().push(Call::Fill(b));
                for (i, w) in bytes.chunks_exact_mut(4).enumerate() {
                    let v = if corrupt == Some(b) {
                        !input_value(b, i)
                    } else {
                        input_value(b, i)
                    };
                    w.copy_from_slice(&v.to_ne_bytes());
                }
                Ok::<_, Error>(())
            },
            |b, buf| {
                calls_cell.borrow_mut().push(Call::Launch(b));
                used.insert(buf.stream().id());
                buffer_of.push(buf.index());
                let s = buf.stream();
                let mut input = pool.alloc::<u8>(buf.len(), s)?;
                let output = pool.alloc::<u32>(n, s)?;
                // SAFETY: nothing uses `buf` after this copy (said just below); the ring
                // keeps it from the next lease until the copy has completed.
                unsafe { copy::host_to_device_async(buf, &mut input, 0) }?;
                buf.last_use_queued()?;
                // SAFETY: both buffers hold `n` u32s, live in the value until the drain
                // (after the kernel), on `s`; `kernel` outlives the run.
                unsafe { launch_hash(&kernel, s, input.device_ptr(), output.device_ptr(), n) }?;
                let mut back: AVec<u32, PinnedAlloc> = AVec::new_in(PinnedAlloc);
                back.resize(n, 0);
                // SAFETY: `back` is read by the drain only, after the batch's work completed.
                unsafe { copy::device_to_host_async(&output, 0, &mut back) }?;
                Ok((input, output, back))
            },
            |b, (_input, _output, back)| {
                calls_cell.borrow_mut().push(Call::Drain(b));
                elements += back.len();
                wrong += wrong_elements(b, &back);
                Ok(())
            },
        )
        .unwrap();
    Outcome {
        wrong,
        elements,
        calls,
        streams: used,
        buffer_of,
        batches: run.batches,
    }
}

/// [`hash_pipeline`] on `Pipeline::run_split` with one ring buffer per stream and a
/// device input, a device output and a pinned host output kept per buffer (as the
/// hand-written loops keep them per lane): the launch queues the H2D and the kernel, the
/// finish the D2H into the buffer's host output, which this batch's drain reads. A finish
/// that ran before the drain of the buffer's last batch would overwrite the output that
/// drain reads.
fn split_hash_pipeline(streams: usize, batches: usize, n: usize) -> Outcome {
    let streams: Vec<Stream> = (0..streams).map(|_| Stream::new(0).unwrap()).collect();
    let ring = StagingRing::new(PinnedAlloc, &streams, 1, n * 4).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let module = Module::load_ptx(0, PTX).unwrap();
    let kernel = module.function(KERNEL).unwrap();
    // Buffer k is on stream k (one buffer per stream).
    let dev = std::cell::RefCell::new(
        streams
            .iter()
            .map(|s| {
                (
                    pool.alloc::<u8>(n * 4, s).unwrap(),
                    pool.alloc::<u32>(n, s).unwrap(),
                )
            })
            .collect::<Vec<_>>(),
    );
    let outputs: std::cell::RefCell<Vec<AVec<u32, PinnedAlloc>>> = std::cell::RefCell::new(
        (0..streams.len())
            .map(|_| {
                let mut v = AVec::new_in(PinnedAlloc);
                v.resize(n, 0);
                v
            })
            .collect(),
    );
    let calls = std::cell::RefCell::new(Vec::new());
    let mut used = HashSet::new();
    let mut buffer_of = Vec::new();
    let (mut wrong, mut elements) = (0, 0);
    let run = ring
        .pipeline()
        .run_split(
            batches,
            |b, bytes| {
                calls.borrow_mut().push(Call::Fill(b));
                for (i, w) in bytes.chunks_exact_mut(4).enumerate() {
                    w.copy_from_slice(&input_value(b, i).to_ne_bytes());
                }
                Ok::<_, Error>(())
            },
            |b, buf| {
                calls.borrow_mut().push(Call::Launch(b));
                used.insert(buf.stream().id());
                buffer_of.push(buf.index());
                let (s, mut dev) = (buf.stream(), dev.borrow_mut());
                let (input, output) = &mut dev[buf.index()];
                // SAFETY: nothing uses `buf` after this copy (said just below); the ring
                // keeps it from the next lease until the copy has completed. `input` is
                // this buffer's, used on `s` only, in its order.
                unsafe { copy::host_to_device_async(buf, input, 0) }?;
                buf.last_use_queued()?;
                // SAFETY: both buffers hold `n` u32s, are this ring buffer's and used on
                // `s` only (the last batch's D2H from `output` is queued before this
                // kernel on `s`); `kernel` outlives the run.
                unsafe { launch_hash(&kernel, s, input.device_ptr(), output.device_ptr(), n) }
            },
            |b, buf, ()| {
                calls.borrow_mut().push(Call::Finish(b));
                let k = buf.index();
                let dev = dev.borrow();
                // SAFETY: the buffer's host output was read by the drain of its last batch,
                // which ran before this finish (the property under test); it is read again
                // only by this batch's drain, after the batch completed.
                unsafe { copy::device_to_host_async(&dev[k].1, 0, &mut outputs.borrow_mut()[k]) }?;
                Ok(k)
            },
            |b, k| {
                calls.borrow_mut().push(Call::Drain(b));
                let out = &outputs.borrow()[k];
                elements += out.len();
                wrong += wrong_elements(b, out);
                Ok(())
            },
        )
        .unwrap();
    Outcome {
        wrong,
        elements,
        calls: calls.into_inner(),
        streams: used,
        buffer_of,
        batches: run.batches,
    }
}

#[test]
fn a_split_pipeline_queues_a_buffers_next_batch_before_draining_its_last() {
    gpu!();
    let (streams, batches, n) = (2, 32, 1 << 18);
    let out = split_hash_pipeline(streams, batches, n);
    assert_eq!(out.batches, batches);
    assert_eq!(out.elements, batches * n, "every element of every batch checked");
    assert_eq!(
        out.wrong, 0,
        "wrong elements: a finish overwrote an output not yet drained"
    );
    assert_eq!(out.streams.len(), streams);
    let at = |c: Call| out.at(c);
    for b in 0..batches {
        assert_eq!(out.buffer_of[b], b % streams, "buffers in turn");
        assert!(at(Call::Launch(b)) < at(Call::Finish(b)) && at(Call::Finish(b)) < at(Call::Drain(b)));
        if b + streams < batches {
            let next = b + streams; // the next batch in batch b's buffer
            assert!(
                at(Call::Launch(next)) < at(Call::Drain(b)),
                "batch {next} was queued only after batch {b}'s drain"
            );
            assert!(
                at(Call::Drain(b)) < at(Call::Finish(next)),
                "batch {next}'s finish ran before batch {b}'s drain"
            );
        }
    }
}

#[test]
fn a_pipeline_on_one_stream_delivers_every_batch_intact_and_double_buffers() {
    gpu!();
    let (batches, n) = (48, 1 << 18);
    let out = hash_pipeline(1, 2, batches, n, None);
    assert_eq!(out.batches, batches);
    assert_eq!(out.elements, batches * n, "every element of every batch checked");
    assert_eq!(out.wrong, 0, "wrong elements");
    // Each batch filled, launched, drained once, drains in order.
    let drains: Vec<usize> = out
        .calls
        .iter()
        .filter_map(|c| match c {
            Call::Drain(b) => Some(*b),
            _ => None,
        })
        .collect();
    assert_eq!(drains, (0..batches).collect::<Vec<_>>());
    // Double buffering: batch b+1 is filled and launched before batch b is drained
    // (its fill overlaps batch b's compute), and never more than 2 batches in flight;
    // batch b+2, in batch b's buffer, is filled before batch b's drain (the fill overlaps
    // batch b's kernel and copy back) and launched after it.
    let at = |c: Call| out.at(c);
    let early_fills = out.assert_buffers_drained_before_launch();
    assert_eq!(early_fills, batches - 2, "refills after the last batch's drain");
    for b in 0..batches - 1 {
        assert!(
            at(Call::Launch(b + 1)) < at(Call::Drain(b)),
            "batch {} launched after batch {b}'s drain",
            b + 1
        );
        if b + 2 < batches {
            assert!(
                at(Call::Drain(b)) < at(Call::Launch(b + 2)),
                "3 batches in flight on a ring of 2"
            );
            assert!(
                at(Call::Fill(b + 2)) < at(Call::Drain(b)),
                "batch {} filled only after batch {b}'s drain",
                b + 2
            );
        }
    }
}

#[test]
fn a_pipeline_on_eight_streams_delivers_every_batch_intact_on_every_stream() {
    gpu!();
    // The seeds' layout: 8 streams, 2 buffers each.
    let (batches, n) = (128, 1 << 17);
    let out = hash_pipeline(8, 2, batches, n, None);
    assert_eq!(out.batches, batches);
    assert_eq!(out.elements, batches * n);
    assert_eq!(out.wrong, 0, "wrong elements");
    assert_eq!(
        out.streams.len(),
        8,
        "batches went to {} of 8 streams",
        out.streams.len()
    );
    out.assert_buffers_drained_before_launch();
}

#[test]
fn the_pipeline_check_sees_a_batch_filled_wrong() {
    gpu!();
    // The negative control of the two tests above: their check can fail.
    let n = 1 << 12;
    let out = hash_pipeline(2, 1, 6, n, Some(3));
    assert_eq!(out.wrong, n, "the corrupted batch was not seen");
}

#[test]
fn a_pipeline_refuses_no_batches_in_flight() {
    gpu!();
    let s = Stream::new(0).unwrap();
    let ring = StagingRing::new(PinnedAlloc, std::slice::from_ref(&s), 1, 4096).unwrap();
    let mut called = false;
    let err = ring
        .pipeline()
        .in_flight(0)
        .run(
            4,
            |_, _| {
                called = true;
                Ok::<_, Error>(())
            },
            |_, _| Ok(()),
            |_, ()| Ok(()),
        )
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(!called, "a closure ran before the arguments were checked");
}

#[test]
fn a_failing_launch_stops_the_pipeline_and_gives_every_buffer_back() {
    gpu!();
    let streams = [Stream::new(0).unwrap(), Stream::new(0).unwrap()];
    let ring = StagingRing::new(PinnedAlloc, &streams, 2, 4096).unwrap();
    let mut drained = Vec::new();
    let err = ring
        .pipeline()
        .run(
            10,
            |_, _| Ok::<_, Error>(()),
            |b, _| {
                if b == 5 {
                    Err(Error::InvalidArgument("batch 5 fails"))
                } else {
                    Ok(b)
                }
            },
            |b, v| {
                assert_eq!(b, v);
                drained.push(b);
                Ok(())
            },
        )
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument("batch 5 fails")), "{err:?}");
    assert!(
        drained.len() < 5 && drained.iter().copied().eq(0..drained.len()),
        "{drained:?}"
    );
    // Every buffer is back in the ring.
    let all: Vec<_> = (0..ring.buffers())
        .map(|_| ring.next(Duration::from_secs(10)).unwrap())
        .collect();
    assert_eq!(all.len(), 4);
}
