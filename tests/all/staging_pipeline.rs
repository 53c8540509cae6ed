//! The staging pipeline of `examples/pipeline.rs` (its code is included in this test
//! binary): the host reference, the checker, the timeline arithmetic, the issue order
//! against a model of the GPU, and on a GPU every variant with every element of every
//! batch checked.

use crate::pipeline::{
    self, hash_rounds, input_value, plan, simulate, union_len, Checker, Config, Costs, Layout, Regime, Step,
    Tally, Variant, CPP_REFERENCE,
};

#[test]
fn host_reference_matches_known_values() {
    // Computed independently (Python, 32-bit wrapping arithmetic).
    assert_eq!(hash_rounds(0, 1), 0x7f4a_8281);
    assert_eq!(hash_rounds(1, 1), 0x1d81_cec5);
    assert_eq!(hash_rounds(0xdead_beef, 3), 0x3be7_349e);
    assert_eq!(hash_rounds(12345, 37), 0xf5ff_921e);
    assert_eq!(hash_rounds(0xffff_ffff, 1000), 0x6005_0c25);
    assert_eq!(hash_rounds(42, 0), 42);
    assert_eq!(input_value(0, 0), 0x2545_f491);
    assert_eq!(input_value(3, 1000), 0xcc59_2ef1);
    assert_eq!(input_value(70000, 16_777_215), 0x3dd9_9ad3);
}

#[test]
fn sampled_positions_are_distinct_cover_both_ends_and_move_per_batch() {
    let c = Checker {
        n: 1 << 20,
        samples: 256,
        all: false,
    };
    let a: Vec<usize> = c.positions(7).collect();
    let b: Vec<usize> = c.positions(8).collect();
    assert_eq!(a.len(), 258);
    assert!(a.contains(&0) && a.contains(&((1 << 20) - 1)));
    assert!(a.iter().all(|&p| p < 1 << 20));
    let mut d = a.clone();
    d.sort();
    d.dedup();
    assert_eq!(d.len(), a.len(), "positions repeat");
    assert_ne!(a, b, "the sampled positions do not move between batches");
    let tiny = Checker {
        n: 5,
        samples: 256,
        all: false,
    };
    assert_eq!(tiny.positions(0).collect::<Vec<_>>(), [0, 1, 2, 3, 4]);
}

#[test]
fn the_checker_catches_a_wrong_or_stale_output() {
    let c = Checker {
        n: 4096,
        samples: 64,
        all: false,
    };
    let rounds = 5;
    let mut input = vec![0u32; 4096];
    c.stamp(9, &mut input);
    let mut output: Vec<u32> = input.iter().map(|&x| hash_rounds(x, rounds)).collect();
    let mut t = Tally::default();
    c.check(9, rounds, &output, &mut t);
    assert_eq!((t.batches_checked, t.elements_checked, t.mismatches), (1, 66, 0));
    // The last batch's output in the buffer (a copy that has not landed) fails.
    c.check(10, rounds, &output, &mut t);
    assert!(t.mismatches > 60, "{} mismatches", t.mismatches);
    // So does one wrong element.
    let mut t = Tally::default();
    output[4095] ^= 1;
    c.check(9, rounds, &output, &mut t);
    assert_eq!(t.mismatches, 1);
    assert!(t.first_mismatch.unwrap().contains("element 4095"));
    // Full fills are checked everywhere.
    let all = Checker {
        n: 4096,
        samples: 64,
        all: true,
    };
    Checker::fill(3, &mut input);
    let output: Vec<u32> = input.iter().map(|&x| hash_rounds(x, 2)).collect();
    let mut t = Tally::default();
    all.check(3, 2, &output, &mut t);
    assert_eq!((t.elements_checked, t.mismatches), (4096, 0));
}

#[test]
fn the_check_computes_many_rounds_right_at_any_count_of_positions() {
    // 2390 rounds: the compute-bound regime's work; 17 and 66 positions: a partial group
    // of 16 after whole ones.
    for (n, samples) in [(17usize, 1usize), (4096, 64)] {
        let c = Checker {
            n,
            samples,
            all: false,
        };
        let mut input = vec![0u32; n];
        c.stamp(4, &mut input);
        let output: Vec<u32> = input.iter().map(|&x| hash_rounds(x, 2390)).collect();
        let mut t = Tally::default();
        c.check(4, 2390, &output, &mut t);
        assert_eq!(t.mismatches, 0, "{:?}", t.first_mismatch);
        assert_eq!(t.elements_checked, c.positions(4).count());
        c.check(4, 2389, &output, &mut t);
        assert_eq!(
            t.mismatches,
            t.elements_checked / 2,
            "one round short must fail everywhere"
        );
    }
}

#[test]
fn fills_on_several_threads_write_what_one_thread_writes() {
    let n = 300_001; // not a multiple of any thread count used
    let mut one = vec![0u32; n];
    Checker::fill(7, &mut one);
    assert!(one.iter().enumerate().all(|(i, &x)| x == input_value(7, i)));
    for threads in [2, 3, 8, 64] {
        let mut many = vec![0u32; n];
        Checker::fill_with(7, &mut many, threads);
        assert!(many == one, "{threads} threads");
        let mut v = allocator_api2::vec::Vec::new_in(allocator_api2::alloc::Global);
        v.push(1u32); // fill_new replaces what was there
        Checker::fill_new(7, n, &mut v, threads).unwrap();
        assert!(v[..] == one[..], "fill_new with {threads} threads");
    }
}

