//! `memsave`: run YAML benchmark suites of memory-saving strategies.
//!
//! Exit status: 0 when the run finished (for `bench`, failed cases included: they are
//! results), 1 when the run as a whole failed (device, writing the results, the step
//! `trace` records, `fit` finding nothing or refusing a model too large for the budget
//! or the memory), 2 for an invalid suite or command line (including an output path
//! that cannot be written, found before anything runs, a `--global-batch` over a
//! suite's limits, and for `check` a strategy `bench` would report unavailable).
//! Errors are one line on stderr: libtorch's C++ frames are cut and a panic is
//! reported without Rust's backtrace.
//!
//! A suite argument is a bundled suite's name (`seed`, `quick`, ...) or a path. It is
//! a path when it contains a `/` or ends in `.yaml`/`.yml`; otherwise it is the
//! bundled suite of that name if there is one, unless a *file* of that name exists,
//! which is an error naming both (write `./NAME` for the file). A directory of that
//! name does not count: `memsave bench quick` next to a directory `quick/` runs the
//! bundled suite and says so.
use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use memsave_bench::{
    bundled, run_suite_with, write_atomic, write_plots, CaseResult, Observer, Rounds, RunOptions,
    Suite, BUNDLED,
};
use memsave_meter::Bytes;
use std::io::IsTerminal;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;

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
    /// Run a suite (default: the bundled seed suite, about 75 s on 2 cores).
    Bench(BenchArgs),
    /// List the bundled suites, or print one (`memsave suites seed`).
    Suites {
        /// A bundled suite to print.
        name: Option<String>,
    },
    /// Record one case allocation by allocation: bytes by category (parameter,
    /// gradient, saved_activation, ...), op and layer; HTML timeline, PyTorch snapshot.
    Trace(TraceArgs),
    /// The fastest configuration of a suite's model whose peak fits a byte budget,
    /// with the global batch kept: micro-batches, recompute, offload, optimizer step
    /// in backward (and, with --allow, bf16, compression, 8-bit optimizer state).
    Fit(FitArgs),
    /// Validate a suite without running it.
    Check {
        /// The suite file (or the name of a bundled suite).
        suite: String,
    },
    /// Start N ranks of a distributed program on this machine (the `torchrun` of
    /// memsave): `memsave launch -n 4 -- ./train --epochs 2`.
    Launch(LaunchArgs),
    /// One rank of one case of a suite with `world_size` (started by `memsave bench`
    /// through the launcher; not for direct use).
    #[command(hide = true)]
    Rank(RankCli),
    /// One rank of `memsave fit --world-size N` (started through the launcher; not for
    /// direct use): the suite and the request are in DIR.
    #[command(hide = true)]
    FitRank {
        /// The directory `memsave fit` prepared.
        dir: PathBuf,
    },
}

#[derive(clap::Args)]
struct RankCli {
    /// The suite file.
    suite: PathBuf,
    #[arg(long)]
    model: String,
    #[arg(long)]
    strategy: String,
    #[arg(long)]
    out_dir: PathBuf,
    #[arg(long)]
    warmup: Option<usize>,
    #[arg(long)]
    repeats: Option<usize>,
    #[arg(long)]
    threads: Option<usize>,
    /// Memory limit in bytes instead of the suite's.
    #[arg(long)]
    memory_limit: Option<u64>,
    /// Record one step (rank 0) instead of measuring, listing this many tensors.
    #[arg(long)]
    trace_top: Option<usize>,
    #[arg(long, default_value = "")]
    trace_title: String,
    #[arg(long)]
    trace_html: bool,
    #[arg(long)]
    trace_snapshot: bool,
    #[arg(long)]
    trace_svg: bool,
}

