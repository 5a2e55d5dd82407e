use clap::Parser;
use psp_sim::{Application, Settings};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    service_kit::service::init_tracing();
    let app = Application::build(Settings::parse()).await?;
    app.run_until_stopped(reliability::shutdown::token()).await
}
