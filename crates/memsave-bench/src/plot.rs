//! SVG plots of a report, one set per model: the per-layer memory trace of every
//! strategy, peak memory against step time (with the Pareto front), and the peak of
//! every strategy. Files are written atomically.
use crate::atomic::write_atomic;
use crate::report::{CaseResult, Report, Status};
use plotters::coord::ranged1d::SegmentValue;
use plotters::drawing::DrawingAreaErrorKind;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

/// A plot could not be drawn or written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// The chart of this file could not be drawn.
    #[error("{path}: {source}")]
    Draw {
        /// The file it was for.
        path: String,
        /// Why.
        source: DrawError,
    },
    /// The directory could not be made, or the file written.
    #[error("{path}: {source}")]
    Io {
        /// The directory or file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// A chart could not be drawn: plotters' SVG backend failed.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct DrawError(#[from] DrawingAreaErrorKind<std::io::Error>);

const MIB: f64 = 1024.0 * 1024.0;
const SIZE: (u32, u32) = (960, 600);

/// Writes `<model>-trace.svg`, `<model>-pareto.svg` and `<model>-peak.svg` for every
/// model of `report` into `dir` (created if missing); returns the files written.
pub fn write_plots(report: &Report, dir: impl AsRef<Path>) -> Result<Vec<PathBuf>, PlotError> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir).map_err(|source| PlotError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let mut models: Vec<&str> = Vec::new();
    for case in &report.cases {
        if !models.contains(&case.model.as_str()) {
            models.push(&case.model);
        }
    }
    let mut written = Vec::new();
    for model in models {
        let cases: Vec<&CaseResult> = report
            .cases
            .iter()
            .filter(|c| c.model == model && c.status == Status::Ok)
            .collect();
        if cases.is_empty() {
            continue;
        }
        let stem = file_stem(model);
        for (suffix, svg) in [
            ("trace", trace_svg(model, &cases)),
            ("pareto", pareto_svg(model, &cases)),
            ("peak", peak_svg(model, &cases)),
        ] {
            let path = dir.join(format!("{stem}-{suffix}.svg"));
            let svg = svg.map_err(|source| PlotError::Draw {
                path: path.display().to_string(),
                source,
            })?;
            write_atomic(&path, svg).map_err(|source| PlotError::Io {
                path: path.display().to_string(),
                source,
            })?;
            written.push(path);
        }
    }
    Ok(written)
}

/// Keeps letters, digits, `-` and `_` of a model's name for a file name.
fn file_stem(model: &str) -> String {
    model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Memory above the step's start after each layer of the forward, one line per
/// strategy.
fn trace_svg(model: &str, cases: &[&CaseResult]) -> Result<String, DrawError> {
    let series: Vec<(&str, Vec<(f64, f64)>)> = cases
        .iter()
        .filter(|c| !c.trace.is_empty())
        .map(|c| {
            let start = c.start_bytes.unwrap_or(0) as f64;
            let mut points = vec![(0.0, 0.0)];
            points.extend(
                c.trace
                    .iter()
                    .enumerate()
                    .map(|(i, t)| ((i + 1) as f64, (t.after as f64 - start) / MIB)),
            );
            (c.strategy.as_str(), points)
        })
        .collect();
    let layers = series.iter().map(|(_, p)| p.len()).max().unwrap_or(1) as f64 - 1.0;
    let top = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(1.0, f64::max);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("{model}: memory during the forward"),
                ("sans-serif", 22),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..layers.max(1.0), 0.0..top * 1.05)?;
        chart
            .configure_mesh()
            .x_desc("layers done")
            .y_desc("MiB above the step's start")
            .draw()?;
        for (i, (name, points)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))?
                .label(*name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

/// Peak memory against median step time; the front joins the strategies no other
/// beats in both.
fn pareto_svg(model: &str, cases: &[&CaseResult]) -> Result<String, DrawError> {
    let points: Vec<(&str, f64, f64)> = cases
        .iter()
        .filter_map(|c| {
            Some((
                c.strategy.as_str(),
                c.step_time_s?.median,
                c.peak_bytes? as f64 / MIB,
            ))
        })
        .collect();
    let front = pareto_front(&points);
    let max_t = points.iter().map(|p| p.1).fold(1e-6, f64::max);
    let max_m = points.iter().map(|p| p.2).fold(1.0, f64::max);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("{model}: peak memory against step time"),
                ("sans-serif", 22),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..max_t * 1.25, 0.0..max_m * 1.1)?;
        chart
            .configure_mesh()
            .x_desc("step time (s, median)")
            .y_desc("peak MiB above the step's start")
            .draw()?;
        chart
            .draw_series(LineSeries::new(front, RED.stroke_width(1)))?
            .label("Pareto front")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RED));
        chart.draw_series(points.iter().map(|&(name, t, m)| {
            EmptyElement::at((t, m))
                + Circle::new((0, 0), 4, BLUE.filled())
                + Text::new(name.to_owned(), (6, -6), ("sans-serif", 12))
        }))?;
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

