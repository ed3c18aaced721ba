//! `memsave`: run YAML benchmark suites of memory-saving strategies.
//!
//! Exit status: 0 when the run finished (failed cases included), 1 when the run as a
//! whole failed (device, output files), 2 for an invalid suite or command line.
use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use memsave_bench::{
    bundled, quiet_case_panics, run_suite_with, write_atomic, write_plots, CaseResult, Observer,
    RunOptions, Suite, SuiteError, BUNDLED,
};
use memsave_meter::Bytes;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "memsave",
    version,
    about = "Measure memory-saving strategies side by side: exact peak and retained bytes, per-layer trace, step time, gradient error"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a suite (default: the bundled seed suite, about 20 s on 2 cores).
    Bench(BenchArgs),
    /// List the bundled suites, or print one (`memsave suites seed`).
    Suites {
        /// A bundled suite to print.
        name: Option<String>,
    },
    /// Validate a suite without running it.
    Check {
        /// The suite file (or the name of a bundled suite).
        suite: String,
    },
}

#[derive(clap::Args)]
struct BenchArgs {
    /// The suite file, or the name of a bundled suite (seed, transformer, quick).
    suite: Option<String>,
    /// Write the results as JSON.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Write the results as CSV (one row per case, no trace).
    #[arg(long, value_name = "PATH")]
    csv: Option<PathBuf>,
    /// Write SVG plots (trace, Pareto front, peaks) into this directory.
    #[arg(long, value_name = "DIR")]
    plot: Option<PathBuf>,
    /// Run only cases whose `model/strategy` matches; opt-in models (enabled: false)
    /// run only when the filter names them, e.g. --filter seed-full.
    #[arg(long, value_name = "REGEX")]
    filter: Option<regex::Regex>,
    /// Measured repeats per case instead of the suite's.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    repeats: Option<u64>,
    /// Warm-up steps per case instead of the suite's.
    #[arg(long)]
    warmup: Option<usize>,
    /// libtorch intra-op threads instead of the suite's.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    threads: Option<u64>,
    /// Simulated device capacity (CPU), e.g. 2GiB, instead of the suite's.
    #[arg(long, value_name = "SIZE")]
    memory_limit: Option<Bytes>,
}

/// Exit status 2: the input is invalid.
struct Invalid(SuiteError);

fn main() -> ExitCode {
    memsave_meter::install();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => bench(args),
        Command::Suites { name } => suites(name.as_deref()),
        Command::Check { suite } => load(&suite).map(|s| {
            println!(
                "{suite}: ok (suite {}, {} models, {} strategies)",
                s.suite,
                s.models.len(),
                s.strategies.len()
            );
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => match e.downcast::<Invalid>() {
            Ok(Invalid(e)) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(1)
            }
        },
    }
}

impl std::fmt::Debug for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Invalid {}

/// A suite from a file, or a bundled one by name when no such file exists.
fn load(name_or_path: &str) -> Result<Suite> {
    let path = PathBuf::from(name_or_path);
    let parsed = match bundled(name_or_path) {
        Some(b) if !path.exists() => Suite::from_yaml(b.source, &b.file_name()),
        _ => Suite::from_file(&path),
    };
    parsed.map_err(|e| Invalid(e).into())
}

fn suites(name: Option<&str>) -> Result<()> {
    if let Some(name) = name {
        let suite = bundled(name).with_context(|| {
            let names: Vec<&str> = BUNDLED.iter().map(|s| s.name).collect();
            format!("no bundled suite '{name}' (bundled: {})", names.join(", "))
        })?;
        print!("{}", suite.source);
        return Ok(());
    }
    for b in BUNDLED {
        let suite = Suite::from_yaml(b.source, &b.file_name()).map_err(Invalid)?;
        let enabled = suite.models.iter().filter(|m| m.enabled).count();
        println!(
            "{:<12} {} models ({} opt-in), {} strategies  {}",
            b.name,
            suite.models.len(),
            suite.models.len() - enabled,
            suite.strategies.len(),
            b.description()
        );
    }
    println!("\nrun one with `memsave bench NAME`, print it with `memsave suites NAME`");
    Ok(())
}

fn bench(args: BenchArgs) -> Result<()> {
    let suite = load(args.suite.as_deref().unwrap_or(BUNDLED[0].name))?;
    let options = RunOptions {
        filter: args.filter,
        repeats: args.repeats.map(|n| n as usize),
        warmup: args.warmup,
        threads: args.threads.map(|n| n as usize),
        memory_limit: args.memory_limit.map(|b| b.0),
    };
    quiet_case_panics();
    let mut progress = Progress::new();
    let report = run_suite_with(&suite, &options, &mut progress)?;
    progress.finish();
    print!("{}", report.to_table());
    if let Some(path) = &args.json {
        write_atomic(path, report.to_json() + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.csv {
        write_atomic(path, report.to_csv())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(dir) = &args.plot {
        let files = write_plots(&report, dir)?;
        eprintln!("wrote {} plots to {}", files.len(), dir.display());
    }
    Ok(())
}

/// A progress bar on a terminal; one line per case otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    done: usize,
    total: usize,
}

impl Progress {
    fn new() -> Self {
        Self {
            bar: None,
            done: 0,
            total: 0,
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Observer for Progress {
    fn started(&mut self, total: usize) {
        self.total = total;
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total as u64);
            bar.set_style(
                ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            self.bar = Some(bar);
        }
    }

    fn case_started(&mut self, model: &str, strategy: &str) {
        if let Some(bar) = &self.bar {
            bar.set_message(format!("{model} / {strategy}"));
        }
    }

    fn case_finished(&mut self, case: &CaseResult) {
        self.done += 1;
        match &self.bar {
            Some(bar) => bar.inc(1),
            None => eprintln!(
                "[{}/{}] {} / {}: {}",
                self.done,
                self.total,
                case.model,
                case.strategy,
                case.status.as_str()
            ),
        }
    }
}
