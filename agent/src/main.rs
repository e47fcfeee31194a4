use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = ambpf::cli::Cli::parse();
    // The flag was checked by clap; RUST_LOG is checked here.
    if let Err(e) = ambpf::logging::init(cli.log_format, cli.log_level.as_deref()) {
        eprintln!("ambpf: error: {e}");
        return std::process::ExitCode::FAILURE;
    }
    match ambpf::cli::execute(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ambpf: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
