//! Charts of the report's tables, as one SVG file: a grouped bar chart for each table
//! that says how to chart itself (`Table::chart`), stacked top to bottom.
//!
//! plotters with only its SVG backend: SVG is text (diffable, viewable in any browser and
//! on GitHub), and the backend needs no font files or image libraries (text is placed by
//! plotters' built-in estimate and drawn by the viewer).

// Shared by several examples and tests (`#[path]` includes): each uses part of it.
#![allow(dead_code)]

use std::path::Path;

use plotters::prelude::*;

use crate::report::{format_value, Report, Table, Value};

const WIDTH: u32 = 1100;
const CHART_HEIGHT: u32 = 400;
/// Room on the right of a chart for its legend.
const LEGEND_WIDTH: u32 = 230;

/// Draws every charted table of `report` into the SVG file `path`; returns how many
/// charts it drew.
pub fn write_svg(report: &Report, path: &Path) -> Result<usize, String> {
    let tables: Vec<&Table> = report
        .tables
        .iter()
        .filter(|t| t.chart.is_some() && !t.rows.is_empty())
        .collect();
    let height = CHART_HEIGHT * (tables.len().max(1) as u32);
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    if tables.is_empty() {
        root.draw(&Text::new(
            "no charted tables in this report",
            (20, 20),
            ("sans-serif", 16).into_font(),
        ))
        .map_err(|e| e.to_string())?;
    }
    let areas = root.split_evenly((tables.len().max(1), 1));
    for (area, table) in areas.iter().zip(&tables) {
        draw_table(area, table).map_err(|e| format!("chart of {}: {e}", table.id))?;
    }
    root.present().map_err(|e| e.to_string())?;
    Ok(tables.len())
}

/// One bar: group index, series index, height.
struct Bar {
    group: usize,
    series: usize,
    y: f64,
}

fn draw_table<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    t: &Table,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let c = t.chart.as_ref().ok_or("no chart")?;
    let (xi, si, yi) = (
        t.column(&c.x).ok_or("no x column")?,
        t.column(&c.series).ok_or("no series column")?,
        t.column(&c.y).ok_or("no y column")?,
    );
    let groups = t.distinct(&c.x);
    let series = t.distinct(&c.series);
    let y_unit = t.columns[yi].unit;
    let bars: Vec<Bar> = t
        .rows
        .iter()
        .filter_map(|r| match r[yi] {
            Value::Num(y) if y.is_finite() && (!c.log_y || y > 0.0) => Some(Bar {
                group: groups.iter().position(|g| *g == t.cell(r, &t.columns[xi].key))?,
                series: series.iter().position(|s| *s == t.cell(r, &t.columns[si].key))?,
                y: if c.log_y { y.log10() } else { y },
            }),
            _ => None,
        })
        .collect();
    let (lo, hi) = bars
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), b| {
            (lo.min(b.y), hi.max(b.y))
        });
    let (y0, y1) = match (c.log_y, lo.is_finite()) {
        (_, false) => (0.0, 1.0),
        (true, true) => (lo.floor(), hi.ceil().max(lo.floor() + 1.0)),
        (false, true) => (0.0, (hi * 1.1).max(f64::MIN_POSITIVE)),
    };
    let k = groups.len() as f64;
    // One bar per group when the series is the group itself (a table of allocators).
    let one_per_group = c.x == c.series;
    let slots = if one_per_group { 1 } else { series.len().max(1) };
    let (plot_area, legend_area) = if one_per_group {
        (area.clone(), None)
    } else {
        let (l, r) = area.split_horizontally(area.dim_in_pixel().0.saturating_sub(LEGEND_WIDTH));
        (l, Some(r))
    };
    let mut chart = ChartBuilder::on(&plot_area)
        .caption(&t.title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(80)
        .build_cartesian_2d(-0.5..(k - 0.5), y0..y1)
        .map_err(|e| e.to_string())?;
    let log = c.log_y;
    let x_label = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < groups.len() {
            groups[i as usize].clone()
        } else {
            String::new()
        }
    };
    let y_label = |y: &f64| format_value(&Value::Num(if log { 10f64.powf(*y) } else { *y }), y_unit);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len() * 2 + 1)
        .x_label_formatter(&x_label)
        .y_labels(if log { ((y1 - y0) as usize + 1).max(2) } else { 8 })
        .y_label_formatter(&y_label)
        .y_desc(format!(
            "{}{}",
            t.columns[yi].title,
            if log { " (log scale)" } else { "" }
        ))
        .draw()
        .map_err(|e| e.to_string())?;
    let width = 0.8 / slots as f64;
    for j in 0..series.len() {
        let color = Palette99::pick(j).to_rgba();
        let slot = if one_per_group { 0 } else { j };
        let mine = bars.iter().filter(|b| b.series == j).map(|b| {
            let x = b.group as f64 - 0.4 + width * slot as f64;
            Rectangle::new([(x, y0), (x + width * 0.9, b.y)], color.filled())
        });
        chart.draw_series(mine).map_err(|e| e.to_string())?;
    }
    // The legend beside the chart, where it cannot hide a bar.
    if let Some(legend) = legend_area {
        let font = ("sans-serif", 12).into_font();
        for (j, name) in series.iter().enumerate() {
            let y = 40 + 18 * j as i32;
            let color = Palette99::pick(j).to_rgba();
            legend
                .draw(&Rectangle::new([(6, y), (18, y + 12)], color.filled()))
                .map_err(|e| e.to_string())?;
            legend
                .draw(&Text::new(name.clone(), (24, y), font.clone()))
                .map_err(|e| e.to_string())?;
        }
    }
    Ok(())
}
