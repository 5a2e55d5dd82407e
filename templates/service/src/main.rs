use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    reliability::service::init_tracing();
    let settings = __SERVICE__::Settings::parse();
    let app = __SERVICE__::Application::build(settings, reliability::shutdown::token()).await?;
    app.run_until_stopped().await
}
