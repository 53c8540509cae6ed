//! The A/B report's data model and its outputs: tables of typed values, printed as
//! Markdown, written as JSON (one file, every row) and CSV (one file per table).
//!
//! Tables are tidy: one row per measurement, one column per variable, each column with a
//! unit. A table may also say how to print it wide (one row per size, one column per
//! allocator) and how to chart it; the data stays the same. Shared by `examples/ab.rs`,
//! `examples/pipeline.rs`, `examples/replay.rs` and the tests (`#[path]` includes), so what the tests check is
//! what the examples write.

// Shared by several examples and tests (`#[path]` includes): each uses part of it.
#![allow(dead_code)]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What a column's numbers measure; decides how they print.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    /// Text or a plain label.
    Label,
    /// A size in bytes.
    Bytes,
    /// A duration in nanoseconds.
    Nanos,
    /// A duration in milliseconds.
    Millis,
    /// Gigabytes (1e9 bytes) per second.
    GBps,
    /// A ratio (`1.25x`).
    Ratio,
    /// A share in percent.
    Percent,
    /// A count.
    Count,
}

impl Unit {
    /// The unit's name in JSON and CSV headers.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Label => "",
            Unit::Bytes => "B",
            Unit::Nanos => "ns",
            Unit::Millis => "ms",
            Unit::GBps => "GB/s",
            Unit::Ratio => "x",
            Unit::Percent => "%",
            Unit::Count => "count",
        }
    }
}

/// One cell.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// A label.
    Text(String),
    /// A number in the column's unit.
    Num(f64),
    /// Not measured (a failed allocation, a variant that could not run).
    Missing,
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Text(s.to_string())
    }
}
impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Text(s)
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Num(v)
    }
}
impl From<usize> for Value {
    fn from(v: usize) -> Self {
        Value::Num(v as f64)
    }
}
impl From<Option<f64>> for Value {
    fn from(v: Option<f64>) -> Self {
        v.map_or(Value::Missing, Value::Num)
    }
}

/// A column: a key for machines (`median_ns`), a title for people, a unit.
#[derive(Clone, Debug, PartialEq)]
pub struct Column {
    pub key: String,
    pub title: String,
    pub unit: Unit,
}

/// How to print a tidy table wide: one line per distinct `row` value, one column per
/// distinct `col` value, the cell showing `value` (and `ratio` beside it, if set).
#[derive(Clone, Debug, PartialEq)]
pub struct Wide {
    pub row: String,
    pub col: String,
    pub value: String,
    pub ratio: Option<String>,
}

/// How to chart a table: grouped bars, one group per distinct `x` value, one bar per
/// distinct `series` value, height `y`.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    pub x: String,
    pub series: String,
    pub y: String,
    pub log_y: bool,
}

/// A table of one section.
#[derive(Clone, Debug, PartialEq)]
pub struct Table {
    /// Unique in a report; the CSV file's name.
    pub id: String,
    pub section: String,
    pub title: String,
    pub columns: Vec<Column>,
    pub rows: Vec<Vec<Value>>,
    pub notes: Vec<String>,
    pub wide: Option<Wide>,
    pub chart: Option<Chart>,
    /// Columns left out of the Markdown (they stay in JSON and CSV).
    pub markdown_skip: Vec<String>,
}

impl Table {
    pub fn new(id: &str, section: &str, title: &str) -> Self {
        Self {
            id: id.into(),
            section: section.into(),
            title: title.into(),
            columns: Vec::new(),
            rows: Vec::new(),
            notes: Vec::new(),
            wide: None,
            chart: None,
            markdown_skip: Vec::new(),
        }
    }

    /// Leaves columns out of the Markdown (builder style).
    pub fn skip_in_markdown(mut self, keys: &[&str]) -> Self {
        self.markdown_skip.extend(keys.iter().map(|k| k.to_string()));
        self
    }

    /// Adds a column (builder style).
    pub fn col(mut self, key: &str, title: &str, unit: Unit) -> Self {
        self.columns.push(Column {
            key: key.into(),
            title: title.into(),
            unit,
        });
        self
    }

    pub fn wide(mut self, row: &str, col: &str, value: &str, ratio: Option<&str>) -> Self {
        self.wide = Some(Wide {
            row: row.into(),
            col: col.into(),
            value: value.into(),
            ratio: ratio.map(Into::into),
        });
        self
    }

