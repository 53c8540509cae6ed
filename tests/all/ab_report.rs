//! The A/B report (`examples/ab.rs`; its code is included in this test binary): the rows
//! it collects reach the JSON and CSV outputs whole, and its SVG is well-formed. Runs the
//! host sections for real (quick budgets), so it runs in CI without a GPU.

use std::path::PathBuf;

use crate::report::{parse_size, Report, Table, Unit, Value};
use crate::sections::{self, Options, Progress};

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("cudalloc-ab-{}-{name}", std::process::id()))
}

fn host_report() -> Report {
    let opts = Options {
        only: Some(vec!["latency".into(), "growth".into(), "staging".into()]),
        sizes: Some(vec![256, 64 << 10]),
        quick: true,
        ..Options::default()
    };
    sections::collect(&opts, &Progress::new(false))
}

#[test]
fn the_json_output_parses_and_carries_every_row() {
    let report = host_report();
    assert_eq!(report.tables.len(), 4, "{:?}", report.notes);
    let latency = sections::find(&report, "latency").unwrap();
    assert!(
        latency.rows.len() >= 2 * 4,
        "two sizes x at least four host allocators"
    );
    // The counting allocators on 1 and 8 threads at once (issue 22 item 1): Global,
    // Counting and stats_alloc at every size and thread count, each measured.
    let threads = sections::find(&report, "latency_threads").unwrap();
    assert_eq!(threads.rows.len(), 2 * 2 * 3, "{:?}", threads.rows);
    assert!(
        threads
            .rows
            .iter()
            .all(|r| !format!("{:?}", r[2]).contains("Missing")),
        "every row measured: {:?}",
        threads.rows
    );
    let path = temp_path("report.json");
    report.write_json(&path).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tables = json["tables"].as_array().unwrap();
    assert_eq!(tables.len(), report.tables.len());
    for (j, t) in tables.iter().zip(&report.tables) {
        assert_eq!(j["id"], t.id.as_str());
        let rows = j["rows"].as_array().unwrap();
        assert_eq!(rows.len(), t.rows.len(), "table {}", t.id);
        for (jr, r) in rows.iter().zip(&t.rows) {
            let obj = jr.as_object().unwrap();
            assert_eq!(obj.len(), t.columns.len(), "table {}", t.id);
            for (c, v) in t.columns.iter().zip(r) {
                match v {
                    Value::Text(s) => assert_eq!(obj[&c.key], s.as_str()),
                    Value::Num(x) => {
                        // serde_json parses floats to within an ulp (without its
                        // float_roundtrip feature): equal up to rounding.
                        let got = obj[&c.key].as_f64().unwrap_or(f64::NAN);
                        assert!(
                            (got - x).abs() <= 1e-12 * x.abs(),
                            "{}.{}: {got} != {x}",
                            t.id,
                            c.key
                        );
                    }
                    Value::Missing => assert!(obj[&c.key].is_null()),
                }
            }
        }
    }
    let gpu = cudalloc::cuda::driver_available();
    let notes: Vec<&str> = json["notes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    assert_eq!(
        notes.iter().any(|n| n.starts_with("GPU rows missing")),
        !gpu,
        "one line says why GPU rows are missing, only without a GPU: {notes:?}"
    );
    if !gpu {
        // Host rows only: no pinned or managed allocator.
        assert!(latency.rows.iter().all(|r| r[1] != Value::from("PinnedAlloc")));
    }
}

#[test]
fn only_runs_the_sections_asked_for() {
    let opts = Options {
        only: Some(vec!["growth".into()]),
        quick: true,
        ..Options::default()
    };
    let report = sections::collect(&opts, &Progress::new(false));
    let ids: Vec<&str> = report.tables.iter().map(|t| t.id.as_str()).collect();
    assert_eq!(ids, ["growth"]);
}