/// Host costs that would stall a pipeline whose issuing thread waited for whole batches:
/// a check of a millisecond (about what the compute-bound check took before it
/// interleaved its rounds), a write and a queue step.
const SLOW_HOST: Costs = Costs {
    h2d: 0.0,
    kernel: 0.0,
    d2h: 0.0,
    write: 0.05,
    queue: 0.01,
    check: 1.0,
};

/// The GPU's stages in the three regimes on the H200 (copies at the rate both directions
/// reach together).
fn gpu_costs(kernel: f64) -> Costs {
    Costs {
        h2d: 1.33,
        kernel,
        d2h: 1.33,
        ..Costs::default()
    }
}

fn with_host(gpu: Costs, host: Costs) -> Costs {
    Costs {
        write: host.write,
        queue: host.queue,
        check: host.check,
        ..gpu
    }
}

fn layouts() -> Vec<(Layout, usize, usize)> {
    let mut v: Vec<_> = (1..=8).map(|s| (Layout::Lanes(s), s, 0)).collect();
    v.push((Layout::Double, 2, 1));
    v
}

#[test]
fn the_issue_order_never_touches_a_buffer_still_in_use() {
    let host_profiles = [
        Costs::default(),
        SLOW_HOST,
        Costs {
            write: 9.0, // a single-threaded fill of 64 MiB
            ..SLOW_HOST
        },
        Costs {
            check: 20.0,
            ..SLOW_HOST
        },
    ];
    for (layout, reuse, skew) in layouts() {
        for batches in [1, 2, 3, 5, 8, 17, 64] {
            let steps = plan(batches, reuse, skew);
            assert_eq!(
                steps.len(),
                4 * batches - batches.min(reuse),
                "{layout:?}, {batches} batches"
            );
            for kernel in [0.06, 1.24, 5.03] {
                for host in host_profiles {
                    let sim = simulate(&steps, layout, batches, with_host(gpu_costs(kernel), host));
                    assert!(
                        sim.hazards.is_empty(),
                        "{layout:?}, {batches} batches, kernel {kernel} ms, {host:?}: {:?}",
                        sim.hazards
                    );
                }
            }
        }
    }
}

#[test]
fn the_model_catches_an_order_that_reuses_a_buffer_too_early() {
    let costs = with_host(gpu_costs(1.24), Costs::default());
    // Without the wait for the H2D of b - S, the host writes an input being copied.
    let no_wait: Vec<Step> = plan(8, 2, 0)
        .into_iter()
        .filter(|s| !matches!(s, Step::AwaitInputRead(_)))
        .collect();
    let sim = simulate(&no_wait, Layout::Lanes(2), 8, costs);
    assert!(
        sim.hazards.iter().any(|h| h.contains("written while the H2D")),
        "{:?}",
        sim.hazards
    );
    // Queuing a D2H before the output it overwrites was checked.
    let mut early = plan(8, 2, 0);
    let i = early.iter().position(|&s| s == Step::CheckOut(0)).unwrap();
    let j = early.iter().position(|&s| s == Step::QueueOut(2)).unwrap();
    early.swap(i, j);
    let sim = simulate(&early, Layout::Lanes(2), 8, costs);
    assert!(
        sim.hazards.iter().any(|h| h.contains("before batch 0's output")),
        "{:?}",
        sim.hazards
    );
    // Double buffering with a D2H queued after the kernel two batches on: that kernel
    // would wait for an event not recorded yet in this run.
    let mut late = plan(8, 2, 1);
    let i = late.iter().position(|&s| s == Step::QueueOut(0)).unwrap();
    let moved = late.remove(i);
    late.push(moved);
    let sim = simulate(&late, Layout::Double, 8, costs);
    assert!(
        sim.hazards.iter().any(|h| h.contains("not queued yet")),
        "{:?}",
        sim.hazards
    );
}

#[test]
fn the_issuing_thread_keeps_the_gpu_fed() {
    let batches = 64;
    for kernel in [0.06, 1.24, 5.03] {
        let gpu = gpu_costs(kernel);
        let stage = gpu.h2d.max(gpu.d2h).max(kernel);
        for (layout, reuse, skew) in layouts() {
            let steps = plan(batches, reuse, skew);
            let fast = simulate(&steps, layout, batches, gpu).wall;
            let slow = simulate(&steps, layout, batches, with_host(gpu, SLOW_HOST)).wall;
            // The host's work hides behind the GPU's: a millisecond of checking per batch
            // costs the pipeline almost nothing.
            assert!(
                slow <= fast * 1.01 + 0.1,
                "{layout:?}, kernel {kernel} ms: {slow:.1} ms with host costs, {fast:.1} without"
            );
            // With 4 lanes or more (and double buffering) the pipeline runs at its slowest
            // stage, plus one batch to fill it.
            let enough = match layout {
                Layout::Lanes(s) => s >= 4,
                Layout::Double => true,
            };
            if enough {
                let bound = batches as f64 * stage + gpu.h2d + kernel + gpu.d2h;
                assert!(
                    slow <= bound + 0.1,
                    "{layout:?}, kernel {kernel} ms: {slow:.1} ms > {bound:.1}"
                );
            }
        }
        // The order it replaces waited for batch b - S's D2H (and checked it) before
        // queuing anything of batch b: with one stream, every check stalls the GPU.
        let old: Vec<Step> = (0..batches)
            .flat_map(|b| {
                let check = b.checked_sub(1).map(Step::CheckOut);
                check.into_iter().chain([Step::QueueIn(b), Step::QueueOut(b)])
            })
            .chain([Step::CheckOut(batches - 1)])
            .collect();
        let old_wall = simulate(&old, Layout::Lanes(1), batches, with_host(gpu, SLOW_HOST));
        assert!(old_wall.hazards.is_empty(), "{:?}", old_wall.hazards);
        let new_wall = simulate(
            &plan(batches, 1, 0),
            Layout::Lanes(1),
            batches,
            with_host(gpu, SLOW_HOST),
        )
        .wall;
        assert!(
            old_wall.wall > new_wall + 0.9 * (batches - 1) as f64 * SLOW_HOST.check,
            "kernel {kernel} ms: old order {:.1} ms, new {new_wall:.1} ms",
            old_wall.wall
        );
    }
}