    pub fn chart(mut self, x: &str, series: &str, y: &str, log_y: bool) -> Self {
        self.chart = Some(Chart {
            x: x.into(),
            series: series.into(),
            y: y.into(),
            log_y,
        });
        self
    }

    /// Appends a row; it must have one value per column.
    pub fn push(&mut self, row: Vec<Value>) {
        assert_eq!(row.len(), self.columns.len(), "table {}: row width", self.id);
        self.rows.push(row);
    }

    pub fn note(&mut self, text: impl Into<String>) {
        self.notes.push(text.into());
    }

    /// The index of the column `key`.
    pub fn column(&self, key: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.key == key)
    }

    /// The cell of `row` in column `key`, formatted for people.
    pub fn cell(&self, row: &[Value], key: &str) -> String {
        match self.column(key) {
            Some(i) => format_value(&row[i], self.columns[i].unit),
            None => String::new(),
        }
    }

    /// The distinct values of column `key` as labels, in first-seen order.
    pub fn distinct(&self, key: &str) -> Vec<String> {
        let mut seen: Vec<String> = Vec::new();
        for r in &self.rows {
            let v = self.cell(r, key);
            if !seen.contains(&v) {
                seen.push(v);
            }
        }
        seen
    }

    /// The table as Markdown (wide when it says how).
    pub fn markdown(&self) -> String {
        let mut out = format!("## {}\n\n", self.title);
        let (header, body) = match &self.wide {
            Some(w) => self.wide_cells(w),
            None => {
                let shown: Vec<usize> = (0..self.columns.len())
                    .filter(|&i| !self.markdown_skip.contains(&self.columns[i].key))
                    .collect();
                (
                    shown
                        .iter()
                        .map(|&i| {
                            let c = &self.columns[i];
                            // Only GB/s cells are bare numbers; the others carry their unit.
                            match c.unit {
                                Unit::GBps if !c.title.contains("GB/s") => format!("{} (GB/s)", c.title),
                                _ => c.title.clone(),
                            }
                        })
                        .collect(),
                    self.rows
                        .iter()
                        .map(|r| {
                            shown
                                .iter()
                                .map(|&i| format_value(&r[i], self.columns[i].unit))
                                .collect()
                        })
                        .collect(),
                )
            }
        };
        out.push_str(&markdown_grid(&header, &body));
        for n in &self.notes {
            let _ = writeln!(out, "{n}");
        }
        if !self.notes.is_empty() {
            out.push('\n');
        }
        out
    }

    fn wide_cells(&self, w: &Wide) -> (Vec<String>, Vec<Vec<String>>) {
        let row_keys = self.distinct(&w.row);
        let col_keys = self.distinct(&w.col);
        let row_title = self
            .column(&w.row)
            .map_or(w.row.clone(), |i| self.columns[i].title.clone());
        let mut header = vec![row_title];
        header.extend(col_keys.iter().cloned());
        let body = row_keys
            .iter()
            .map(|rk| {
                let mut cells = vec![rk.clone()];
                for ck in &col_keys {
                    let found = self
                        .rows
                        .iter()
                        .find(|r| &self.cell(r, &w.row) == rk && &self.cell(r, &w.col) == ck);
                    cells.push(match found {
                        None => "-".into(),
                        Some(r) => match &w.ratio {
                            Some(ratio) if self.column(&w.value).is_some_and(|i| r[i] != Value::Missing) => {
                                format!("{} ({})", self.cell(r, &w.value), self.cell(r, ratio))
                            }
                            _ => self.cell(r, &w.value),
                        },
                    });
                }
                cells
            })
            .collect();
        (header, body)
    }

    /// The table as CSV: a header of column keys (which carry the unit: `median_ns`), one
    /// line per row.
    pub fn csv(&self) -> String {
        let mut out = String::new();
        let header: Vec<String> = self.columns.iter().map(|c| csv_field(&c.key)).collect();
        let _ = writeln!(out, "{}", header.join(","));
        for r in &self.rows {
            let cells: Vec<String> = r
                .iter()
                .map(|v| match v {
                    Value::Text(s) => csv_field(s),
                    Value::Num(x) if x.is_finite() => format!("{x}"),
                    _ => String::new(),
                })
                .collect();
            let _ = writeln!(out, "{}", cells.join(","));
        }
        out
    }

    /// The table as a JSON object: its id, section, title, columns, notes, and one object
    /// per row keyed by column key (numbers as numbers, missing values as null).
    pub fn json(&self) -> serde_json::Value {
        use serde_json::{json, Map, Value as J};
        let rows: Vec<J> = self
            .rows
            .iter()
            .map(|r| {
                let mut m = Map::new();
                for (v, c) in r.iter().zip(&self.columns) {
                    let j = match v {
                        Value::Text(s) => J::String(s.clone()),
                        Value::Num(x) => serde_json::Number::from_f64(*x).map_or(J::Null, J::Number),
                        Value::Missing => J::Null,
                    };
                    m.insert(c.key.clone(), j);
                }
                J::Object(m)
            })
            .collect();
        json!({
            "id": self.id,
            "section": self.section,
            "title": self.title,
            "columns": self.columns.iter().map(|c| json!({
                "key": c.key, "title": c.title, "unit": c.unit.name(),
            })).collect::<Vec<_>>(),
            "notes": self.notes,
            "rows": rows,
        })
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn markdown_grid(header: &[String], body: &[Vec<String>]) -> String {
    let mut w: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in body {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:>width$}", width = w[i]))
            .collect();
        format!("| {} |\n", s.join(" | "))
    };
    let mut out = line(header);
    out.push_str(&format!(
        "|{}|\n",
        w.iter().map(|n| "-".repeat(n + 2)).collect::<Vec<_>>().join("|")
    ));
    for r in body {
        out.push_str(&line(r));
    }
    out.push('\n');
    out
}