#[test]
fn csv_files_hold_every_row() {
    let report = host_report();
    let dir = temp_path("csv");
    let files = report.write_csv(&dir).unwrap();
    assert_eq!(files.len(), report.tables.len());
    for (f, t) in files.iter().zip(&report.tables) {
        let text = std::fs::read_to_string(f).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), t.rows.len() + 1, "{}", f.display());
        let keys: Vec<&str> = t.columns.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(lines[0], keys.join(","));
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A table with the awkward cases: text with commas and quotes, missing values, NaN.
fn awkward_table() -> Table {
    let mut t = Table::new("awkward", "test", "Awkward \"values\", <escaped> & all")
        .col("name", "name", Unit::Label)
        .col("size_bytes", "size", Unit::Bytes)
        .col("median_ns", "median", Unit::Nanos)
        .chart("size_bytes", "name", "median_ns", true);
    t.push(vec!["a, \"quoted\" name".into(), 256usize.into(), 41.5.into()]);
    t.push(vec!["plain".into(), 256usize.into(), Value::Missing]);
    t.push(vec!["plain".into(), 4096usize.into(), f64::NAN.into()]);
    t.push(vec!["<tag>".into(), 4096usize.into(), 2.0e6.into()]);
    t
}

#[test]
fn awkward_values_survive_json_and_csv() {
    let t = awkward_table();
    let json: serde_json::Value = serde_json::from_str(&t.json().to_string()).unwrap();
    assert_eq!(json["rows"][0]["name"], "a, \"quoted\" name");
    assert!(json["rows"][1]["median_ns"].is_null());
    assert!(json["rows"][2]["median_ns"].is_null(), "NaN is not JSON: null");
    let csv = t.csv();
    let first = csv.lines().nth(1).unwrap();
    assert_eq!(first, "\"a, \"\"quoted\"\" name\",256,41.5");
    assert_eq!(csv.lines().nth(2).unwrap(), "plain,256,");
    assert!(t.markdown().contains("2.00 ms"));
}

#[test]
fn the_svg_is_well_formed_and_draws_every_charted_table() {
    let mut report = host_report();
    report.tables.push(awkward_table());
    let charted = report.tables.iter().filter(|t| t.chart.is_some()).count();
    let path = temp_path("charts.svg");
    let drawn = crate::plot::write_svg(&report, &path).unwrap();
    assert_eq!(drawn, charted);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    let doc = roxmltree::Document::parse(&text).unwrap_or_else(|e| panic!("malformed SVG: {e}"));
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let texts: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| n.text().unwrap_or("").trim().to_string())
        .collect();
    for t in report.tables.iter().filter(|t| t.chart.is_some()) {
        assert!(texts.contains(&t.title), "no caption {:?}", t.title);
    }
    // Every finite, positive value is a bar: at least as many rectangles as such values.
    let bars: usize = report
        .tables
        .iter()
        .filter_map(|t| t.chart.as_ref().map(|c| (t, t.column(&c.y).unwrap())))
        .map(|(t, y)| {
            t.rows
                .iter()
                .filter(|r| matches!(r[y], Value::Num(v) if v.is_finite() && v > 0.0))
                .count()
        })
        .sum();
    let rects = doc.descendants().filter(|n| n.has_tag_name("rect")).count();
    assert!(rects >= bars, "{rects} rectangles for {bars} values");
}

#[test]
fn sizes_parse_with_binary_suffixes() {
    assert_eq!(parse_size("256"), Some(256));
    assert_eq!(parse_size("64K"), Some(64 << 10));
    assert_eq!(parse_size("16MiB"), Some(16 << 20));
    assert_eq!(parse_size("1g"), Some(1 << 30));
    assert_eq!(parse_size("12 parsecs"), None);
    assert_eq!(parse_size(""), None);
}

