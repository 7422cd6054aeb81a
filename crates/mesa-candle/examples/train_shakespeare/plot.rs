//! The three figures, drawn with plotters' SVG backend; every legend sits in its own column,
//! off the data.
use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::parity::Parity;
use crate::report;
use crate::run::{Estimates, RunResult, Settings, Variant};

type Res = Result<(), Box<dyn std::error::Error>>;
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

fn bounds(points: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) =
        points.filter(|v| v.is_finite()).fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| (l.min(v), h.max(v)));
    if lo.is_finite() {
        let pad = ((hi - lo) * 0.05).max(1e-4);
        (lo - pad, hi + pad)
    } else {
        (0.0, 1.0)
    }
}

/// A legend drawn in its own area: a short line of each entry's colour and its label.
fn legend(area: &Area<'_>, entries: &[(String, RGBAColor)]) -> Res {
    for (i, (label, color)) in entries.iter().enumerate() {
        let y = 40 + 22 * i as i32;
        area.draw(&PathElement::new(vec![(8, y), (34, y)], color.stroke_width(3)))?;
        area.draw(&Text::new(label.clone(), (40, y - 7), ("sans-serif", 14)))?;
    }
    Ok(())
}

fn color(i: usize) -> RGBAColor {
    Palette99::pick(i).to_rgba()
}

