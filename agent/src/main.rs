use clap::Parser;

fn main() -> std::process::ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).init();
    let cli = ambpf::cli::Cli::parse();
    match ambpf::cli::execute(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ambpf: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
