//! The pipeline's overlap as a picture: one lane per stream (and one for the host's fill),
//! each batch's H2D copy, kernel and D2H copy a coloured bar from the timed events the
//! pipeline records anyway, so a reader sees at a glance where a stream waits.
//!
//! Drawn with plotters' SVG backend, as the report's charts are (`plot.rs`): one panel per
//! measured row, stacked top to bottom, under a legend. The lane names are drawn beside
//! the lanes (not as axis labels, which plotters places where its tick algorithm wants).

// Shared by several examples and tests (`#[path]` includes): each uses part of it.
#![allow(dead_code)]

use std::path::Path;

use plotters::prelude::*;

const WIDTH: u32 = 1100;
/// Room on the left of a panel for the lane names.
const LABEL_WIDTH: u32 = 110;
const LANE_HEIGHT: u32 = 22;
/// A panel's caption, time axis and margins.
const PANEL_CHROME: u32 = 78;
const LEGEND_HEIGHT: u32 = 34;

/// What a bar stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    H2D,
    Kernel,
    D2H,
    /// The host writing a batch's input (on the host's clock, see [`Span`]).
    Fill,
}

impl SpanKind {
    pub const ALL: [SpanKind; 4] = [SpanKind::H2D, SpanKind::Kernel, SpanKind::D2H, SpanKind::Fill];

    pub fn name(self) -> &'static str {
        match self {
            SpanKind::H2D => "H2D copy",
            SpanKind::Kernel => "kernel",
            SpanKind::D2H => "D2H copy",
            SpanKind::Fill => "host fill",
        }
    }

    /// The bar's colour (also its legend swatch's).
    pub fn color(self) -> RGBColor {
        match self {
            SpanKind::H2D => RGBColor(0x1f, 0x77, 0xb4),
            SpanKind::Kernel => RGBColor(0x2c, 0xa0, 0x2c),
            SpanKind::D2H => RGBColor(0xd6, 0x27, 0x28),
            SpanKind::Fill => RGBColor(0x9a, 0x6f, 0x2e),
        }
    }
}

/// One bar: `lane` of the timeline, from `start_ms` to `end_ms` after the run's start
/// event. GPU spans come from event pairs (`cuEventElapsedTime` against the start event);
/// host spans from the host's clock, taken right after the start event was queued on an
/// idle stream (so the two clocks agree to within the event's launch latency, microseconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub lane: usize,
    pub kind: SpanKind,
    pub batch: usize,
    pub start_ms: f64,
    pub end_ms: f64,
}

/// One run drawn as lanes of bars.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// The panel's caption.
    pub title: String,
    /// The lanes' names, top to bottom: the streams, then the host.
    pub lanes: Vec<String>,
    pub spans: Vec<Span>,
}

impl Timeline {
    /// When the last bar ends, in ms.
    pub fn end_ms(&self) -> f64 {
        self.spans.iter().fold(0.0f64, |a, s| a.max(s.end_ms))
    }

    fn height(&self) -> u32 {
        PANEL_CHROME + LANE_HEIGHT * self.lanes.len().max(1) as u32
    }
}

/// The timelines as one SVG document (text).
pub fn svg(timelines: &[Timeline]) -> Result<String, String> {
    let height = LEGEND_HEIGHT + timelines.iter().map(Timeline::height).sum::<u32>().max(40);
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| e.to_string())?;
        let (legend, mut rest) = root.split_vertically(LEGEND_HEIGHT);
        draw_legend(&legend)?;
        if timelines.is_empty() {
            rest.draw(&Text::new(
                "no timed rows to draw",
                (20, 20),
                ("sans-serif", 16).into_font(),
            ))
            .map_err(|e| e.to_string())?;
        }
        for t in timelines {
            let (panel, below) = rest.split_vertically(t.height());
            draw_panel(&panel, t).map_err(|e| format!("timeline of {}: {e}", t.title))?;
            rest = below;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// Writes [`svg`] of `timelines` to `path`.
pub fn write_svg(timelines: &[Timeline], path: &Path) -> Result<(), String> {
    std::fs::write(path, svg(timelines)?).map_err(|e| e.to_string())
}

fn draw_legend<DB: DrawingBackend>(area: &DrawingArea<DB, plotters::coord::Shift>) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let font = ("sans-serif", 13).into_font();
    for (j, kind) in SpanKind::ALL.into_iter().enumerate() {
        let x = LABEL_WIDTH as i32 + 130 * j as i32;
        area.draw(&Rectangle::new([(x, 12), (x + 14, 24)], kind.color().filled()))
            .map_err(|e| e.to_string())?;
        area.draw(&Text::new(kind.name(), (x + 20, 11), font.clone()))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// A light band behind every other lane, so bars read as rows.
const BAND: RGBColor = RGBColor(0xf0, 0xf0, 0xf0);

fn draw_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    t: &Timeline,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let lanes = t.lanes.len().max(1);
    let (labels, plot) = area.split_horizontally(LABEL_WIDTH);
    let x_max = (t.end_ms() * 1.02).max(1e-3);
    let mut chart = ChartBuilder::on(&plot)
        .caption(&t.title, ("sans-serif", 14))
        .margin(8)
        .x_label_area_size(30)
        .build_cartesian_2d(0.0..x_max, 0.0..lanes as f64)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .disable_mesh()
        .disable_y_axis()
        .x_labels(12)
        .x_label_formatter(&|x: &f64| format!("{x:.0}"))
        .x_desc("ms since the run's start event")
        .draw()
        .map_err(|e| e.to_string())?;
    // Lane i is the band lanes-1-i .. lanes-i (the first lane on top).
    let row = |lane: usize| (lanes - 1 - lane.min(lanes - 1)) as f64;
    chart
        .draw_series((0..lanes).filter(|i| i % 2 == 0).map(|i| {
            let y = row(i);
            Rectangle::new([(0.0, y), (x_max, y + 1.0)], BAND.filled())
        }))
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(t.spans.iter().map(|s| {
            let y = row(s.lane);
            // At least a hair wide, so a short span still shows.
            let end = s.end_ms.max(s.start_ms + x_max * 1e-4);
            Rectangle::new([(s.start_ms, y + 0.15), (end, y + 0.85)], s.kind.color().filled())
        }))
        .map_err(|e| e.to_string())?;
    let font = ("sans-serif", 12).into_font();
    let base = labels.get_base_pixel();
    for (i, name) in t.lanes.iter().enumerate() {
        let (_, y) = chart.backend_coord(&(0.0, row(i) + 0.5));
        labels
            .draw(&Text::new(name.clone(), (6, y - base.1 - 6), font.clone()))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}
