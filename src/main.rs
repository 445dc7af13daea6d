//! The `kube-event-bridge` command: parse the CLI, load the config, set up logging, run the
//! service until SIGTERM or SIGINT.
//!
//! Exit codes: 0 after a clean shutdown, 2 for a bad config or command line, 1 for anything
//! else (no reachable cluster, a kind that cannot be watched, a port in use).

use std::{path::PathBuf, process::ExitCode};

use anyhow::Context;
use clap::ValueEnum;
use clap::{Parser, Subcommand};
use kube_event_bridge::{
    app::App,
    cluster,
    config::{Config, LogConfig, LogFormat},
    consumer::{self, event::Filter, tail},
};
use tracing::{error, info};

/// mimalloc (`kube_event_bridge::allocator`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "kube-event-bridge",
    version,
    about = "Exports Kubernetes informer events to message brokers"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the service.
    Run {
        /// Config file (YAML); `KEB_*` environment variables override it.
        #[arg(long, short, default_value = "config/default.yaml")]
        config: PathBuf,
    },
    /// Show how namespaces fall into `sharding.shards` shards (FNV-1a of the namespace, as
    /// KEP-5866 splits them): objects of one namespace always share a shard. Namespaces come
    /// from the arguments, or one per line on standard input
    /// (`kubectl get ns -o name | cut -d/ -f2 | kube-event-bridge shards --shards 12`).
    Shards {
        /// Number of shards.
        #[arg(long, default_value_t = 12)]
        shards: u32,
        /// Namespaces (none: read them from standard input).
        namespaces: Vec<String>,
    },
    /// Write a kube-event-bridge config equivalent to another exporter's (its resources,
    /// namespaces, selectors, filters, Kafka brokers, topic and auth where they map), with
    /// what has no equivalent listed as comments at the top and on standard error.
    Convert {
        /// The other exporter's config format.
        #[arg(long, value_enum)]
        from: ConvertFrom,
        /// Its config file (YAML); for the OpenTelemetry Collector, the whole Collector config.
        file: PathBuf,
        /// Write the config to this file instead of standard output.
        #[arg(long, short)]
        output: Option<PathBuf>,
    },
    /// Load and validate a config file, then print the effective config as JSON.
    CheckConfig {
        /// Config file (YAML).
        file: PathBuf,
    },
    /// Print the JSON Schema of the config file (as `schemas/config.schema.json`): for
    /// editors (`# yaml-language-server: $schema=…`) and for linting configs in CI.
    Schema,
    /// Print the objects a sink's destination holds, like `kubectl get` or as JSON: a Kafka
    /// state topic (offset 0, last value per key, tombstones drop) or a JetStream stream (the
    /// newest event per object, deletes drop); with --check, how they differ from the
    /// cluster (exit code 3 when they do).
    State {
        #[command(flatten)]
        from: Destination,
        /// `table` for people, `json` for scripts.
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
        /// Compare with the live API server and print the differences.
        #[arg(long)]
        check: bool,
    },
    /// Print the messages a sink's destination receives (Kafka topics, a JetStream stream or
    /// core NATS subjects), one line each: `time type kind namespace/name resourceVersion`,
    /// or the structured CloudEvent with --output json. Runs until Ctrl-C (or --count).
    Tail {
        #[command(flatten)]
        from: Destination,
        /// Print what the destination already holds first (not for core NATS).
        #[arg(long)]
        from_beginning: bool,
        /// Only these kinds or resources (`ConfigMap`, `configmaps`, `widgets.example.com`).
        #[arg(long = "kind", value_name = "KIND")]
        kinds: Vec<String>,
        /// Only these namespaces.
        #[arg(long = "namespace", short = 'n', value_name = "NAMESPACE")]
        namespaces: Vec<String>,
        /// Only these event types.
        #[arg(long = "type", value_enum, value_name = "TYPE")]
        types: Vec<EventTypeArg>,
        /// Only objects whose labels match this selector (`app=web,tier!=db,env in (a,b)`).
        #[arg(long, short = 'l')]
        selector: Option<String>,
        /// Stop after printing this many messages.
        #[arg(long)]
        count: Option<u64>,
        /// `table` (one line per message, for people) or `json` (one CloudEvent per line).
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
}

