//! `loss.png`: training and validation loss against step, drawn with plotters using an
//! embedded DejaVu Sans (no system fonts are needed at run time).

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use crate::files::metrics::StepMetrics;

static FONT: &[u8] = include_bytes!("../../assets/DejaVuSans.ttf");

/// Draws the curves of `metrics` into `path` (PNG, 1000 x 600).
pub fn plot_losses(metrics: &[StepMetrics], path: &Path, title: &str) -> Result<()> {
    // Registering twice is harmless; plotters keeps the latest.
    register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| anyhow!("the embedded font could not be loaded"))?;
    let train: Vec<(f64, f64)> = metrics.iter().map(|m| (m.step as f64, m.loss)).collect();
    let val: Vec<(f64, f64)> = metrics
        .iter()
        .filter_map(|m| Some((m.step as f64, m.val_loss?)))
        .collect();
    if train.is_empty() {
        return Err(anyhow!("no logged steps to plot"));
    }
    let all = train
        .iter()
        .chain(&val)
        .map(|p| p.1)
        .filter(|y| y.is_finite());
    let (lo, hi) = all.fold((f64::MAX, f64::MIN), |(lo, hi), y| (lo.min(y), hi.max(y)));
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let max_step = train.last().map_or(1.0, |p| p.0).max(1.0);

    let root = BitMapBackend::new(path, (1000, 600)).into_drawing_area();
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("drawing {}: {e:?}", path.display());
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_step, (lo - pad)..(hi + pad))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss (nats/token)")
        .label_style(("sans-serif", 16))
        .draw()
        .map_err(err)?;
    chart
        .draw_series(LineSeries::new(train, BLUE.stroke_width(2)))
        .map_err(err)?
        .label("train")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLUE.stroke_width(2)));
    if !val.is_empty() {
        chart
            .draw_series(LineSeries::new(val.clone(), RED.stroke_width(2)))
            .map_err(err)?
            .label("validation")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
        chart
            .draw_series(val.iter().map(|p| Circle::new(*p, 4, RED.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 16))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
