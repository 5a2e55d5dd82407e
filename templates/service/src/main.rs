use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    reliability::service::init_tracing();
    let settings = __SERVICE__::Settings::parse();
    if settings.common.openapi {
        let api = reliability::service::openapi("__SERVICE__", __SERVICE__::http::router);
        println!("{}", serde_json::to_string_pretty(&api)?);
        return Ok(());
    }
    let dbs =
        reliability::service::Databases::connect_lazy(&settings.database_url, &settings.common)?;
    let app = __SERVICE__::build(settings, dbs, reliability::shutdown::token()).await?;
    Ok(app.run_until_stopped().await?)
}