/// The points no other point beats in both time and memory, by increasing time.
fn pareto_front(points: &[(&str, f64, f64)]) -> Vec<(f64, f64)> {
    let mut sorted: Vec<(f64, f64)> = points.iter().map(|p| (p.1, p.2)).collect();
    sorted.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
    let mut front: Vec<(f64, f64)> = Vec::new();
    for p in sorted {
        match front.last() {
            Some(last) if p.1 >= last.1 => {}
            _ => front.push(p),
        }
    }
    front
}

/// One horizontal bar per strategy: its peak.
fn peak_svg(model: &str, cases: &[&CaseResult]) -> Result<String, DrawError> {
    let bars: Vec<(&str, f64)> = cases
        .iter()
        .filter_map(|c| Some((c.strategy.as_str(), c.peak_bytes? as f64 / MIB)))
        .collect();
    let n = bars.len() as u32;
    let max_m = bars.iter().map(|b| b.1).fold(1.0, f64::max);
    let names: Vec<String> = bars.iter().map(|b| b.0.to_owned()).collect();
    let label = move |v: &SegmentValue<u32>| match v {
        SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
            names.get(*i as usize).cloned().unwrap_or_default()
        }
        SegmentValue::Last => String::new(),
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("{model}: peak memory per strategy"),
                ("sans-serif", 22),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(220)
            .build_cartesian_2d(0.0..max_m * 1.1, (0..n).into_segmented())?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(n as usize)
            .y_label_formatter(&label)
            .x_desc("peak MiB above the step's start")
            .draw()?;
        chart.draw_series(bars.iter().enumerate().map(|(i, &(_, m))| {
            let i = i as u32;
            Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(i)),
                    (m, SegmentValue::Exact(i + 1)),
                ],
                Palette99::pick(i as usize).filled(),
            )
        }))?;
        root.present()?;
    }
    Ok(svg)
}

/// `memsave fit --plot`: every candidate's predicted step time and peak, the Pareto
/// front, the budget, and the choice.
pub fn fit_svg(report: &memsave_fit::FitReport) -> Result<String, DrawError> {
    let points: Vec<(&str, f64, f64, bool)> = report
        .candidates
        .iter()
        .filter_map(|c| {
            Some((
                c.choice.strategy.as_str(),
                c.predicted_step_time_s?,
                c.predicted_peak_bytes? as f64 / MIB,
                c.choice == report.choice,
            ))
        })
        .collect();
    let front: Vec<(f64, f64)> = report
        .front
        .iter()
        .filter_map(|c| {
            Some((
                c.predicted_step_time_s?,
                c.predicted_peak_bytes? as f64 / MIB,
            ))
        })
        .collect();
    let budget = report.budget_bytes as f64 / MIB;
    let max_t = points.iter().map(|p| p.1).fold(1e-6, f64::max);
    let max_m = points.iter().map(|p| p.2).fold(budget, f64::max);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "{}: fit at {:.1} MiB, global batch {}",
                    report.model, budget, report.global_batch
                ),
                ("sans-serif", 22),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..max_t * 1.25, 0.0..max_m * 1.1)?;
        chart
            .configure_mesh()
            .x_desc("predicted step time (s)")
            .y_desc("predicted peak MiB above parameters and input")
            .draw()?;
        chart
            .draw_series(LineSeries::new(
                vec![(0.0, budget), (max_t * 1.25, budget)],
                BLACK.stroke_width(1),
            ))?
            .label("budget")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLACK));
        chart
            .draw_series(LineSeries::new(front, RED.stroke_width(1)))?
            .label("Pareto front")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], RED));
        chart.draw_series(points.iter().map(|&(name, t, m, chosen)| {
            let color = if chosen {
                GREEN.filled()
            } else {
                BLUE.filled()
            };
            EmptyElement::at((t, m))
                + Circle::new((0, 0), if chosen { 6 } else { 4 }, color)
                + Text::new(name.to_owned(), (6, -6), ("sans-serif", 11))
        }))?;
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn front_keeps_only_undominated_points() {
        let points = [
            ("a", 1.0, 100.0),
            ("b", 2.0, 50.0),
            ("c", 3.0, 60.0),
            ("d", 4.0, 10.0),
        ];
        assert_eq!(
            pareto_front(&points),
            [(1.0, 100.0), (2.0, 50.0), (4.0, 10.0)]
        );
    }

    #[test]
    fn a_directory_that_cannot_be_made_is_an_io_error_naming_it_with_its_cause() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("not-a-directory");
        std::fs::write(&file, b"").unwrap();
        let dir = file.join("plots");
        let report = Report {
            schema_version: crate::report::SCHEMA_VERSION,
            suite: "s".into(),
            device: "cpu".into(),
            libtorch_version: "2".into(),
            threads: 1,
            cases: Vec::new(),
        };
        let e = write_plots(&report, &dir).unwrap_err();
        let shown = dir.display().to_string();
        assert!(
            matches!(&e, PlotError::Io { path, source } if *path == shown
                && source.kind() == std::io::ErrorKind::NotADirectory),
            "{e:?}"
        );
        assert!(e.to_string().starts_with(&format!("{shown}: ")), "{e}");
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn file_stems_are_safe() {
        assert_eq!(file_stem("tiny-gpt/v2 x"), "tiny-gpt_v2_x");
    }
}