#[derive(clap::Args)]
struct LaunchArgs {
    /// Processes on this node (at most 1024, and no more than the limits on open
    /// files and processes allow). With more than one, each rank gets
    /// OMP_NUM_THREADS=1 unless it is set (as torchrun does).
    #[arg(short = 'n', long = "nproc-per-node", default_value_t = 1)]
    nproc_per_node: usize,
    /// Number of nodes; run the same command on each, with its --node-rank.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// This node's index, 0 on the node that serves the rendezvous store.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// Address of node 0, reachable from every node.
    #[arg(long, default_value = "127.0.0.1")]
    master_addr: String,
    /// Port of the rendezvous store on node 0 (default, or 0: a free port; required,
    /// and not 0, with several nodes).
    #[arg(long)]
    master_port: Option<u16>,
    /// End every rank and fail after this many seconds (at least 1).
    #[arg(long, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    timeout: Option<u64>,
    /// The program and its arguments.
    #[arg(required = true, last = true)]
    command: Vec<std::ffi::OsString>,
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
    /// Timed steps per case instead of the suite's `repeats`: the least number of
    /// rounds, each timing every strategy of a model once (distributed cases: back to
    /// back, exactly this many). From 3, rounds are added until every median is
    /// steady (see --target-spread); 1 or 2 are a quick look, run as given.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    repeats: Option<u64>,
    /// Add rounds until every strategy's median step time is within this spread, in
    /// percent: half the width of the median's 95% confidence interval (order
    /// statistics, known from 6 rounds), over the median; printed as ±. 0: no rounds
    /// past --repeats.
    #[arg(long, value_name = "PERCENT", default_value = "2", value_parser = parse_percent)]
    target_spread: f64,
    /// The most timed rounds of a model, however large the spread.
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = clap::value_parser!(u64).range(1..=1000))]
    max_rounds: u64,
    /// No round is added once a model's timed rounds have taken this many seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 60.0, value_parser = parse_seconds)]
    max_rounds_time: f64,
    /// Warm-up steps per case instead of the suite's.
    #[arg(long)]
    warmup: Option<usize>,
    /// libtorch intra-op threads instead of the suite's.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    threads: Option<u64>,
    /// Simulated device capacity (CPU), e.g. 2GiB, instead of the suite's; positive,
    /// like the suite's `memory_limit`.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory_limit)]
    memory_limit: Option<Bytes>,
    /// Run every case on N ranks (local processes) instead of the suite's `world_size`.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=64))]
    world_size: Option<u64>,
}

#[derive(clap::Args)]
struct TraceArgs {
    /// The suite file, or the name of a bundled suite.
    suite: String,
    /// The model to trace (a name from the suite).
    #[arg(long)]
    model: String,
    /// The strategy to trace (a name from the suite, e.g. 'checkpoint(segments=3)').
    #[arg(long)]
    strategy: String,
    /// Write a self-contained HTML page: timeline by category, largest tensors at the peak.
    #[arg(long, value_name = "PATH")]
    html: Option<PathBuf>,
    /// Write PyTorch's memory snapshot (pickle) for `python -m torch.cuda._memory_viz`.
    #[arg(long, value_name = "PATH")]
    snapshot: Option<PathBuf>,
    /// Write the timeline alone as an SVG picture.
    #[arg(long, value_name = "PATH")]
    svg: Option<PathBuf>,
    /// How many of the largest tensors live at the peak to list.
    #[arg(long, default_value_t = 10)]
    top: usize,
}

