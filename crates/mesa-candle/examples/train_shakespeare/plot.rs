//! The two figures, drawn with plotters' SVG backend.
use std::path::Path;

use plotters::prelude::*;

use crate::run::{Curves, Estimates, Settings, ESTIMATE_SITES};

type Res = Result<(), Box<dyn std::error::Error>>;

fn bounds(points: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) =
        points.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
    if lo.is_finite() {
        let pad = ((hi - lo) * 0.05).max(1e-3);
        (lo - pad, hi + pad)
    } else {
        (0.0, 1.0)
    }
}

/// Training (left) and validation (right) loss of every run against the step, with the
/// bigram baseline.
pub fn losses(path: &Path, runs: &[Curves<'_>], bigram: f64, s: &Settings) -> Res {
    let root = SVGBackend::new(path, (1100, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 2));
    let x_max = s.steps as f64;
    for (panel, train) in panels.iter().zip([true, false]) {
        let series = |c: &Curves<'_>| if train { c.train.clone() } else { c.val.clone() };
        let (lo, hi) = bounds(runs.iter().flat_map(|c| series(c).into_iter().map(|p| p.1)).chain([bigram]));
        let title = if train { "training loss (mean since the previous point)" } else { "validation loss" };
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(52)
            .build_cartesian_2d(0f64..x_max, lo..hi)?;
        chart.configure_mesh().x_desc("step").y_desc("nats / character").draw()?;
        for (i, c) in runs.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(series(c), color.stroke_width(2)))?
                .label(c.name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        chart
            .draw_series(LineSeries::new([(0.0, bigram), (x_max, bigram)], BLACK.mix(0.5).stroke_width(1)))?
            .label("bigram (validation)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK.mix(0.5)));
        chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
    }
    root.present()?;
    Ok(())
}

/// Mesa's figure of its learnt ranges: the running estimate's offset (EMA of the minimum) and
/// range (EMA of max − min) of the Q and K codes, one line per head, one row per layer.
pub fn estimates(path: &Path, e: &Estimates) -> Res {
    let layers = e.offset.first().and_then(|s| s.first()).map_or(0, Vec::len);
    if layers == 0 || e.steps.is_empty() {
        return Ok(());
    }
    let cols = 2 * ESTIMATE_SITES.len();
    let root = SVGBackend::new(path, (320 * cols as u32, 200 * layers as u32 + 40)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(40);
    title.titled("running estimate of run c (8-bit, momentum 0.9): offset and range per head", ("sans-serif", 18))?;
    let panels = body.split_evenly((layers, cols));
    let x_max = e.steps.last().copied().unwrap_or(1) as f64;
    for l in 0..layers {
        for (si, (_, site)) in ESTIMATE_SITES.iter().enumerate() {
            for (k, (what, data)) in [("offset", &e.offset[si]), ("range", &e.range[si])].into_iter().enumerate() {
                let panel = &panels[l * cols + 2 * si + k];
                let heads = data.first().map_or(0, |r| r[l].len());
                let line = |h: usize| -> Vec<(f64, f64)> {
                    e.steps.iter().zip(data.iter()).map(|(&s, r)| (s as f64, f64::from(r[l][h]))).collect()
                };
                let (lo, hi) = bounds((0..heads).flat_map(|h| line(h).into_iter().map(|p| p.1)));
                let mut chart = ChartBuilder::on(panel)
                    .caption(format!("layer {l} {site} {what}"), ("sans-serif", 14))
                    .margin(6)
                    .x_label_area_size(24)
                    .y_label_area_size(44)
                    .build_cartesian_2d(0f64..x_max, lo..hi)?;
                chart.configure_mesh().x_labels(4).y_labels(5).draw()?;
                for h in 0..heads {
                    let color = Palette99::pick(h).to_rgba();
                    chart
                        .draw_series(LineSeries::new(line(h), color.stroke_width(2)))?
                        .label(format!("head {h}"))
                        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2)));
                }
                if l == 0 && si == 0 && k == 0 {
                    chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
                }
            }
        }
    }
    root.present()?;
    Ok(())
}