#[test]
fn the_cpp_reference_is_matched_by_memory_and_stream_count() {
    let wall = |v: Variant, r: Regime| v.cpp_reference(r).map(|c| c.wall_ms);
    assert_eq!(wall(Variant::Pageable, Regime::TransferBound), Some(1076.0));
    assert_eq!(wall(Variant::Pageable, Regime::Balanced), None);
    assert_eq!(wall(Variant::Pinned(2), Regime::TransferBound), Some(88.0));
    assert_eq!(wall(Variant::Raw(4), Regime::TransferBound), Some(87.0));
    assert_eq!(wall(Variant::Pinned(3), Regime::TransferBound), None);
    assert_eq!(wall(Variant::Pinned(4), Regime::Balanced), Some(89.0));
    assert_eq!(wall(Variant::Pinned(8), Regime::Balanced), None);
    assert_eq!(wall(Variant::Pinned(1), Regime::ComputeBound), Some(485.0));
    assert_eq!(wall(Variant::DoubleBuffered, Regime::ComputeBound), Some(309.0));
    assert_eq!(wall(Variant::Ring(4), Regime::ComputeBound), Some(309.0));
    assert_eq!(wall(Variant::Pinned(2), Regime::Rounds(7)), None);
    assert_eq!(CPP_REFERENCE[6].label(), "pinned, 4 streams");
    assert_eq!(CPP_REFERENCE[8].label(), "pinned, 2+ streams");
}

#[test]
fn the_tables_put_our_rows_next_to_the_cpp_reference() {
    let measured = |wall_ms: f64| pipeline::Measured {
        wall_ms,
        ideal_ms: 80.0,
        gpu_busy: 0.5,
        ..Default::default()
    };
    let rows = [
        (Variant::Pinned(2), 92.4),
        (Variant::Raw(2), 90.0),
        (Variant::Pinned(3), 95.0),
        (Variant::HandPinned(2), 88.0),
    ]
    .map(|(variant, w)| pipeline::Row {
        variant,
        outcome: Ok(measured(w)),
    })
    .to_vec();
    let results = pipeline::Results {
        config: Config {
            variants: rows.iter().map(|r| r.variant).collect(),
            ..Config::full()
        },
        baseline: pipeline::Baseline {
            h2d_ms: 1.2,
            d2h_ms: 1.2,
            bidir_gbps: 100.0,
            fill_ms: 1.0,
            fill_rotating_ms: 1.1,
            fill_under_copies_ms: Some(2.0),
            fill_threads: 8,
        },
        regimes: vec![pipeline::RegimeResult {
            regime: Regime::TransferBound,
            rounds: 1,
            kernel_ms: 0.06,
            rows,
        }],
    };
    let tables = results.tables();
    let main = tables.iter().find(|t| t.id == "pipeline").unwrap();
    let vs_cpp: Vec<String> = main.rows.iter().map(|r| main.cell(r, "vs_cpp")).collect();
    assert_eq!(vs_cpp, ["1.05x", "1.02x", "-", "1.00x"]);
    // The row on the library against its hand-written twin in the same run.
    let vs_hand: Vec<String> = main.rows.iter().map(|r| main.cell(r, "vs_hand")).collect();
    assert_eq!(vs_hand, ["1.05x", "-", "-", "-"]);
    let cpp = tables.iter().find(|t| t.id == "pipeline_cpp").unwrap();
    assert_eq!(
        cpp.rows.len(),
        1,
        "one C++ row (2 streams) has our rows beside it"
    );
    let r = &cpp.rows[0];
    assert_eq!(cpp.cell(r, "variant"), "pinned, 2 streams");
    assert_eq!(cpp.cell(r, "cpp_wall_ms"), "88.0 ms");
    assert_eq!(cpp.cell(r, "vs_cpp"), "1.05x");
    assert_eq!(cpp.cell(r, "raw_vs_cpp"), "1.02x");
    // The contended ideal is a staging row's; none of these fills.
    let contended: Vec<String> = main
        .rows
        .iter()
        .map(|r| main.cell(r, "vs_contended_ideal"))
        .collect();
    assert_eq!(contended, ["-", "-", "-", "-"]);
    let stages = tables.iter().find(|t| t.id == "pipeline_stages").unwrap();
    assert_eq!(stages.cell(&stages.rows[0], "fill_under_copies_ms"), "2.00 ms");
    let regimes = tables.iter().find(|t| t.id == "pipeline_regimes").unwrap();
    // Copies both ways take 1.342 ms (below), in which a fill slowed to 2 ms does 67% of
    // a batch; the rest at the 1.1 ms of the fill into buffers in turn alone: 1.704 ms,
    // and 64 x that.
    assert_eq!(regimes.cell(&regimes.rows[0], "fill_in_pipeline_ms"), "1.70 ms");
    assert_eq!(regimes.cell(&regimes.rows[0], "contended_ideal_ms"), "109.1 ms");
    // 2 x 64 MiB at 100 GB/s: 1.342 ms per batch, 85.9 ms for 64 batches.
    assert_eq!(regimes.cell(&regimes.rows[0], "floor_ms"), "85.9 ms");
}

