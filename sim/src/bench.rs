//! The routing benchmark (filled in below).

/// Flags of `kvroute-sim bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {}

/// Runs the benchmark.
///
/// # Errors
/// Setup failures.
pub async fn main(_a: BenchArgs) -> anyhow::Result<()> {
    Ok(())
}
