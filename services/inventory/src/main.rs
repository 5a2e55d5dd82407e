use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    reliability::service::init_tracing();
    let settings = inventory::Settings::parse();
    if settings.common.openapi {
        let api = reliability::service::openapi("inventory", inventory::http::router);
        println!("{}", serde_json::to_string_pretty(&api)?);
        return Ok(());
    }
    let app = inventory::Application::build(settings, reliability::shutdown::token()).await?;
    app.run_until_stopped().await
}