#[test]
fn the_fill_beside_its_copies_runs_at_the_loaded_rate_while_they_run() {
    let base = |under| pipeline::Baseline {
        bidir_gbps: 64.0,
        fill_ms: 2.0,
        fill_rotating_ms: 3.0,
        fill_under_copies_ms: under,
        ..Default::default()
    };
    // 2 x 32 MB at 64 GB/s: copies take 1 ms, a quarter of a 4 ms loaded fill; the other
    // three quarters at the 3 ms of the unloaded fill into buffers in turn (the pipeline's
    // fill writes a buffer it did not write last, so not the 2 ms of the same buffer).
    let f = base(Some(4.0)).fill_in_pipeline_ms(32_000_000).unwrap();
    assert!((f - (1.0 + 0.75 * 3.0)).abs() < 1e-9, "{f}");
    // Copies that outlast the loaded fill: it runs loaded throughout.
    assert_eq!(base(Some(0.5)).fill_in_pipeline_ms(32_000_000), Some(0.5));
    // Without the loaded measurement (the copies ended first) there is no model.
    assert_eq!(base(None).fill_in_pipeline_ms(32_000_000), None);
}

#[test]
fn busy_time_is_the_union_of_intervals_not_their_sum() {
    assert_eq!(union_len(vec![]), 0.0);
    assert_eq!(union_len(vec![(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)]), 2.5);
    assert_eq!(union_len(vec![(2.0, 3.0), (0.0, 10.0)]), 10.0);
    assert_eq!(union_len(vec![(0.0, 1.0), (1.0, 2.0)]), 2.0);
}

#[test]
fn regimes_and_variants_parse_and_name_themselves() {
    assert_eq!(Regime::parse("balanced"), Some(Regime::Balanced));
    assert_eq!(Regime::parse("compute"), Some(Regime::ComputeBound));
    assert_eq!(Regime::parse("400"), Some(Regime::Rounds(400)));
    assert_eq!(Regime::parse("0"), None);
    let all = Variant::all(&[1, 2], 3, None);
    assert_eq!(all.len(), 1 + 2 + 1 + 2 + 4);
    assert!(all.contains(&Variant::Threaded(3)));
    let some = Variant::all(&[1, 2], 3, Some(&["fresh".to_string(), "raw".to_string()]));
    assert_eq!(some, [Variant::Raw(1), Variant::Raw(2), Variant::FreshVec(3)]);
    assert_eq!(Variant::Ring(4).key(), "ring-4");
    // The hand-written references of the rows on the library: only when named.
    let hand = Variant::all(&[1, 2], 3, Some(&["hand".to_string()]));
    assert_eq!(
        hand,
        [
            Variant::HandPageable,
            Variant::HandPinned(1),
            Variant::HandPinned(2),
            Variant::HandRing(3)
        ]
    );
    assert!(!all.iter().any(|v| hand.contains(v)));
    assert_eq!(Variant::HandPinned(4).key(), "hand-pinned-4");
    assert_eq!(
        Variant::HandRing(4).label(),
        "ring of 5 Vec<PinnedAlloc>, 4 streams, hand-written"
    );
    // Each keeps its row's stream count, raw reference and C++ row.
    for (lib, hand) in [
        (Variant::Pageable, Variant::HandPageable),
        (Variant::Pinned(4), Variant::HandPinned(4)),
        (Variant::Ring(4), Variant::HandRing(4)),
    ] {
        assert_eq!(lib.streams(), hand.streams());
        assert_eq!(lib.timeline_lanes(), hand.timeline_lanes());
        for r in [Regime::TransferBound, Regime::Balanced, Regime::ComputeBound] {
            assert_eq!(lib.cpp_reference(r), hand.cpp_reference(r), "{}", hand.key());
        }
    }
}

#[test]
fn without_a_driver_the_pipeline_says_so() {
    if cudalloc::cuda::driver_available() {
        return;
    }
    let err = pipeline::run(&Config::full(), &|_| {}).unwrap_err();
    assert_eq!(err, cudalloc::Error::NoDriver);
}

#[test]
fn every_variant_delivers_every_element_of_every_batch() {
    gpu!();
    let batches = 11;
    // 1 MiB: enough elements that fills use several threads.
    let batch_bytes = 1 << 20;
    // Chained copies (the default) and copies ordered by their lane's stream only.
    for chain_copies in [true, false] {
        let cfg = Config {
            batches,
            batch_bytes,
            regimes: vec![Regime::Rounds(2), Regime::Rounds(17)],
            // The rows on the library's types and the hand-written ones they replaced.
            variants: [
                Variant::all(&[1, 2, 3], 2, None),
                Variant::all(&[1, 2, 3], 2, Some(&["hand".to_string()])),
            ]
            .concat(),
            samples: 64,
            verify_all: true,
            warmup: true,
            fresh_headroom: None,
            fill_threads: 3,
            fill_workers: 2,
            chain_copies,
            // The rows on the ring with one buffer per stream, then with two.
            ring_buffers: if chain_copies { 1 } else { 2 },
            // Each row once, then each twice in turn (the median run kept, every run's
            // checks counted).
            repeat: if chain_copies { 1 } else { 2 },
        };
        let results = pipeline::run(&cfg, &|_| {}).unwrap();
        assert_eq!(results.regimes.len(), 2);
        for g in &results.regimes {
            assert_eq!(g.rows.len(), cfg.variants.len());
            for row in &g.rows {
                let m = row
                    .outcome
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{} failed: {e}", row.variant.label()));
                let who = format!(
                    "{} at {} (chained: {chain_copies})",
                    row.variant.label(),
                    g.regime.name()
                );
                assert_eq!(m.mismatches, 0, "{who}: {:?}", m.first_mismatch);
                assert_eq!(m.batches_checked, batches * cfg.repeat, "{who}");
                assert_eq!(
                    m.elements_checked,
                    cfg.repeat * batches * batch_bytes / 4,
                    "{who}"
                );
                assert!(m.wall_ms > 0.0 && m.ideal_ms > 0.0, "{who}");
                assert!(
                    (0.0..=1.0 + 1e-9).contains(&m.gpu_busy),
                    "{who}: busy {}",
                    m.gpu_busy
                );
                assert_timeline(&who, row.variant, m, batches);
            }
        }
        assert_timeline_svg(&results);
        let tables = results.tables();
        let t = tables.iter().find(|t| t.id == "pipeline").unwrap();
        assert_eq!(t.rows.len(), 2 * cfg.variants.len());
    }
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        0,
        "last: {:?}",
        cudalloc::cuda::last_drop_error()
    );
}

