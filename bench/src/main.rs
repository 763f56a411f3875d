//! `kvroute-bench`: `routing` (the routing comparison, see `bench/scripts/bench-routing.sh`)
//! `collector` (the collector benchmarks, see `bench/scripts/bench-collector.sh`),
//! `ingest-stall` (`/query` during a huge batch) and `soak` (see `bench/scripts/bench-soak.sh`).
//! `--help` on each describes its flags.

use clap::{Parser, Subcommand};
use kvroute_bench::{collector, ingest_stall, routing, soak};

#[derive(Parser)]
#[command(name = "kvroute-bench", version, about = "kvroute's system benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Compare routing policies on one trace and one simulated fleet.
    // Boxed: the routing flags are many beside the collector's.
    Routing(Box<routing::BenchArgs>),
    /// The collector's ingest, /query and memory benchmarks (markdown report on stdout).
    Collector(collector::CollectorArgs),
    /// /query latency while one huge batch is applied, sliced and not (markdown on stdout).
    IngestStall(ingest_stall::StallArgs),
    /// The real collector binary under a steady fleet and hostile peers; RSS over time.
    Soak(soak::SoakArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Routing(a) => {
            init_tracing();
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(routing::main(*a))
        }
        // Builds its own runtimes, sized per phase; its progress goes to stderr unformatted.
        Cmd::Collector(a) => {
            collector::run(a);
            Ok(())
        }
        Cmd::IngestStall(a) => ingest_stall::run(a),
        Cmd::Soak(a) => soak::run(a),
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("kvroute_sim=info,kvroute_bench=info")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