/// Left: validation loss of each variant (mean over the seeds) and the bigram baseline;
/// right: each compressed variant minus its f32 baseline, paired by seed, mean ± one
/// standard error.
pub fn losses(path: &Path, s: &Settings, variants: &[Variant], results: &[RunResult], bigram: f64) -> Res {
    let root = SVGBackend::new(path, (1300, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let (plots, key) = root.split_horizontally(1080);
    let panels = plots.split_evenly((1, 2));
    let x_max = s.steps as f64;
    let mut entries = Vec::new();
    // validation loss
    let curves: Vec<Vec<(f64, f64)>> = variants.iter().map(|v| report::mean_curve(results, v)).collect();
    let (lo, hi) = bounds(curves.iter().flat_map(|c| c.iter().map(|p| p.1)).chain([bigram]));
    let mut chart = ChartBuilder::on(&panels[0])
        .caption(format!("validation loss, mean over {} seeds", s.seeds.len()), ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, lo..hi)?;
    chart.configure_mesh().x_desc("training step").y_desc("nats / character").draw()?;
    for (i, (v, c)) in variants.iter().zip(&curves).enumerate() {
        chart.draw_series(LineSeries::new(c.iter().copied(), color(i).stroke_width(2)))?;
        chart.draw_series(c.iter().map(|&p| Circle::new(p, 3, color(i).filled())))?;
        entries.push((format!("{} ({}, {})", v.name, v.saved_precision(), v.attention()), color(i)));
    }
    let grey = BLACK.mix(0.5);
    chart.draw_series(LineSeries::new([(0.0, bigram), (x_max, bigram)], grey.stroke_width(1)))?;
    entries.push(("bigram (validation)".into(), grey));
    // paired differences
    let diffs: Vec<(usize, Vec<report::DiffPoint>)> =
        variants.iter().enumerate().map(|(i, v)| (i, report::difference_curve(results, s, v))).collect();
    let (lo, hi) = bounds(
        diffs.iter().flat_map(|(_, d)| d.iter().flat_map(|p| [p.1 - p.2.max(0.0), p.1 + p.2.max(0.0), p.1])).chain([
            0.0,
            -report::MIN_EFFECT,
            report::MIN_EFFECT,
        ]),
    );
    let mut chart = ChartBuilder::on(&panels[1])
        .caption("minus the f32 baseline (paired by seed), mean ± SE", ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, lo..hi)?;
    chart.configure_mesh().x_desc("training step").y_desc("Δ validation loss, nats / character").draw()?;
    for m in [-report::MIN_EFFECT, 0.0, report::MIN_EFFECT] {
        let style = if m == 0.0 { BLACK.stroke_width(1) } else { grey.stroke_width(1) };
        chart.draw_series(LineSeries::new([(0.0, m), (x_max, m)], style))?;
    }
    for (i, d) in &diffs {
        if d.is_empty() {
            continue;
        }
        let c = color(*i);
        chart.draw_series(LineSeries::new(d.iter().map(|p| (p.0, p.1)), c.stroke_width(2)))?;
        chart.draw_series(
            d.iter().filter(|p| p.2.is_finite()).map(|p| PathElement::new(vec![(p.0, p.1 - p.2), (p.0, p.1 + p.2)], c)),
        )?;
    }
    entries.push((format!("±{} (smallest effect)", report::MIN_EFFECT), grey));
    legend(&key, &entries)?;
    root.present()?;
    Ok(())
}

/// Gradient parity: the worst parameter's cosine and relative error at each probe, one line
/// per probed configuration.
pub fn parity(path: &Path, p: &Parity, s: &Settings) -> Res {
    let root = SVGBackend::new(path, (1300, 460)).into_drawing_area();
    root.fill(&WHITE)?;
    let (plots, key) = root.split_horizontally(1080);
    let panels = plots.split_evenly((1, 2));
    let x_max = s.steps as f64;
    let steps: Vec<f64> = p.steps.iter().map(|&x| x as f64).collect();
    let worst: Vec<Vec<(f64, f64)>> = p
        .series
        .iter()
        .map(|se| (0..steps.len()).map(|i| (se.worst(i).cosine, se.worst(i).rel_err)).collect())
        .collect();
    for (k, panel) in panels.iter().enumerate() {
        let value = |w: &(f64, f64)| if k == 0 { 1.0 - w.0 } else { w.1 };
        let (lo, hi) = bounds(worst.iter().flatten().map(value).map(|x| x.max(1e-6).log10()));
        let (title, y) = if k == 0 {
            ("1 − cosine of the worst parameter's gradient", "log₁₀(1 − cosine)")
        } else {
            ("relative error ‖ĝ − g‖/‖g‖ of the worst parameter", "log₁₀ relative error")
        };
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, lo..hi)?;
        chart.configure_mesh().x_desc(format!("training step of run {}", p.run)).y_desc(y).draw()?;
        for (i, w) in worst.iter().enumerate() {
            let pts = steps.iter().zip(w).map(|(&x, w)| (x, value(w).max(1e-6).log10()));
            chart.draw_series(LineSeries::new(pts, color(i).stroke_width(2)))?;
        }
    }
    let entries: Vec<(String, RGBAColor)> = p.series.iter().enumerate().map(|(i, se)| (se.label(), color(i))).collect();
    legend(&key, &entries)?;
    root.present()?;
    Ok(())
}

/// Mesa's figure of its learnt ranges: the running estimate's offset (EMA of the minimum)
/// and range (EMA of max − min) of every coded tensor, one line per group (head), one row
/// per tensor, one column pair per layer.
pub fn estimates(path: &Path, e: &Estimates) -> Res {
    let layers = e.offset.first().and_then(|s| s.first()).map_or(0, Vec::len);
    if layers == 0 || e.steps.is_empty() {
        return Ok(());
    }
    let cols = 2 * layers;
    let rows = e.sites.len();
    let root = SVGBackend::new(path, (300 * cols as u32 + 140, 190 * rows as u32 + 40)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(40);
    title.titled(
        &format!("running estimate of run {} (momentum 0.9): offset and range per group (head)", e.run),
        ("sans-serif", 18),
    )?;
    let (grid, key) = body.split_horizontally(300 * cols as u32);
    let panels = grid.split_evenly((rows, cols));
    let x_max = e.steps.last().copied().unwrap_or(1) as f64;
    let mut groups = 0;
    for (si, site) in e.sites.iter().enumerate() {
        for l in 0..layers {
            for (k, (what, data)) in [("offset", &e.offset[si]), ("range", &e.range[si])].into_iter().enumerate() {
                let panel = &panels[si * cols + 2 * l + k];
                let heads = data.first().map_or(0, |r| r[l].len());
                groups = groups.max(heads);
                let line = |h: usize| -> Vec<(f64, f64)> {
                    e.steps.iter().zip(data.iter()).map(|(&s, r)| (s as f64, f64::from(r[l][h]))).collect()
                };
                let (lo, hi) = bounds((0..heads).flat_map(|h| line(h).into_iter().map(|p| p.1)));
                let mut chart = ChartBuilder::on(panel)
                    .caption(format!("{site:?}, layer {l}: {what}"), ("sans-serif", 13))
                    .margin(6)
                    .x_label_area_size(26)
                    .y_label_area_size(46)
                    .build_cartesian_2d(0f64..x_max, lo..hi)?;
                chart.configure_mesh().x_labels(4).y_labels(5).x_desc("step").draw()?;
                for h in 0..heads {
                    chart.draw_series(LineSeries::new(line(h), color(h).stroke_width(2)))?;
                }
            }
        }
    }
    let entries: Vec<(String, RGBAColor)> = (0..groups).map(|h| (format!("group {h}"), color(h))).collect();
    legend(&key, &entries)?;
    root.present()?;
    Ok(())
}

/// `--tp`: the training loss of every step on one rank and on `t` ranks, one column per
/// variant (top: the losses, the single-rank run wide and pale, the `t`-rank run thin on
/// top; bottom: their relative difference, log scale, zeros drawn at the floor).
pub fn losses_tp(path: &Path, s: &Settings, pairs: &[crate::tp::Pair]) -> Res {
    let mut variants: Vec<&'static str> = Vec::new();
    for p in pairs {
        if !variants.contains(&p.variant) {
            variants.push(p.variant);
        }
    }
    let t = pairs.first().map_or(0, |p| p.tp);
    let cols = variants.len().max(1);
    let root = SVGBackend::new(path, (520 * cols as u32 + 240, 760)).into_drawing_area();
    root.fill(&WHITE)?;
    let (plots, key) = root.split_horizontally(520 * cols as u32);
    let panels = plots.split_evenly((2, cols));
    let x_max = s.steps as f64;
    let floor = 1e-9;
    let mut seeds: Vec<u64> = Vec::new();
    for p in pairs {
        if !seeds.contains(&p.seed) {
            seeds.push(p.seed);
        }
    }
    for (k, v) in variants.iter().enumerate() {
        let mine: Vec<&crate::tp::Pair> = pairs.iter().filter(|p| p.variant == *v).collect();
        let (lo, hi) = bounds(mine.iter().flat_map(|p| p.losses_1.iter().chain(&p.losses_t).copied()));
        let mut chart = ChartBuilder::on(&panels[k])
            .caption(format!("run {v}: training loss per step, t = 1 and t = {t}"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, lo..hi)?;
        chart.configure_mesh().x_desc("training step").y_desc("nats / character").draw()?;
        for p in &mine {
            let c = color(seeds.iter().position(|&x| x == p.seed).unwrap_or(0));
            let line = |l: &[f64]| l.iter().enumerate().map(|(i, &y)| ((i + 1) as f64, y)).collect::<Vec<_>>();
            chart.draw_series(LineSeries::new(line(&p.losses_1), c.mix(0.3).stroke_width(5)))?;
            chart.draw_series(LineSeries::new(line(&p.losses_t), c.stroke_width(1)))?;
        }
        let hi_rel = mine.iter().flat_map(|p| p.rel.iter().copied()).fold(crate::tp::TARGET_REL * 10.0, f64::max) * 2.0;
        let mut chart = ChartBuilder::on(&panels[cols + k])
            .caption(format!("run {v}: |loss(t = {t}) − loss(t = 1)| / loss(t = 1)"), ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, (floor..hi_rel).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("training step")
            .y_desc("relative difference (0 drawn at 1e-9)")
            .y_label_formatter(&|v| format!("{v:.0e}"))
            .draw()?;
        chart.draw_series(LineSeries::new(
            [(0.0, crate::tp::TARGET_REL), (x_max, crate::tp::TARGET_REL)],
            BLACK.stroke_width(2),
        ))?;
        for p in &mine {
            let c = color(seeds.iter().position(|&x| x == p.seed).unwrap_or(0));
            let pts = p.rel.iter().enumerate().map(|(i, &r)| ((i + 1) as f64, r.max(floor)));
            chart.draw_series(pts.map(|q| Circle::new(q, 2, c.filled())))?;
        }
    }
    let mut entries = Vec::new();
    for (i, seed) in seeds.iter().enumerate() {
        entries.push((format!("seed {seed}, t = 1 (wide)"), color(i).mix(0.3)));
        entries.push((format!("seed {seed}, t = {t} (thin)"), color(i)));
    }
    entries.push((format!("{:.0e} (target)", crate::tp::TARGET_REL), BLACK.to_rgba()));
    legend(&key, &entries)?;
    root.present()?;
    Ok(())
}