#[test]
fn the_library_pipeline_row_runs_only_when_named() {
    assert!(!Variant::all(&[1, 2], 3, None)
        .iter()
        .any(|v| matches!(v, Variant::Pipeline(_))));
    let named = Variant::all(&[1, 2], 8, Some(&["ring".to_string(), "pipeline".to_string()]));
    assert_eq!(named, [Variant::Ring(8), Variant::Pipeline(8)]);
    assert_eq!(Variant::Pipeline(8).key(), "pipeline-8");
    assert_eq!(Variant::Pipeline(1).label(), "staging::Pipeline, 1 stream");
    assert_eq!(Variant::Pipeline(8).streams(), 8);
}

/// The row on the library's `staging::Pipeline` (1, 2 and the seeds' 8 streams), beside
/// the hand-written ring: every element of every batch right, in both regimes.
#[test]
fn the_library_pipeline_delivers_every_element_of_every_batch() {
    gpu!();
    let batches = 23;
    let batch_bytes = 1 << 20;
    for chain_copies in [true, false] {
        let cfg = Config {
            batches,
            batch_bytes,
            regimes: vec![Regime::Rounds(2), Regime::Rounds(17)],
            variants: vec![
                Variant::Ring(2),
                Variant::Pipeline(1),
                Variant::Pipeline(2),
                Variant::Pipeline(8),
                Variant::Threaded(1),
                Variant::Threaded(2),
                Variant::Threaded(8),
            ],
            samples: 64,
            verify_all: true,
            warmup: true,
            fresh_headroom: None,
            fill_threads: 3,
            fill_workers: if chain_copies { 2 } else { 3 },
            chain_copies,
            ring_buffers: 1,
            repeat: 1,
        };
        let results = pipeline::run(&cfg, &|_| {}).unwrap();
        for g in &results.regimes {
            assert_eq!(g.rows.len(), cfg.variants.len());
            for row in &g.rows {
                let who = format!(
                    "{} at {} (chained: {chain_copies})",
                    row.variant.label(),
                    g.regime.name()
                );
                let m = row
                    .outcome
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{who} failed: {e}"));
                assert_eq!(m.mismatches, 0, "{who}: {:?}", m.first_mismatch);
                assert_eq!(m.batches_checked, batches, "{who}");
                assert_eq!(m.elements_checked, batches * batch_bytes / 4, "{who}");
                assert!(
                    (0.0..=1.0 + 1e-9).contains(&m.gpu_busy),
                    "{who}: busy {}",
                    m.gpu_busy
                );
                assert_timeline(&who, row.variant, m, batches);
            }
        }
        assert_timeline_svg(&results);
    }
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        0,
        "last: {:?}",
        cudalloc::cuda::last_drop_error()
    );
}

/// A measured row's timeline: a lane per stream and one for the host, each batch's
/// three stages and its fill once, on its stream's lane, inside the run's wall time.
fn assert_timeline(who: &str, v: Variant, m: &pipeline::Measured, batches: usize) {
    use pipeline::timeline::SpanKind;
    let t = &m.timeline;
    assert_eq!(t.lanes, v.timeline_lanes(), "{who}");
    let streams = if v == Variant::DoubleBuffered {
        3
    } else {
        v.streams()
    };
    assert_eq!(t.lanes.len(), streams + 1, "{who}");
    for kind in SpanKind::ALL {
        let mut seen: Vec<usize> = t
            .spans
            .iter()
            .filter(|s| s.kind == kind)
            .map(|s| s.batch)
            .collect();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..batches).collect::<Vec<_>>(),
            "{who}: {kind:?} once per batch"
        );
    }
    for s in &t.spans {
        assert!(s.lane < t.lanes.len(), "{who}: {s:?}");
        assert!(
            0.0 <= s.start_ms && s.start_ms <= s.end_ms && s.end_ms <= m.wall_ms + 1.0,
            "{who}: {s:?} outside 0..{} ms",
            m.wall_ms
        );
        match (v, s.kind) {
            (_, SpanKind::Fill) => assert_eq!(s.lane, streams, "{who}: {s:?}"),
            (Variant::DoubleBuffered, k) => {
                assert_eq!(
                    s.lane,
                    [SpanKind::H2D, SpanKind::Kernel, SpanKind::D2H]
                        .iter()
                        .position(|x| *x == k)
                        .unwrap()
                )
            }
            // On the library's pipeline the ring's free buffer picks the stream.
            (Variant::Pipeline(_) | Variant::Threaded(_) | Variant::Pinned(_), _) => {}
            _ => assert_eq!(s.lane, s.batch % streams, "{who}: {s:?}"),
        }
    }
    // Every stream carried work (each run has at least as many batches as streams).
    for lane in 0..streams.min(batches) {
        assert!(t.spans.iter().any(|s| s.lane == lane), "{who}: lane {lane} empty");
    }
}