/// A value as people read it, in its column's unit.
pub fn format_value(v: &Value, unit: Unit) -> String {
    let x = match v {
        Value::Text(s) => return s.clone(),
        Value::Missing => return "-".into(),
        Value::Num(x) => *x,
    };
    if !x.is_finite() {
        return "-".into();
    }
    match unit {
        Unit::Bytes => fmt_size(x as usize),
        Unit::Nanos => fmt_time_ns(x),
        Unit::Millis if x < 10.0 => format!("{x:.2} ms"),
        Unit::Millis => format!("{x:.1} ms"),
        Unit::GBps => format!("{x:.1}"),
        Unit::Ratio => format!("{x:.2}x"),
        Unit::Percent => format!("{x:.0}%"),
        Unit::Count | Unit::Label => format!("{x}"),
    }
}

pub fn fmt_size(n: usize) -> String {
    const KIB: usize = 1 << 10;
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= KIB && n % KIB == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

pub fn fmt_time_ns(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.1} us", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

/// Parses a size such as `256`, `64K`, `16M`, `1G` (binary multiples; `KiB`, `MB`
/// spellings too).
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let n: usize = num.parse().ok()?;
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return None,
    };
    n.checked_mul(1 << shift)
}

/// A whole report: where it ran, why rows are missing, and the tables.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub title: String,
    pub environment: Vec<(String, String)>,
    pub notes: Vec<String>,
    pub tables: Vec<Table>,
}

impl Report {
    pub fn markdown(&self) -> String {
        let mut out = format!("# {}\n\n", self.title);
        for (k, v) in &self.environment {
            let _ = writeln!(out, "- {k}: {v}");
        }
        if !self.environment.is_empty() {
            out.push('\n');
        }
        for n in &self.notes {
            let _ = writeln!(out, "{n}\n");
        }
        for t in &self.tables {
            out.push_str(&t.markdown());
        }
        out
    }

    pub fn json(&self) -> serde_json::Value {
        let env: serde_json::Map<String, serde_json::Value> = self
            .environment
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect();
        serde_json::json!({
            "title": self.title,
            "environment": env,
            "notes": self.notes,
            "tables": self.tables.iter().map(Table::json).collect::<Vec<_>>(),
        })
    }

    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(&self.json()).map_err(std::io::Error::other)?;
        std::fs::write(path, text + "\n")
    }

    /// Writes `DIR/<table id>.csv` for every table; returns the paths.
    pub fn write_csv(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        std::fs::create_dir_all(dir)?;
        self.tables
            .iter()
            .map(|t| {
                let path = dir.join(format!("{}.csv", t.id));
                std::fs::write(&path, t.csv())?;
                Ok(path)
            })
            .collect()
    }
}