#[derive(clap::Args)]
struct FitArgs {
    /// The suite file, or the name of a bundled suite.
    suite: String,
    /// The model to fit (a name from the suite).
    #[arg(long)]
    model: String,
    /// The most bytes the device holds at any moment of a step, e.g. 24MiB: the whole
    /// device, counting the parameters, the optimizer's state, the input, the
    /// gradients, activations and workspace (with --world-size, per rank). Not counted:
    /// the copy of the weights fit keeps to put them back after each run. Note that
    /// `bench`'s peak is above the parameters, the input and the optimizer's state:
    /// add them to turn one into the other (the report's breakdown gives them). With an
    /// optimizer on one process, the state and then the parameters themselves may wait
    /// in files (see --no-offload-params), so a budget below them can fit.
    #[arg(long, value_name = "SIZE", value_parser = parse_memory_limit)]
    budget: Bytes,
    /// Examples per optimizer step (default: the model's batch in the suite).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(i64).range(1..))]
    global_batch: Option<i64>,
    /// Lossy levers you accept, comma-separated: bf16, compress, int8-state,
    /// micro-batches (matters only when the step couples the samples of a batch, as
    /// BatchNorm in training mode or a reduction over the batch does: fit finds that
    /// itself, from the gradients of a split; otherwise micro-batches are lossless and
    /// always considered).
    #[arg(long, value_delimiter = ',', value_name = "LEVERS")]
    allow: Vec<memsave_bench::FitLever>,
    /// The optimizer stepped in every step (its state counts in the budget; it allows
    /// the step in backward), with
    /// its defaults. Default: the suite's first
    /// `optimizer:` technique with its lr, betas, eps, weight_decay and momentum (fit
    /// chooses its state's precision and where it steps), if any, else none.
    #[arg(long, value_name = "KIND")]
    optimizer: Option<FitOptimizer>,
    /// Fraction of the budget kept free for prediction errors. On the CPU, when nothing
    /// is predicted within it, a configuration predicted within the budget itself is
    /// run, and chosen if its measured peak is within the budget.
    #[arg(long, default_value_t = 0.05, value_parser = parse_margin)]
    margin: f64,
    /// Also run every candidate at its real size to check the choice (slow).
    #[arg(long)]
    exhaustive: bool,
    /// For a model of blocks, give every block the same lever (all kept, recomputed
    /// or offloaded together) instead of choosing each block's on its own: the
    /// uniform choice, to compare with the per-block one.
    #[arg(long)]
    uniform: bool,
    /// Keep the parameters on the device. Without it, on one process with an
    /// optimizer, when nothing fits with them there, fit may keep each unit's weights
    /// in files between its uses (offload_params(to=disk), lossless).
    #[arg(long)]
    no_offload_params: bool,
    /// Write the report as JSON.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Write the candidates, the front and the budget as an SVG picture.
    #[arg(long, value_name = "PATH")]
    plot: Option<PathBuf>,
    /// Fit on N local ranks (processes): every configuration is measured on all of
    /// them, each on its share of the global batch (which must divide by N), and the
    /// data-parallel mode (ddp, zero stage 1, 2 or 3) is chosen with the other levers.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=64))]
    world_size: Option<u64>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum FitOptimizer {
    Adamw,
    Sgd,
    None,
}

fn parse_margin(text: &str) -> Result<f64> {
    let m: f64 = text
        .parse()
        .map_err(|_| anyhow::anyhow!("'{text}' is not a number"))?;
    if !(0.0..1.0).contains(&m) {
        anyhow::bail!("the margin must be at least 0 and below 1, got {text}");
    }
    Ok(m)
}

/// `--memory-limit`: a size, positive as in a suite's `memory_limit`.
/// A percentage, `2` or `2%`, as a fraction (0.02): at least 0.
fn parse_percent(text: &str) -> Result<f64> {
    let number = text.trim().trim_end_matches('%').trim();
    match number.parse::<f64>() {
        Ok(p) if p.is_finite() && p >= 0.0 => Ok(p / 100.0),
        _ => anyhow::bail!("expected a percentage of 0 or more, e.g. 2 or 2%, got '{text}'"),
    }
}

/// A number of seconds, more than 0.
fn parse_seconds(text: &str) -> Result<f64> {
    match text.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(s),
        _ => anyhow::bail!("expected a number of seconds above 0, got '{text}'"),
    }
}

fn parse_memory_limit(text: &str) -> Result<Bytes> {
    let bytes: Bytes = text.parse()?;
    if bytes.0 == 0 {
        anyhow::bail!("a size must be positive, got '{text}'");
    }
    Ok(bytes)
}

/// Exit status 2: the input (suite or command line) is invalid.
struct Invalid(String);