#[test]
fn cpu_bandwidth_passes_write_every_byte_and_read_without_writing() {
    // Writes: every byte holds the last pass's value (3 passes after the untimed one).
    let mut buf = vec![7u8; (3 << 20) + 5];
    for threads in [1, 3] {
        let g = sections::cpu_gbps(&mut buf, threads, true, 3);
        assert!(g.is_finite() && g > 0.0, "{threads} threads: {g} GB/s");
        assert!(buf.iter().all(|&b| b == 3), "{threads} threads wrote every byte");
    }
    buf.fill(9);
    let g = sections::cpu_gbps(&mut buf, 2, false, 2);
    assert!(g.is_finite() && g > 0.0);
    assert!(buf.iter().all(|&b| b == 9), "reads leave the memory as it was");
}

#[test]
fn a_cold_child_measures_its_allocation_and_refuses_unknown_kinds() {
    // The `cold` section runs these in fresh processes of `ab`; here in-process.
    sections::cold_child("pageable", 1 << 20).unwrap();
    sections::cold_child("prefault", (16 << 20) + 4096).unwrap();
    assert!(sections::cold_child("mmap", 1 << 20).is_err());
    if !cudalloc::cuda::driver_available() {
        assert!(
            sections::cold_child("pinned", 1 << 20).is_err(),
            "pinned needs a driver"
        );
    }
}

#[test]
fn ab_with_a_trace_adds_the_replay_table_and_its_chart() {
    use cudalloc::trace::format::rmm;
    use cudalloc::trace::replay::{random_workload, Plan, RandomWorkload, ReplayOptions};
    // A trace written here (the test may not rely on the sources' traces/ being present).
    let trace = random_workload(&RandomWorkload {
        allocations: 300,
        ..RandomWorkload::small()
    });
    let path = temp_path("trace.csv");
    let mut file = std::fs::File::create(&path).unwrap();
    rmm::write(&trace, &mut file).unwrap();
    drop(file);
    let peak = Plan::new(&trace, &ReplayOptions::default())
        .unwrap()
        .peak_requested();
    let opts = |trace: Option<PathBuf>| Options {
        only: Some(vec!["replay".into()]),
        quick: true,
        trace,
        ..Options::default()
    };
    // Without --trace the section does not run.
    let none = sections::collect(&opts(None), &Progress::new(false));
    assert!(none.tables.is_empty(), "{:?}", none.notes);

    let report = sections::collect(&opts(Some(path.clone())), &Progress::new(false));
    std::fs::remove_file(&path).ok();
    assert!(
        report
            .notes
            .iter()
            .all(|n| !n.starts_with("section replay failed")),
        "{:?}",
        report.notes
    );
    let table = sections::find(&report, "replay").expect("a replay table");
    assert!(table.title.contains("trace.csv"), "{}", table.title);
    assert!(!table.rows.is_empty(), "a row per allocator");
    assert!(
        table.notes.iter().any(|n| n.starts_with("Trace: ")),
        "{:?}",
        table.notes
    );
    let peak_col = table.column("peak_requested").unwrap();
    let total_col = table.column("total_ms").unwrap();
    for r in &table.rows {
        // Every allocator replayed the whole trace: the trace's own peak.
        assert_eq!(r[peak_col], Value::from(peak as usize), "{:?}", r[0]);
        assert!(matches!(r[total_col], Value::Num(t) if t > 0.0), "{:?}", r[0]);
    }
    // Its chart is in the SVG, and its rows reach the JSON.
    let svg = temp_path("replay.svg");
    assert_eq!(crate::plot::write_svg(&report, &svg).unwrap(), 1);
    let text = std::fs::read_to_string(&svg).unwrap();
    std::fs::remove_file(&svg).ok();
    let doc = roxmltree::Document::parse(&text).unwrap();
    assert!(doc
        .descendants()
        .any(|n| n.has_tag_name("text") && n.text().is_some_and(|t| t.trim() == table.title)));
    let json = report.json();
    assert_eq!(
        json["tables"][0]["rows"].as_array().unwrap().len(),
        table.rows.len()
    );
}