/// The run's timeline SVG parses and has a caption per measured row.
fn assert_timeline_svg(results: &pipeline::Results) {
    let timelines = results.timelines();
    let rows: usize = results.regimes.iter().map(|g| g.rows.len()).sum();
    assert_eq!(timelines.len(), rows);
    let text = pipeline::timeline::svg(&timelines).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("malformed SVG: {e}"));
    for t in &timelines {
        assert!(
            doc.descendants()
                .any(|n| n.has_tag_name("text") && n.text().is_some_and(|x| x.trim() == t.title)),
            "no caption {:?}",
            t.title
        );
    }
}

/// Synthetic intervals of `batches` batches on a pipeline of `streams` lanes: batch b's
/// H2D, kernel and D2H back to back from `b` ms, in seconds (as the events give them).
fn synthetic_intervals(batches: usize) -> Vec<pipeline::StageIntervals> {
    (0..batches)
        .map(|b| {
            let t = b as f64 * 1e-3;
            [(t, t + 3e-4), (t + 3e-4, t + 6e-4), (t + 6e-4, t + 9e-4)]
        })
        .collect()
}

#[test]
fn timeline_spans_put_each_batch_on_its_stream_and_the_fill_on_the_host_lane() {
    use pipeline::timeline::SpanKind;
    let iv = synthetic_intervals(6);
    let fills: Vec<(usize, f64, f64)> = (0..6).map(|b| (b, b as f64, b as f64 + 0.2)).collect();
    let lane_of = |spans: &[pipeline::timeline::Span], b: usize, kind: SpanKind| {
        let s: Vec<_> = spans.iter().filter(|s| s.batch == b && s.kind == kind).collect();
        assert_eq!(s.len(), 1, "batch {b} {kind:?}: {s:?}");
        s[0].lane
    };
    // Batch b on stream b % S; the host lane is the last.
    let v = Variant::Pinned(4);
    assert_eq!(
        v.timeline_lanes(),
        ["stream 0", "stream 1", "stream 2", "stream 3", "host"]
    );
    let spans = pipeline::spans(v, &iv, &[], &fills);
    assert_eq!(spans.len(), 6 * 3 + 6);
    for kind in [SpanKind::H2D, SpanKind::Kernel, SpanKind::D2H] {
        assert_eq!(lane_of(&spans, 5, kind), 1);
    }
    assert_eq!(lane_of(&spans, 5, SpanKind::Fill), 4);
    let k5 = spans
        .iter()
        .find(|s| s.batch == 5 && s.kind == SpanKind::Kernel)
        .unwrap();
    assert!(
        (k5.start_ms - 5.3).abs() < 1e-9 && (k5.end_ms - 5.6).abs() < 1e-9,
        "{k5:?}"
    );
    // Double buffering: a stream per stage.
    let v = Variant::DoubleBuffered;
    assert_eq!(v.timeline_lanes().len(), 4);
    let spans = pipeline::spans(v, &iv, &[], &fills);
    assert_eq!(
        [SpanKind::H2D, SpanKind::Kernel, SpanKind::D2H, SpanKind::Fill].map(|k| lane_of(&spans, 3, k)),
        [0, 1, 2, 3]
    );
    // The library's pipeline: where the ring put each batch.
    let v = Variant::Pipeline(2);
    let spans = pipeline::spans(v, &iv, &[1, 0, 0, 1, 1, 0], &fills);
    assert_eq!(
        (0..6)
            .map(|b| lane_of(&spans, b, SpanKind::D2H))
            .collect::<Vec<_>>(),
        [1, 0, 0, 1, 1, 0]
    );
    assert_eq!(lane_of(&spans, 2, SpanKind::Fill), 2);
}

/// Every `<rect>` of `svg` filled with `color`, as (x, y, width, height) in pixels.
fn rects_of(doc: &roxmltree::Document<'_>, color: plotters::style::RGBColor) -> Vec<[f64; 4]> {
    let hex = format!("#{:02X}{:02X}{:02X}", color.0, color.1, color.2);
    doc.descendants()
        .filter(|n| {
            n.has_tag_name("rect") && n.attribute("fill").is_some_and(|f| f.eq_ignore_ascii_case(&hex))
        })
        .map(|n| ["x", "y", "width", "height"].map(|a| n.attribute(a).unwrap().parse::<f64>().unwrap()))
        .collect()
}