/// The sink whose destination a consumer tool reads.
#[derive(clap::Args)]
struct Destination {
    /// Config file (YAML) naming the sink; `KEB_*` environment variables override it.
    #[arg(long, short, default_value = "config/default.yaml")]
    config: PathBuf,
    /// The sink (`kafka`, or `nats`; `state` takes a Kafka state topic or JetStream).
    #[arg(long)]
    sink: String,
    /// Kafka topics to read; by default every topic the sink's topic template can render
    /// (with the config's cluster name).
    #[arg(long = "topic", value_name = "TOPIC")]
    topics: Vec<String>,
    /// NATS subject filter; by default every subject the sink publishes to.
    #[arg(long)]
    subject: Option<String>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum EventTypeArg {
    Added,
    Updated,
    Deleted,
    Synced,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ConvertFrom {
    /// The OpenTelemetry Collector's `k8sobjects` receiver (with its Kafka, debug or file
    /// exporters).
    OtelK8sobjects,
    /// kubernetes-event-exporter (resmoio, formerly Opsgenie).
    KubernetesEventExporter,
}

/// `convert`: reads `file`, writes the config (stdout or `output`), lists the notes on stderr.
fn convert(
    from: ConvertFrom,
    file: &std::path::Path,
    output: Option<&std::path::Path>,
) -> ExitCode {
    use kube_event_bridge::convert::{self, Source};
    let source = match from {
        ConvertFrom::OtelK8sobjects => Source::OtelK8sObjects,
        ConvertFrom::KubernetesEventExporter => Source::KubernetesEventExporter,
    };
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(err) => {
            eprintln!("convert: cannot read {}: {err}", file.display());
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    let conversion = match convert::convert(source, &text) {
        Ok(c) => c,
        Err(err) => {
            eprintln!("convert: {}: {err}", file.display());
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    let yaml = conversion.to_yaml(source, &file.display().to_string());
    match output {
        Some(path) => {
            if let Err(err) = std::fs::write(path, &yaml) {
                eprintln!("convert: cannot write {}: {err}", path.display());
                return ExitCode::FAILURE;
            }
        }
        None => print!("{yaml}"),
    }
    for note in &conversion.notes {
        eprintln!("convert: not carried over exactly: {note}");
    }
    ExitCode::SUCCESS
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Output {
    Table,
    Json,
}

/// `shards`: which shard each namespace falls into, and the balance.
fn print_shards(shards: u32, mut namespaces: Vec<String>) -> ExitCode {
    use kube_event_bridge::shard::{MAX_SHARDS, ShardingConfig};
    if shards == 0 || shards > MAX_SHARDS {
        eprintln!("shards: --shards must be between 1 and {MAX_SHARDS}, not {shards}");
        return ExitCode::from(EXIT_BAD_CONFIG);
    }
    if namespaces.is_empty() {
        namespaces = std::io::stdin()
            .lines()
            .map_while(Result::ok)
            .map(|l| l.trim().trim_start_matches("namespace/").to_owned())
            .filter(|l| !l.is_empty())
            .collect();
    }
    let all = ShardingConfig { shards }.all();
    let mut per: Vec<Vec<&str>> = vec![Vec::new(); all.len()];
    for ns in &namespaces {
        let i = all
            .iter()
            .position(|s| s.holds_namespace(ns))
            .expect("the shards cover every hash");
        per[i].push(ns);
    }
    for (shard, names) in all.iter().zip(&per) {
        let shown: Vec<&str> = names.iter().take(8).copied().collect();
        let more = names.len().saturating_sub(shown.len());
        let more = if more > 0 {
            format!(" … and {more} more")
        } else {
            String::new()
        };
        println!(
            "{}\t{}\t{}{more}",
            shard.label(),
            names.len(),
            shown.join(" ")
        );
    }
    let used = per.iter().filter(|n| !n.is_empty()).count();
    let most = per.iter().map(Vec::len).max().unwrap_or(0);
    let mean = namespaces.len() as f64 / all.len() as f64;
    println!(
        "{} namespaces in {used} of {shards} shards; the fullest holds {most} (mean {mean:.1}); \
         cluster-scoped objects all fall into {}",
        namespaces.len(),
        all.iter()
            .find(|s| s.holds_namespace(""))
            .expect("covered")
            .label()
    );
    ExitCode::SUCCESS
}

const EXIT_DIFFERENCES: u8 = 3;

const EXIT_BAD_CONFIG: u8 = 2;

fn main() -> ExitCode {
    kube_event_bridge::allocator::configure();
    let cli = Cli::parse();
    match cli.command {
        Command::Shards { shards, namespaces } => print_shards(shards, namespaces),
        Command::Convert { from, file, output } => convert(from, &file, output.as_deref()),
        Command::CheckConfig { file } => match Config::load(&file) {
            Ok(config) => {
                println!("{}", config.to_pretty_json());
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("{}: {err}", file.display());
                ExitCode::from(EXIT_BAD_CONFIG)
            }
        },
        Command::State {
            from,
            output,
            check,
        } => {
            let (config, runtime) = match tool_setup(&from.config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            match runtime.block_on(state(config, from, output, check)) {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::from(EXIT_DIFFERENCES),
                Err(err) if matches!(err.downcast_ref(), Some(consumer::Error::Usage(_))) => {
                    eprintln!("state: {err:#}");
                    ExitCode::from(EXIT_BAD_CONFIG)
                }
                Err(err) => {
                    eprintln!("state: {err:#}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Tail {
            from,
            from_beginning,
            kinds,
            namespaces,
            types,
            selector,
            count,
            output,
        } => {
            let labels = match selector
                .as_deref()
                .map(kube_event_bridge::selector::parse)
                .transpose()
            {
                Ok(l) => l,
                Err(err) => {
                    eprintln!("tail: --selector: {err}");
                    return ExitCode::from(EXIT_BAD_CONFIG);
                }
            };
            let (config, runtime) = match tool_setup(&from.config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let options = tail::Options {
                sink: from.sink,
                topics: from.topics,
                subject: from.subject,
                from_beginning,
                filter: Filter {
                    kinds,
                    namespaces,
                    types: types
                        .iter()
                        .map(|t| {
                            t.to_possible_value()
                                .expect("no skipped variants")
                                .get_name()
                                .to_owned()
                        })
                        .collect(),
                    labels,
                },
                count,
                json: matches!(output, Output::Json),
            };
            match runtime.block_on(tail::run(&config, &options, shutdown_signal())) {
                Ok(_) => ExitCode::SUCCESS,
                Err(err @ consumer::Error::Usage(_)) => {
                    eprintln!("tail: {err}");
                    ExitCode::from(EXIT_BAD_CONFIG)
                }
                Err(err) => {
                    eprintln!("tail: {err}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Schema => {
            println!(
                "{}",
                serde_json::to_string_pretty(&Config::json_schema()).expect("JSON")
            );
            ExitCode::SUCCESS
        }
        Command::Run { config } => {
            let config = match Config::load(&config) {
                Ok(c) => c,
                Err(err) => {
                    eprintln!("{}: {err}", config.display());
                    return ExitCode::from(EXIT_BAD_CONFIG);
                }
            };
            init_logging(&config.log);
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            match runtime.block_on(run(config)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => {
                    error!("{err:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

async fn run(config: Config) -> anyhow::Result<()> {
    let metrics = std::sync::Arc::new(kube_event_bridge::metrics::Metrics::new());
    let (client, target) = cluster::connect(&config.kubernetes, &metrics).await?;
    info!(
        server = %target.server,
        kubeconfig = %target.kubeconfig.as_ref().map_or("in-cluster".into(), |p| p.display().to_string()),
        context = target.context.as_deref().unwrap_or("-"),
        "Connected to the Kubernetes API"
    );
    let app = App::build_with_metrics(config, client, metrics)
        .await
        .context("cannot start")?;
    let report = app.run(shutdown_signal()).await;
    if !report.undelivered.is_empty() {
        anyhow::bail!(
            "shutdown left {} notifications undelivered",
            report.undelivered.values().sum::<usize>()
        );
    }
    Ok(())
}

/// Loads the config of a consumer tool (exit code 2 when it is bad), logs warnings only, and
/// builds the runtime.
fn tool_setup(path: &std::path::Path) -> Result<(Config, tokio::runtime::Runtime), ExitCode> {
    let config = Config::load(path).map_err(|err| {
        eprintln!("{}: {err}", path.display());
        ExitCode::from(EXIT_BAD_CONFIG)
    })?;
    // A consumer tool is run by people: its warnings read as lines unless `json` is asked for.
    let format = match config.log.format {
        LogFormat::Auto => LogFormat::Pretty,
        other => other,
    };
    init_logging(&LogConfig {
        level: "warn".into(),
        format,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    Ok((config, runtime))
}

/// The `state` command; `Ok(false)` when --check found differences.
async fn state(
    config: Config,
    from: Destination,
    output: Output,
    check: bool,
) -> anyhow::Result<bool> {
    use kube_event_bridge::consumer::{progress::Progress, state};
    let Destination {
        sink,
        topics,
        subject,
        ..
    } = from;
    let mut progress = Progress::new("messages");
    let objects = state::read(&config, &sink, &topics, subject.as_deref(), &mut progress).await?;
    progress.finish();
    let differences = if check {
        let metrics = kube_event_bridge::metrics::Metrics::new();
        let (client, _) = cluster::connect(&config.kubernetes, &metrics).await?;
        Some(state::check(&config, &client, &sink, &objects).await?)
    } else {
        None
    };
    match output {
        Output::Table => {
            print!("{}", state::table(&objects, jiff::Timestamp::now()));
            if let Some(d) = &differences {
                if d.last_wins == d.deduplicated {
                    println!(
                        "\n{} difference(s) with the cluster (both consumer models: last message wins, and deduplicate by id then last wins)",
                        d.last_wins.len()
                    );
                    d.last_wins.iter().for_each(|d| println!("{d}"));
                } else {
                    for (model, found) in [
                        ("last message wins", &d.last_wins),
                        ("deduplicate by id, then last wins", &d.deduplicated),
                    ] {
                        println!(
                            "\n{} difference(s) with the cluster for a consumer that folds by {model}",
                            found.len()
                        );
                        found.iter().for_each(|d| println!("{d}"));
                    }
                }
            }
        }
        Output::Json => {
            let objects: Vec<_> = objects.objects.values().collect();
            let doc = match &differences {
                None => serde_json::json!(objects),
                Some(d) => serde_json::json!({
                    "objects": objects,
                    "differences": d.last_wins.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    "differences_deduplicated": d.deduplicated.iter().map(ToString::to_string).collect::<Vec<_>>(),
                }),
            };
            println!("{doc}");
        }
    }
    Ok(differences.is_none_or(|d| d.is_empty()))
}

/// Resolves on SIGTERM or SIGINT.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => info!("SIGINT received"),
            _ = term.recv() => info!("SIGTERM received"),
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

fn init_logging(log: &LogConfig) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&log.level));
    // Logs go to stderr: stdout belongs to the stdout sink. Colours only for a terminal
    // (a file or a pod's log gets none), and never with NO_COLOR (no-color.org).
    use std::io::IsTerminal;
    let colour = std::io::stderr().is_terminal()
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(colour)
        .with_writer(std::io::stderr);
    let json = match log.format {
        LogFormat::Json => true,
        LogFormat::Pretty => false,
        LogFormat::Auto => !std::io::stderr().is_terminal(),
    };
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
