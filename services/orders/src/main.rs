use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    reliability::service::init_tracing();
    let settings = orders::Settings::parse();
    let app = orders::Application::build(settings, reliability::shutdown::token()).await?;
    app.run_until_stopped().await
}