#[test]
fn the_timeline_svg_is_well_formed_and_has_one_lane_per_stream() {
    use pipeline::timeline::{self, SpanKind, Timeline};
    let batches = 9;
    let iv = synthetic_intervals(batches);
    let fills: Vec<(usize, f64, f64)> = (0..batches).map(|b| (b, b as f64, b as f64 + 0.25)).collect();
    let v = Variant::Ring(3);
    let one = Timeline {
        // Markup in a caption must come out escaped, not break the document.
        title: "balanced: fresh Vec<PinnedAlloc> & co".into(),
        lanes: v.timeline_lanes(),
        spans: pipeline::spans(v, &iv, &[], &fills),
    };
    let text = timeline::svg(std::slice::from_ref(&one)).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("malformed SVG: {e}"));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").trim().to_string())
        .collect();
    assert!(texts.contains(&one.title), "no caption in {texts:?}");
    // One name per lane: the three streams and the host, each once.
    for lane in ["stream 0", "stream 1", "stream 2", "host"] {
        assert_eq!(
            texts.iter().filter(|t| *t == lane).count(),
            1,
            "lane {lane:?} in {texts:?}"
        );
    }
    assert!(!texts.iter().any(|t| t == "stream 3"), "a fourth stream lane");
    // Every span is a bar of its kind's colour (plus the kind's legend swatch), and the
    // bars sit in one row per lane: three stream rows for the GPU stages, one host row.
    let legend_y = |r: &[f64; 4]| r[1] < 30.0;
    for kind in SpanKind::ALL {
        let rects = rects_of(&doc, kind.color());
        let bars: Vec<_> = rects.iter().filter(|r| !legend_y(r)).collect();
        assert_eq!(rects.len() - bars.len(), 1, "{kind:?}: one legend swatch");
        let spans = one.spans.iter().filter(|s| s.kind == kind).count();
        assert_eq!(bars.len(), spans, "{kind:?}: a bar per span");
        let mut rows: Vec<i64> = bars.iter().map(|r| r[1].round() as i64).collect();
        rows.sort_unstable();
        rows.dedup();
        let want = if kind == SpanKind::Fill { 1 } else { 3 };
        assert_eq!(rows.len(), want, "{kind:?}: rows {rows:?}");
    }
    // Batch b's H2D and its kernel share a row (its stream's), batch b + 1's differs.
    let h2d: Vec<[f64; 4]> = rects_of(&doc, SpanKind::H2D.color())
        .into_iter()
        .filter(|r| !legend_y(r))
        .collect();
    let kernels: Vec<[f64; 4]> = rects_of(&doc, SpanKind::Kernel.color())
        .into_iter()
        .filter(|r| !legend_y(r))
        .collect();
    assert_eq!(h2d[4][1], kernels[4][1]);
    assert_ne!(h2d[4][1], h2d[5][1]);
    // Later bars lie further right: the axis is time.
    assert!(h2d[5][0] > h2d[4][0]);

    // Several panels stack: each caption and each panel's lanes appear.
    let two = Timeline {
        title: "transfer-bound: PinnedAlloc, double buffering".into(),
        lanes: Variant::DoubleBuffered.timeline_lanes(),
        spans: pipeline::spans(Variant::DoubleBuffered, &iv, &[], &fills),
    };
    let text = timeline::svg(&[one.clone(), two.clone()]).unwrap();
    let doc = roxmltree::Document::parse(&text).unwrap();
    let texts: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").trim().to_string())
        .collect();
    assert!(texts.contains(&one.title) && texts.contains(&two.title));
    assert_eq!(texts.iter().filter(|t| *t == "host").count(), 2);
    assert_eq!(texts.iter().filter(|t| *t == "kernel stream").count(), 1);
    // No rows: still a document that says so.
    let empty = timeline::svg(&[]).unwrap();
    assert!(roxmltree::Document::parse(&empty).is_ok());
}

#[test]
fn the_threaded_row_runs_by_default_and_by_name_as_a_staging_row() {
    let named = Variant::all(&[1, 2], 4, Some(&["threaded".to_string()]));
    assert_eq!(named, [Variant::Threaded(4)]);
    assert_eq!(Variant::Threaded(4).key(), "threaded-4");
    assert_eq!(
        Variant::Threaded(1).label(),
        "staging::Pipeline, fill on worker threads, 1 stream"
    );
    assert_eq!(Variant::Threaded(8).streams(), 8);
    assert_eq!(
        Variant::Threaded(4).timeline_lanes(),
        Variant::Pipeline(4).timeline_lanes()
    );
    assert_eq!(Config::full().fill_workers, 2);
}

// ----- the library's threaded fill (`Pipeline::fill_threads`) on a GPU -----------------

use std::sync::Mutex;

use allocator_api2::vec::Vec as AVec;
use cudalloc::cuda::{Kernel, Module, Stream};
use cudalloc::device::DevicePool;
use cudalloc::staging::StagingRing;
use cudalloc::{copy, Error, PinnedAlloc};

const THREADED_ROUNDS: u32 = 5;

/// Queues `out[i] = hash_rounds(input[i], THREADED_ROUNDS)` on `stream`.
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
    let (mut input, mut output, mut n64, mut rounds) = (input, output, n as u64, THREADED_ROUNDS);
    let mut args: [*mut std::ffi::c_void; 4] = [
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Fill(usize),
    Launch(usize),
    Drain(usize),
}

struct Threaded {
    wrong: usize,
    elements: usize,
    calls: Vec<Call>,
    /// The ring buffer of each batch, in launch order.
    buffer_of: Vec<usize>,
    streams_used: usize,
    batches: usize,
}

