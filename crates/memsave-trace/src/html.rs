//! A self-contained HTML page of a trace: inline SVG and CSS, no script, no network.
use crate::category::{Category, Phase};
use crate::trace::Trace;
use memsave_meter::Bytes;
use std::fmt::Write;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 340.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 24.0;
const BOTTOM: f64 = 36.0;

fn color(category: Category) -> &'static str {
    match category {
        Category::Parameter => "#4e79a7",
        Category::Gradient => "#f28e2b",
        Category::OptimizerState => "#b07aa1",
        Category::SavedActivation => "#e15759",
        Category::Recompute => "#edc948",
        Category::Temporary => "#76b7b2",
        Category::Input => "#59a14f",
        Category::Other => "#bab0ac",
    }
}

fn phase_color(phase: Phase) -> &'static str {
    match phase {
        Phase::Forward => "#eef4fb",
        Phase::Backward => "#fdf0e6",
        Phase::Optimizer => "#f3ecf6",
        Phase::Other => "#ffffff",
    }
}

/// Escapes text for HTML and SVG.
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Trace {
    /// A self-contained HTML page: a stacked-area timeline of the bytes per category
    /// at every event, with the phases as background bands and the peak marked, and a
    /// table of the `top` largest storages live at the peak (role, such as
    /// `saved_activation of AddmmBackward0`, the aten op that saved it, mark).
    ///
    /// The page loads nothing: its Content-Security-Policy is `default-src 'none'`
    /// and it has no script, so it opens offline and in locked-down viewers.
    pub fn to_html(&self, title: &str, top: usize) -> String {
        let mut out = String::new();
        let title = escape(title);
        let _ = write!(
            out,
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
             <meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">\n\
             <title>{title}</title>\n<style>\n\
             body {{ font-family: sans-serif; margin: 24px; color: #222; }}\n\
             table {{ border-collapse: collapse; }}\n\
             th, td {{ padding: 3px 10px; border-bottom: 1px solid #ddd; text-align: left; }}\n\
             td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}\n\
             .swatch {{ display: inline-block; width: 12px; height: 12px; margin: 0 4px 0 12px; vertical-align: middle; }}\n\
             pre {{ background: #f6f6f6; padding: 8px; }}\n\
             </style>\n</head>\n<body>\n<h1>{title}</h1>\n"
        );
        // Inline SVG needs no namespace: the page names no URL at all.
        out.push_str(
            &self
                .timeline_svg()
                .replacen(" xmlns=\"http://www.w3.org/2000/svg\"", "", 1),
        );
        out.push_str("<p id=\"legend\">");
        for c in Category::ALL {
            let _ = write!(
                out,
                "<span class=\"swatch\" style=\"background:{}\"></span>{}",
                color(c),
                c.as_str()
            );
        }
        out.push_str("</p>\n");
        out.push_str(&self.top_table(top));
        let _ = write!(
            out,
            "<h2>Summary</h2>\n<pre id=\"summary\">{}</pre>\n</body>\n</html>\n",
            escape(&self.summary(0))
        );
        out
    }

    /// The timeline as an inline SVG (`id="timeline"`).
    pub fn timeline_svg(&self) -> String {
        let mut svg = String::new();
        let _ = write!(
            svg,
            "<svg id=\"timeline\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{HEIGHT}\" \
             viewBox=\"0 0 {WIDTH} {HEIGHT}\" font-family=\"sans-serif\" font-size=\"11\">\n\
             <rect width=\"{WIDTH}\" height=\"{HEIGHT}\" fill=\"white\"/>\n"
        );
        // The storages live at the start enter the stream one event each; the plot
        // starts from the state they add up to.
        let first = self.initial_events.saturating_sub(1);
        let timeline = &self.timeline()[first..];
        let events = &self.events[first..];
        let n = timeline.len();
        let peak = self.peak_bytes().max(1);
        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let x = |i: usize| LEFT + plot_w * i as f64 / (n.max(2) - 1) as f64;
        let y = |b: u64| TOP + plot_h * (1.0 - b as f64 / peak as f64);
        // Phase bands.
        let mut start = 0;
        while start < n {
            let phase = events[start].phase;
            let end = (start..n).find(|&i| events[i].phase != phase).unwrap_or(n);
            let _ = write!(
                svg,
                "<rect class=\"phase\" x=\"{:.1}\" y=\"{TOP}\" width=\"{:.1}\" height=\"{plot_h}\" fill=\"{}\"><title>{phase}</title></rect>\n\
                 <text x=\"{:.1}\" y=\"{:.1}\" fill=\"#777\">{phase}</text>\n",
                x(start),
                (x(end.saturating_sub(1).max(start)) - x(start)).max(1.0),
                phase_color(phase),
                x(start) + 3.0,
                TOP - 6.0
            );
            start = end;
        }
        // Stacked areas, one polygon per category.
        let mut below = vec![0u64; n];
        for c in Category::ALL {
            if timeline.iter().all(|t| t[c] == 0) {
                continue;
            }
            let above: Vec<u64> = below.iter().zip(timeline).map(|(b, t)| b + t[c]).collect();
            let mut points = String::new();
            for (i, &v) in above.iter().enumerate() {
                let _ = write!(points, "{:.1},{:.1} ", x(i), y(v));
            }
            for (i, &v) in below.iter().enumerate().rev() {
                let _ = write!(points, "{:.1},{:.1} ", x(i), y(v));
            }
            let _ = writeln!(
                svg,
                "<polygon class=\"area\" data-category=\"{c}\" points=\"{}\" fill=\"{}\" fill-opacity=\"0.85\"><title>{c}</title></polygon>",
                points.trim_end(),
                color(c)
            );
            below = above;
        }
        // Axes and the peak.
        let _ = write!(
            svg,
            "<line x1=\"{LEFT}\" y1=\"{0}\" x2=\"{1}\" y2=\"{0}\" stroke=\"#333\"/>\n\
             <line x1=\"{LEFT}\" y1=\"{TOP}\" x2=\"{LEFT}\" y2=\"{0}\" stroke=\"#333\"/>\n\
             <text x=\"{2}\" y=\"{3}\" text-anchor=\"middle\">allocations and frees during the step, in order</text>\n",
            TOP + plot_h,
            LEFT + plot_w,
            LEFT + plot_w / 2.0,
            HEIGHT - 8.0
        );
        for frac in [0.0, 0.5, 1.0] {
            let bytes = (peak as f64 * frac) as u64;
            let _ = writeln!(
                svg,
                "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                LEFT - 6.0,
                y(bytes) + 4.0,
                Bytes(bytes)
            );
        }
        if let Some(p) = self.peak_event().map(|p| p.saturating_sub(first)) {
            let _ = write!(
                svg,
                "<line id=\"peak\" x1=\"{0:.1}\" y1=\"{TOP}\" x2=\"{0:.1}\" y2=\"{1}\" stroke=\"#c00\" stroke-dasharray=\"4 3\"/>\n\
                 <text x=\"{2:.1}\" y=\"{3:.1}\" fill=\"#c00\">peak {4}</text>\n",
                x(p),
                TOP + plot_h,
                x(p) + 4.0,
                TOP + 12.0,
                Bytes(self.peak_bytes())
            );
        }
        svg.push_str("</svg>\n");
        svg
    }

    fn top_table(&self, top: usize) -> String {
        let mut out = String::new();
        let Some(peak) = self.peak_event() else {
            return "<p>Nothing was allocated.</p>\n".to_owned();
        };
        let _ = write!(
            out,
            "<h2>Largest tensors live at the peak ({})</h2>\n<table id=\"top-tensors\">\n\
             <tr><th>#</th><th>bytes</th><th>role</th><th>saved during</th><th>mark</th><th>allocated in</th></tr>\n",
            Bytes(self.peak_bytes())
        );
        for (i, b) in self.live_after(peak).iter().take(top).enumerate() {
            let _ = writeln!(
                out,
                "<tr><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                i + 1,
                Bytes(b.bytes),
                escape(&b.role()),
                escape(b.saved_by.as_deref().unwrap_or("-")),
                escape(b.mark.as_deref().unwrap_or("-")),
                if b.alloc_event.is_some() { b.phase.as_str() } else { "before the recording" }
            );
        }
        out.push_str("</table>\n");
        out
    }
}