fn main() -> ExitCode {
    memsave_meter::install();
    let cli = Cli::parse();
    let command = match cli.command {
        Command::Launch(args) => return launch(args),
        command => command,
    };
    // Every error is printed as one line without libtorch's C++ frames, and a panic
    // anywhere in the command is reported as one too (see `quietly`).
    let result = quietly(|| match command {
        Command::Bench(args) => bench(args),
        Command::Suites { name } => suites(name.as_deref()),
        Command::Launch(_) => unreachable!("launch returned above"),
        Command::Rank(args) => rank(args),
        Command::FitRank { dir } => Ok(memsave_bench::fit::run_fit_rank(&dir)?),
        Command::Trace(args) => trace(args),
        Command::Fit(args) => fit(args),
        Command::Check { suite } => check(&suite),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A signal ended a distributed case's ranks: end as the shells do.
        Err(e) if interrupted_by(&e).is_some() => {
            // The error alone: each error of its chain repeats its source's message.
            eprintln!("error: {}", memsave_bench::one_line(&format!("{e}")));
            let signal = interrupted_by(&e).unwrap_or(0);
            ExitCode::from(u8::try_from(128 + signal).unwrap_or(1))
        }
        Err(e) => match e.downcast::<Invalid>() {
            Ok(Invalid(e)) => {
                for line in e.lines() {
                    eprintln!("error: {}", memsave_bench::one_line(line));
                }
                ExitCode::from(2)
            }
            Err(e) => {
                eprintln!("error: {}", memsave_bench::one_line(&format!("{e:#}")));
                ExitCode::from(1)
            }
        },
    }
}

/// `memsave check`: the suite parses, and every strategy can run on every model as
/// `memsave bench` would run it (one process, or the suite's `world_size` ranks);
/// those that cannot, which `bench` reports `unavailable`, are errors (exit 2), one
/// line each with the reason.
fn check(name: &str) -> Result<()> {
    let suite = load(name)?;
    let mut problems = Vec::new();
    for strategy in &suite.strategies {
        let reasons: Vec<(&str, String)> = suite
            .models
            .iter()
            .filter_map(|m| {
                memsave_bench::availability(m, strategy, suite.world_size)
                    .err()
                    .map(|why| (m.name.as_str(), why.to_string()))
            })
            .collect();
        let everywhere =
            reasons.len() == suite.models.len() && reasons.windows(2).all(|w| w[0].1 == w[1].1);
        match reasons.first() {
            Some((_, why)) if everywhere => problems.push(format!(
                "{name}: strategy '{}' is unavailable: {why}",
                strategy.name
            )),
            _ => problems.extend(reasons.iter().map(|(model, why)| {
                format!(
                    "{name}: strategy '{}' is unavailable on model '{model}': {why}",
                    strategy.name
                )
            })),
        }
    }
    if !problems.is_empty() {
        return Err(invalid(problems.join("\n")));
    }
    println!(
        "{name}: ok (suite {}, {} models, {} strategies)",
        suite.suite,
        suite.models.len(),
        suite.strategies.len()
    );
    Ok(())
}

impl std::fmt::Debug for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Invalid {}

fn invalid(message: impl std::fmt::Display) -> anyhow::Error {
    Invalid(message.to_string()).into()
}

/// The suite an argument names, by the precedence in the module docs.
fn load(name_or_path: &str) -> Result<Suite> {
    let path = Path::new(name_or_path);
    let looks_like_path = name_or_path.contains(['/', std::path::MAIN_SEPARATOR])
        || path.extension().is_some_and(|e| e == "yaml" || e == "yml");
    let parsed = match bundled(name_or_path) {
        Some(b) if !looks_like_path => {
            if path.is_file() {
                return Err(invalid(format!(
                    "'{name_or_path}' names both the bundled suite {name_or_path} and the file ./{name_or_path}: write ./{name_or_path} for the file, or run from another directory for the bundled suite"
                )));
            }
            if path.exists() {
                eprintln!(
                    "note: running the bundled suite '{name_or_path}' (./{name_or_path} is not a file; write a path such as ./{name_or_path}/suite.yaml for a file in it)"
                );
            }
            Suite::from_yaml(b.source, &b.file_name())
        }
        _ => Suite::from_file(path),
    };
    parsed.map_err(invalid)
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
        let suite = Suite::from_yaml(b.source, &b.file_name()).map_err(invalid)?;
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
    for (flag, path) in [("--json", &args.json), ("--csv", &args.csv)] {
        if let Some(path) = path {
            check_writable_file(flag, path)?;
        }
    }
    if let Some(dir) = &args.plot {
        check_writable_dir("--plot", dir)?;
    }
    let options = RunOptions {
        filter: args.filter,
        repeats: args.repeats.map(|n| n as usize),
        rounds: Rounds {
            target_spread: args.target_spread,
            max_rounds: args.max_rounds as usize,
            max_time_s: args.max_rounds_time,
        },
        warmup: args.warmup,
        threads: args.threads.map(|n| n as usize),
        memory_limit: args.memory_limit.map(|b| b.0),
        world_size: args.world_size.map(|n| n as usize),
        rank_program: None,
    };
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

/// The signal that interrupted the ranks of a distributed case, if that is why the
/// command failed.
fn interrupted_by(e: &anyhow::Error) -> Option<i32> {
    e.chain()
        .find_map(|c| c.downcast_ref::<memsave_bench::distributed::DistributedError>())
        .and_then(memsave_bench::distributed::DistributedError::interrupted_by)
}

/// `memsave rank`: one rank of a distributed case.
fn rank(args: RankCli) -> Result<()> {
    let suite = Suite::from_file(&args.suite).map_err(invalid)?;
    let rank_args = memsave_bench::distributed::RankArgs {
        model: args.model,
        strategy: args.strategy,
        out_dir: args.out_dir,
        warmup: args.warmup,
        repeats: args.repeats,
        threads: args.threads,
        memory_limit: args.memory_limit,
        trace: args
            .trace_top
            .map(|top| memsave_bench::distributed::RankTrace {
                top,
                title: args.trace_title,
                html: args.trace_html,
                snapshot: args.trace_snapshot,
                svg: args.trace_svg,
            }),
    };
    Ok(memsave_bench::distributed::run_rank(&suite, &rank_args)?)
}

fn fit(args: FitArgs) -> Result<()> {
    let suite = load(&args.suite)?;
    for (flag, path) in [("--json", &args.json), ("--plot", &args.plot)] {
        if let Some(path) = path {
            check_writable_file(flag, path)?;
        }
    }
    let mut request = memsave_fit::FitRequest::new(args.budget.0);
    request.global_batch = args.global_batch;
    request.margin = args.margin;
    request.exhaustive = args.exhaustive;
    request.per_block = !args.uniform;
    request.offload_params = !args.no_offload_params;
    request.allow = memsave_bench::FitLever::allow(&args.allow);
    let of = |kind| memsave_bench::OptimizerSpec {
        kind,
        ..Default::default()
    };
    let optimizer = match args.optimizer {
        Some(FitOptimizer::Adamw) => Some(of(memsave_bench::OptimizerKind::Adamw)),
        Some(FitOptimizer::Sgd) => Some(of(memsave_bench::OptimizerKind::Sgd)),
        Some(FitOptimizer::None) => None,
        None => memsave_bench::fit::suite_optimizer(&suite),
    };
    if let Some(world_size) = args.world_size.filter(|&n| n > 1) {
        return fit_on_ranks(&suite, &args, &request, optimizer, world_size as usize);
    }
    let mut progress = FitProgress::new();
    let outcome =
        memsave_bench::fit_model_with(&suite, &args.model, &request, optimizer, &mut |event| {
            progress.phase(event)
        });
    progress.finish();
    let report = match outcome {
        Ok(report) => report,
        Err(e @ memsave_bench::FitCaseError::UnknownModel { .. }) => {
            return Err(invalid(format!("{}: {e}", args.suite)))
        }
        Err(memsave_bench::FitCaseError::GlobalBatch { batch, source }) => {
            return Err(invalid(format!("--global-batch {batch}: {source}")))
        }
        Err(e @ memsave_bench::FitCaseError::TooLarge(_)) => return Err(anyhow::anyhow!("{e}")),
        Err(e @ memsave_bench::FitCaseError::Fit(memsave_fit::FitError::Infeasible { .. })) => {
            return Err(anyhow::anyhow!("{e}"))
        }
        Err(
            e @ memsave_bench::FitCaseError::Fit(
                memsave_fit::FitError::ZeroBudget
                | memsave_fit::FitError::BadGlobalBatch(_)
                | memsave_fit::FitError::BadMargin(_)
                | memsave_fit::FitError::BatchOfOne { .. },
            ),
        ) => return Err(invalid(e)),
        Err(e) => return Err(e.into()),
    };
    print!("{}", report.to_text());
    println!("fit took {:.2} s", report.fit_time_s);
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report).context("serializing the report")?;
        write_atomic(path, json + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        let svg = memsave_bench::fit_svg(&report).map_err(|e| anyhow::anyhow!("plot: {e}"))?;
        write_atomic(path, svg).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// `memsave fit --world-size N`: rank 0's report, with each rank's measured peak.
fn fit_on_ranks(
    suite: &Suite,
    args: &FitArgs,
    request: &memsave_fit::FitRequest,
    optimizer: Option<memsave_bench::OptimizerSpec>,
    world_size: usize,
) -> Result<()> {
    use memsave_bench::FitCaseError;
    let outcome = memsave_bench::fit::fit_model_on_ranks(
        suite,
        &args.model,
        request,
        optimizer,
        world_size,
        args.plot.is_some(),
        None,
    );
    let fitted = match outcome {
        Ok(fitted) => fitted,
        Err(e @ FitCaseError::UnknownModel { .. }) => {
            return Err(invalid(format!("{}: {e}", args.suite)))
        }
        Err(FitCaseError::GlobalBatch { batch, source }) => {
            return Err(invalid(format!("--global-batch {batch}: {source}")))
        }
        Err(e @ FitCaseError::Fit(memsave_fit::FitError::Indivisible { .. })) => {
            return Err(invalid(format!("--world-size {world_size}: {e}")))
        }
        // Kept whole, so that an interrupted run ends as the shells do.
        Err(FitCaseError::Ranks(e)) => return Err(e.into()),
        Err(e) => return Err(anyhow::anyhow!("{e}")),
    };
    print!("{}", fitted.text);
    println!("fit took {:.2} s on {world_size} ranks", fitted.fit_time_s);
    if let Some(path) = &args.json {
        write_atomic(path, fitted.json + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let (Some(path), Some(svg)) = (&args.plot, fitted.svg) {
        write_atomic(path, svg).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn trace(args: TraceArgs) -> Result<()> {
    let suite = load(&args.suite)?;
    for (flag, path) in [
        ("--html", &args.html),
        ("--snapshot", &args.snapshot),
        ("--svg", &args.svg),
    ] {
        if let Some(path) = path {
            check_writable_file(flag, path)?;
        }
    }
    if let Some(world_size) = suite.world_size {
        return trace_on_ranks(&suite, &args, world_size);
    }
    let case = match memsave_bench::trace_case(&suite, &args.model, &args.strategy) {
        Err(
            e @ (memsave_bench::TraceCaseError::UnknownModel { .. }
            | memsave_bench::TraceCaseError::UnknownStrategy { .. }),
        ) => return Err(invalid(format!("{}: {e}", args.suite))),
        other => other?,
    };
    print!("{}", case.trace.summary(args.top));
    let title = trace_title(&suite, &args);
    if let Some(path) = &args.html {
        write_atomic(path, case.trace.to_html(&title, args.top))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.snapshot {
        write_atomic(path, case.trace.to_snapshot_pickle()?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.svg {
        write_atomic(path, case.trace.timeline_svg())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    // The trace (and the files) show where the step failed; the failure is the result.
    if let Err(e) = &case.step {
        anyhow::bail!(
            "the traced step failed: {}",
            memsave_bench::one_line(&e.to_string())
        );
    }
    Ok(())
}

fn trace_title(suite: &Suite, args: &TraceArgs) -> String {
    format!(
        "memsave trace: {} / {} ({})",
        args.model, args.strategy, suite.suite
    )
}

/// `memsave trace` of a suite with `world_size`: the case runs on that many ranks, as
/// `memsave bench` runs it, and rank 0's step is recorded.
fn trace_on_ranks(suite: &Suite, args: &TraceArgs, world_size: usize) -> Result<()> {
    let unknown = |e: memsave_bench::TraceCaseError| invalid(format!("{}: {e}", args.suite));
    let model = suite
        .models
        .iter()
        .find(|m| m.name == args.model)
        .ok_or_else(|| {
            unknown(memsave_bench::TraceCaseError::UnknownModel {
                name: args.model.clone(),
                known: names(suite.models.iter().map(|m| m.name.as_str())),
            })
        })?;
    let strategy = suite
        .strategies
        .iter()
        .find(|s| s.name == args.strategy)
        .ok_or_else(|| {
            unknown(memsave_bench::TraceCaseError::UnknownStrategy {
                name: args.strategy.clone(),
                known: names(suite.strategies.iter().map(|s| s.name.as_str())),
            })
        })?;
    let request = memsave_bench::distributed::RankTrace {
        top: args.top,
        title: trace_title(suite, args),
        html: args.html.is_some(),
        snapshot: args.snapshot.is_some(),
        svg: args.svg.is_some(),
    };
    let traced = memsave_bench::distributed::trace_on_ranks(
        suite, model, strategy, world_size, &request, None,
    )?;
    println!("rank 0 of {world_size} (the suite's world_size):");
    print!("{}", traced.summary);
    for (path, bytes) in [
        (&args.html, traced.html.map(String::into_bytes)),
        (&args.snapshot, traced.snapshot),
        (&args.svg, traced.svg.map(String::into_bytes)),
    ] {
        if let (Some(path), Some(bytes)) = (path, bytes) {
            write_atomic(path, bytes).with_context(|| format!("writing {}", path.display()))?;
        }
    }
    if let Some(e) = traced.step_error {
        anyhow::bail!("the traced step failed: {}", memsave_bench::one_line(&e));
    }
    Ok(())
}

fn names<'a>(names: impl Iterator<Item = &'a str>) -> String {
    names.collect::<Vec<_>>().join(", ")
}

/// Checks before the run that `path` can be written as a file: it is not a directory,
/// its directory exists, and a file can be created there (the results are written to
/// a temporary file in that directory, then renamed). Its errors are [`Invalid`].
fn check_writable_file(flag: &str, path: &Path) -> Result<()> {
    let shown = path.display();
    if path.is_dir() {
        return Err(invalid(format!(
            "{flag} {shown}: is a directory, not a file"
        )));
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if !dir.is_dir() {
        return Err(invalid(format!(
            "{flag} {shown}: the directory {} does not exist",
            dir.display()
        )));
    }
    probe(dir).map_err(|e| {
        invalid(format!(
            "{flag} {shown}: cannot write in {}: {e}",
            dir.display()
        ))
    })
}

/// Checks before the run that files can be written in `dir`, or in the nearest
/// existing directory above it (the plots create the rest). Its errors are
/// [`Invalid`].
fn check_writable_dir(flag: &str, dir: &Path) -> Result<()> {
    let shown = dir.display();
    let existing = dir
        .ancestors()
        .map(|a| {
            if a.as_os_str().is_empty() {
                Path::new(".")
            } else {
                a
            }
        })
        .find(|a| a.exists())
        .unwrap_or(Path::new("."));
    if !existing.is_dir() {
        return Err(invalid(format!(
            "{flag} {shown}: {} is not a directory",
            existing.display()
        )));
    }
    probe(existing).map_err(|e| {
        invalid(format!(
            "{flag} {shown}: cannot write in {}: {e}",
            existing.display()
        ))
    })
}

/// Creates and removes an empty file in `dir`.
fn probe(dir: &Path) -> std::io::Result<()> {
    let file = dir.join(format!(".memsave-probe-{}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&file)?;
    std::fs::remove_file(&file)
}

/// The last panic seen by [`quietly`]'s hook: its message and place.
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Runs `f` with panic messages kept off the terminal: a panic inside a case is caught
/// by the runner and shown in the results, so printing it too would only clutter the
/// progress. A panic that escapes `f` (a bug) is reported as an error with its place,
/// in one line (never Rust's backtrace note nor libtorch's C++ frames).
fn quietly<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let previous = panic::take_hook();
    panic::set_hook(Box::new(|info| {
        let text = format!(
            "{} at {}",
            memsave_bench::one_line(&memsave_sys::checkpoint::panic_message(info.payload())),
            info.location()
                .map_or_else(|| "?".to_owned(), |l| l.to_string())
        );
        *LAST_PANIC.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
    }));
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    panic::set_hook(previous);
    match result {
        Ok(r) => r,
        Err(_) => {
            let last = LAST_PANIC.lock().unwrap_or_else(|p| p.into_inner()).take();
            anyhow::bail!(
                "internal error, please report it: panicked: {}",
                last.unwrap_or_else(|| "unknown panic".to_owned())
            )
        }
    }
}

/// A progress bar on a terminal; one line per case otherwise.
struct Progress {
    bar: Option<ProgressBar>,
    done: usize,
    total: usize,
    /// The model and timed round last shown.
    round: Option<(String, usize)>,
}

impl Progress {
    fn new() -> Self {
        Self {
            bar: None,
            done: 0,
            total: 0,
            round: None,
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

    fn timed_step(&mut self, model: &str, _strategy: &str, round: usize, rounds: usize) {
        if self
            .round
            .as_ref()
            .is_some_and(|(m, r)| m == model && *r == round)
        {
            return;
        }
        self.round = Some((model.to_owned(), round));
        let text = format!("{model}: timed round {} (at most {rounds})", round + 1);
        match &self.bar {
            Some(bar) => bar.set_message(text),
            None => eprintln!("{text}"),
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

/// What `memsave fit` is doing: a spinner with the elapsed time and the step of the
/// search on a terminal, else one line per phase on stderr (a fit of a large global
/// batch can take minutes).
struct FitProgress {
    bar: Option<ProgressBar>,
}

impl FitProgress {
    fn new() -> Self {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} fit: {elapsed} {wide_msg}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar.enable_steady_tick(std::time::Duration::from_millis(200));
            bar
        });
        Self { bar }
    }

    fn phase(&mut self, event: &memsave_fit::FitEvent) {
        match &self.bar {
            Some(bar) => bar.set_message(event.to_string()),
            None if event.is_phase() => eprintln!("fit: {event}"),
            None => {}
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// `memsave launch`: exits 0 when every rank succeeded, with the failed rank's own exit
/// code (128 + signal when killed) when one failed, 128 + signal when SIGINT, SIGTERM or
/// SIGHUP to the launcher ended the ranks, 124 when `--timeout` ended them, 127 when the
/// program cannot be started, 2 on bad options (nothing started), 1 otherwise.
fn launch(args: LaunchArgs) -> ExitCode {
    use memsave_dist::DistError;
    let config = memsave_dist::LaunchConfig {
        nproc_per_node: args.nproc_per_node,
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr,
        master_port: args.master_port,
        timeout: args.timeout.map(std::time::Duration::from_secs),
        ..Default::default()
    };
    let (program, rest) = args.command.split_first().expect("clap requires a command");
    match memsave_dist::launch(&config, program, rest) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memsave launch: error: {e}");
            match e {
                DistError::RankFailed { exit_code, .. } => {
                    ExitCode::from(u8::try_from(exit_code).unwrap_or(1).max(1))
                }
                DistError::InvalidLaunch { .. } => ExitCode::from(2),
                DistError::Interrupted { signal, .. } => {
                    ExitCode::from(u8::try_from(128 + signal).unwrap_or(1))
                }
                // As timeout(1) and the shells: 124 for a timeout, 127 for a program
                // that cannot be started.
                DistError::LaunchTimeout { .. } => ExitCode::from(124),
                DistError::Spawn { .. } => ExitCode::from(127),
                _ => ExitCode::from(1),
            }
        }
    }
}
