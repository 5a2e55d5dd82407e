use clap::Parser;
use psp_sim::{Application, Settings};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    reliability::service::init_tracing();
    let app = Application::build(Settings::parse()).await?;
    app.run_until_stopped(reliability::shutdown::token()).await
}
