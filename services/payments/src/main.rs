use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    reliability::service::init_tracing();
    let settings = payments::Settings::parse();
    let app = payments::Application::build(settings, reliability::shutdown::token()).await?;
    app.run_until_stopped().await
}
