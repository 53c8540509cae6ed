//! The staging pipeline of `examples/pipeline.rs` (its code is included in this test
//! binary): the host reference, the checker, the timeline arithmetic, and on a GPU every
//! variant with every element of every batch checked.

use crate::pipeline::{self, hash_rounds, input_value, union_len, Checker, Config, Regime, Tally, Variant};

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
    assert_eq!(all.len(), 1 + 2 + 1 + 2 + 3);
    let some = Variant::all(&[1, 2], 3, Some(&["fresh".to_string(), "raw".to_string()]));
    assert_eq!(some, [Variant::Raw(1), Variant::Raw(2), Variant::FreshVec(3)]);
    assert_eq!(Variant::Ring(4).key(), "ring-4");
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
    let batch_bytes = 256 << 10;
    let cfg = Config {
        batches,
        batch_bytes,
        regimes: vec![Regime::Rounds(2), Regime::Rounds(17)],
        variants: Variant::all(&[1, 2, 3], 2, None),
        samples: 64,
        verify_all: true,
        warmup: true,
        fresh_headroom: None,
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
            let who = format!("{} at {}", row.variant.label(), g.regime.name());
            assert_eq!(m.mismatches, 0, "{who}: {:?}", m.first_mismatch);
            assert_eq!(m.batches_checked, batches, "{who}");
            assert_eq!(m.elements_checked, batches * batch_bytes / 4, "{who}");
            assert!(m.wall_ms > 0.0 && m.ideal_ms > 0.0, "{who}");
            assert!(
                (0.0..=1.0 + 1e-9).contains(&m.gpu_busy),
                "{who}: busy {}",
                m.gpu_busy
            );
        }
    }
    let tables = results.tables();
    let t = tables.iter().find(|t| t.id == "pipeline").unwrap();
    assert_eq!(t.rows.len(), 2 * cfg.variants.len());
    assert_eq!(
        cudalloc::cuda::drop_errors(),
        0,
        "last: {:?}",
        cudalloc::cuda::last_drop_error()
    );
}