/// `batches` batches of `n` u32s through a ring of 2 buffers on each of `streams` streams,
/// filled with `input_value` on `workers` fill threads: H2D, the hash kernel, D2H into
/// pinned memory, every element checked in the drain. `corrupt`: a batch filled wrong.
fn threaded_pipeline(
    streams: usize,
    workers: usize,
    batches: usize,
    n: usize,
    corrupt: Option<usize>,
) -> Threaded {
    let streams: Vec<Stream> = (0..streams).map(|_| Stream::new(0).unwrap()).collect();
    let ring = StagingRing::new(PinnedAlloc, &streams, 2, n * 4).unwrap();
    let pool = DevicePool::get(0).unwrap();
    let module = Module::load_ptx(0, crate::pipeline::PTX).unwrap();
    let kernel = module.function(crate::pipeline::KERNEL).unwrap();
    let calls = Mutex::new(Vec::new());
    let push = |c: Call| calls.lock().unwrap().push(c);
    let mut buffer_of = Vec::new();
    let mut used = std::collections::HashSet::new();
    let (mut wrong, mut elements) = (0, 0);
    let run = ring
        .pipeline()
        .fill_threads(workers)
        .run(
            batches,
            |b, bytes| {
                push(Call::Fill(b));
                for (i, w) in bytes.chunks_exact_mut(4).enumerate() {
                    let v = input_value(b, i);
                    let v = if corrupt == Some(b) { !v } else { v };
                    w.copy_from_slice(&v.to_ne_bytes());
                }
                Ok::<_, Error>(())
            },
            |b, buf| {
                push(Call::Launch(b));
                buffer_of.push(buf.index());
                used.insert(buf.stream().id());
                let s = buf.stream();
                let mut input = pool.alloc::<u8>(buf.len(), s)?;
                let output = pool.alloc::<u32>(n, s)?;
                // SAFETY: nothing uses `buf` after this copy (said just below); the ring
                // hands it out again only once the copy has completed.
                unsafe { copy::host_to_device_async(buf, &mut input, 0) }?;
                buf.last_use_queued()?;
                // SAFETY: both buffers hold `n` u32s and live in the value until the drain
                // (after the kernel), on `s`; `kernel` outlives the run.
                unsafe { launch_hash(&kernel, s, input.device_ptr(), output.device_ptr(), n) }?;
                let mut back: AVec<u32, PinnedAlloc> = AVec::new_in(PinnedAlloc);
                back.resize(n, 0);
                // SAFETY: `back` is read by the drain only, after the batch's work completed.
                unsafe { copy::device_to_host_async(&output, 0, &mut back) }?;
                Ok((input, output, back))
            },
            |b, (_input, _output, back)| {
                push(Call::Drain(b));
                elements += back.len();
                wrong += back
                    .iter()
                    .enumerate()
                    .filter(|&(i, &v)| v != hash_rounds(input_value(b, i), THREADED_ROUNDS))
                    .count();
                Ok(())
            },
        )
        .unwrap();
    Threaded {
        wrong,
        elements,
        calls: calls.into_inner().unwrap(),
        buffer_of,
        streams_used: used.len(),
        batches: run.pipeline.batches,
    }
}

#[test]
fn a_threaded_pipeline_delivers_every_element_of_every_batch_in_order() {
    gpu!();
    for (streams, workers) in [(1, 1), (1, 2), (4, 2), (4, 3), (8, 4)] {
        let (batches, n) = (40, 1 << 16);
        let who = format!("{streams} streams, {workers} fill threads");
        let out = threaded_pipeline(streams, workers, batches, n, None);
        assert_eq!(out.batches, batches, "{who}");
        assert_eq!(
            out.elements,
            batches * n,
            "{who}: every element of every batch checked"
        );
        assert_eq!(out.wrong, 0, "{who}: wrong elements");
        assert_eq!(out.streams_used, streams, "{who}: streams used");
        let of =
            |pick: fn(&Call) -> Option<usize>| -> Vec<usize> { out.calls.iter().filter_map(pick).collect() };
        let mut fills = of(|c| if let Call::Fill(b) = c { Some(*b) } else { None });
        fills.sort_unstable();
        assert!(
            fills.iter().copied().eq(0..batches),
            "{who}: each batch filled once"
        );
        let launches = of(|c| if let Call::Launch(b) = c { Some(*b) } else { None });
        assert!(
            launches.iter().copied().eq(0..batches),
            "{who}: launches {launches:?}"
        );
        let drains = of(|c| if let Call::Drain(b) = c { Some(*b) } else { None });
        assert!(drains.iter().copied().eq(0..batches), "{who}: drains {drains:?}");
        // A batch is launched in a buffer only after the buffer's last batch was drained
        // (its fill may come before that drain: the ring waited for the upload only).
        let at = |c: Call| out.calls.iter().position(|&x| x == c).unwrap();
        for (b, &k) in out.buffer_of.iter().enumerate() {
            if let Some(prev) = out.buffer_of[..b].iter().rposition(|&j| j == k) {
                assert!(
                    at(Call::Drain(prev)) < at(Call::Launch(b)),
                    "{who}: buffer {k} launched for batch {b} before batch {prev} was drained"
                );
            }
        }
    }
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        0,
        "last: {:?}",
        cudalloc::cuda::last_drop_error()
    );
}

#[test]
fn the_threaded_pipeline_check_sees_a_batch_filled_wrong() {
    gpu!();
    // The negative control of the test above: its check can fail.
    let n = 1 << 12;
    let out = threaded_pipeline(2, 2, 9, n, Some(4));
    assert_eq!(out.wrong, n, "the corrupted batch was not seen");
}

#[test]
fn a_failing_threaded_fill_stops_the_run_and_gives_every_buffer_back() {
    gpu!();
    let streams = [Stream::new(0).unwrap(), Stream::new(0).unwrap()];
    let ring = StagingRing::new(PinnedAlloc, &streams, 2, 4096).unwrap();
    let launched = Mutex::new(Vec::new());
    let err = ring
        .pipeline()
        .fill_threads(2)
        .run(
            12,
            |b, _| {
                if b == 5 {
                    Err(Error::InvalidArgument("fill 5 fails"))
                } else {
                    Ok(())
                }
            },
            |b, _| {
                launched.lock().unwrap().push(b);
                Ok(b)
            },
            |_, _| Ok(()),
        )
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument("fill 5 fails")), "{err:?}");
    let launched = launched.into_inner().unwrap();
    assert!(
        launched.iter().copied().eq(0..launched.len()) && launched.len() <= 5,
        "{launched:?}"
    );
    let all: Vec<_> = (0..ring.buffers())
        .map(|_| ring.next(std::time::Duration::from_secs(10)).unwrap())
        .collect();
    assert_eq!(all.len(), 4, "every buffer is back in the ring");
}
